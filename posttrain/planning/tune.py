"""The `posttrain tune` command: estimate, measure, print a table, write a config overlay."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table

from posttrain.config.errors import ConfigError
from posttrain.config.load import apply_values, build_config, flatten, to_dict
from posttrain.config.plan import build_plan
from posttrain.config.schema import PostTrainConfig
from posttrain.models.hub import cached_snapshot, looks_like_hub_id
from posttrain.planning.advice import starting_point
from posttrain.planning.autotune import Target, TuneResult, autotune, tune_targets
from posttrain.planning.memory import Cluster, estimate_memory
from posttrain.planning.shape import GIB, ModelShape, builtin_tiny_hf_config

_PHASE = {
    "actor": "actor_update",
    "old_log_prob": "old_log_prob",
    "critic": "critic_update",
    "values": "values",
}


def model_config_dict(cfg: PostTrainConfig, model_config: str | None) -> dict:
    """The architecture (a Hugging Face config dict) the trials build with random weights."""
    if model_config:
        p = Path(model_config)
        return json.loads((p / "config.json" if p.is_dir() else p).read_text())
    if cfg.model.path in ("builtin:tiny", "builtin:base"):
        return builtin_tiny_hf_config().to_dict()
    snapshot = cached_snapshot(cfg.model.path) if looks_like_hub_id(cfg.model.path) else None
    p = (snapshot or Path(cfg.model.path)) / "config.json"
    if not p.is_file():
        raise ConfigError(
            f"model.path={cfg.model.path!r} has no config.json; give a model directory or --model-config"
        )
    return json.loads(p.read_text())


def _device(choice: str) -> str:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available; use --device cpu or auto")
    return (
        "cuda" if choice == "auto" and torch.cuda.is_available() else ("cpu" if choice == "auto" else choice)
    )


def default_cap_bytes(device: str) -> int:
    """The GPU's total memory, or on CPU the memory currently available (MemAvailable)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read the available memory; pass --memory-cap-gb")


def _estimator(cfg: PostTrainConfig, world: int, shape: ModelShape):
    def estimate(target: Target, value: int) -> int | None:
        try:
            new = apply_values(cfg, {target.key: value})
            return (
                estimate_memory(new, build_plan(new, world), shape, Cluster())
                .phase(_PHASE[target.role])
                .total
            )
        except ValueError:
            return None

    return estimate


def print_results(result: TuneResult, limit: int) -> None:
    """The table of every trial: setting, tokens/s, peak memory, fits?, and which one was picked."""
    console = Console() if Console().is_terminal else Console(width=140)
    table = Table(
        title=f"posttrain tune: measured trials (limit {limit / GIB:.2f} GiB)", title_justify="left"
    )
    for col in (
        "role",
        "setting",
        "tokens/step",
        "tokens/s",
        "peak GiB",
        "step GiB",
        "est. GiB",
        "fits?",
        "picked",
    ):
        table.add_column(col, justify="left" if col in ("role", "setting", "fits?", "picked") else "right")
    for t in result.trials:
        r = t.result
        picked = result.best.get(t.target.key) is t
        table.add_row(
            t.target.role,
            f"{t.target.key}={t.value}",
            f"{r.tokens:,}",
            f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else r.status,
            f"{r.peak_bytes / GIB:.3f}" if r.peak_bytes is not None else "-",
            f"{r.step_bytes / GIB:.3f}" if r.step_bytes is not None else "-",
            f"{t.estimate_bytes / GIB:.3f}" if t.estimate_bytes is not None else "-",
            "yes" if t.fits else f"no ({r.status})",
            "<-" if picked else "",
        )
    console.print(table)


def _estimated_overlay(cfg, targets, estimate, limit: int) -> dict:
    out: dict = {}
    for t in targets:
        fitting = [v for v in t.candidates if (e := estimate(t, v)) is not None and e <= limit]
        if fitting:
            section, name = t.key.split(".")
            out.setdefault(section, {})[name] = max(fitting)
    return out


def run_tune(args: argparse.Namespace, cfg: PostTrainConfig, overrides: list[str], yamls: list[str]) -> int:
    _check_tune_args(args)
    world = args.world_size if args.world_size is not None else args.nodes * args.gpus_per_node
    plan = build_plan(cfg, world)
    device = _device(args.device)
    mc = model_config_dict(cfg, args.model_config)
    shape = ModelShape.from_hf_config(mc, name=args.model_config or cfg.model.path)
    cap = int(args.memory_cap_gb * GIB) if args.memory_cap_gb else default_cap_bytes(device)
    limit = int(cap * (1 - args.headroom))
    roles = [r.strip() for r in args.roles.split(",")] if args.roles else None
    targets = tune_targets(cfg, plan, roles, args.max_micro_batch, args.rows)
    estimate = _estimator(cfg, world, shape)
    point = starting_point(shape)
    print(
        f"model: {shape.name} ({shape.num_params() / 1e6:,.1f} M params); device {device}; cap {cap / GIB:.2f} GiB, "
        f"headroom {args.headroom:.0%} -> limit {limit / GIB:.2f} GiB"
    )
    print(
        f"starting point for a {point.tier} model ({point.source}): "
        + " ".join(f"{k}={v}" for k, v in point.overrides.items())
    )
    if args.time_budget_s == 0 or args.max_trials == 0:
        overlay = _estimated_overlay(cfg, targets, estimate, limit)
        print(
            "time budget 0: nothing measured; overlay = largest candidates the estimator fits under the limit"
        )
    else:
        result = autotune(
            cfg,
            targets,
            mc,
            _trial_overrides(cfg),
            memory_cap_bytes=cap,
            headroom=args.headroom,
            time_budget_s=args.time_budget_s,
            max_trials=args.max_trials,
            device=device,
            threads=args.threads,
            repeats=args.repeats,
            estimate=estimate,
        )
        print_results(result, limit)
        overlay = result.overlay()
    _write_overlay(args, cfg, overlay, overrides, yamls, world)
    return 0


def _check_tune_args(args: argparse.Namespace) -> None:
    if not 0 <= args.headroom < 1:
        raise ConfigError(
            f"--headroom ({args.headroom}) must be in [0, 1): the fraction of the cap kept free"
        )
    if args.max_trials < 0 or args.time_budget_s < 0:
        raise ConfigError(
            "--max-trials and --time-budget-s must be >= 0 (0 budget: estimates only, no trials)"
        )


def _trial_overrides(cfg: PostTrainConfig) -> list[str]:
    """Trials build the model from the config's switches (dtype, checkpointing, chunking, packing)."""
    flat = {
        k: v
        for k, v in flatten(_as_dict(cfg)).items()
        if k.startswith(("model.", "actor.", "critic.", "ref."))
    }
    return [
        f"{k}={json.dumps(v) if isinstance(v, list) else v}"
        for k, v in flat.items()
        if k != "model.path" and not isinstance(v, list)
    ]


def _write_overlay(
    args: argparse.Namespace,
    cfg: PostTrainConfig,
    overlay: dict,
    overrides: list[str],
    yamls: list[str],
    world: int,
) -> None:
    """Write the overlay, check it makes a valid plan, and print the command that uses it."""
    # The run directory, not the current one: the overlay belongs with the run it was measured for.
    out = Path(args.output) if args.output else Path(cfg.trainer.run_dir) / "tuned.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(overlay, sort_keys=False))
    # Command-line overrides win over YAML files, so the tuned keys are dropped from them; then the overlay
    # must make a valid plan on top of the same config, as `posttrain train` will build it: checked now.
    tuned = set(flatten(overlay))
    rest = [o for o in overrides if o.split("=", 1)[0] not in tuned]
    build_plan(build_config([*yamls, out], rest), world)
    print(f"wrote {out}: " + (" ".join(f"{k}={v}" for k, v in flatten(overlay).items()) or "(nothing fit)"))
    # Quoted for a POSIX shell: overrides such as data.train_files=[a.jsonl] must survive the paste.
    print(f"use it: posttrain train {' '.join(shlex.quote(str(w)) for w in [*yamls, out, *rest])}")


def _as_dict(cfg: PostTrainConfig) -> dict:
    return to_dict(cfg)
