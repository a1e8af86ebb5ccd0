"""The `posttrain` command line: train, sft, rm, eval, explain, tune, sandbox serve, serve.

Every subcommand takes optional YAML files and dotted overrides, in any order:
    posttrain train my.yaml actor.ppo_mini_batch_size=16 trainer.total_steps=20
A user error (posttrain.config.errors.ConfigError: a key, value, file or row) prints one message and exits
with code 2, before any heavy work; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from posttrain import __version__
from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.config.verl_keys import LAST_TRANSLATED, translated_lines
from posttrain.planning.flags import add_explain_args, add_tune_args
from posttrain.planning.input_checks import check_inputs
from posttrain.planning.keys import key_lines
from posttrain.rl.serve_flags import add_serve_parser
from posttrain.sandbox.server import add_serve_arguments, serve, settings_from_arguments
from posttrain.utils.signals import EXIT_TERMINATED, Interrupted, Terminated, sigterm_raises
from posttrain.utils.storage import storage_problem

# Only what parsing the command line and loading a config need is imported above: `posttrain --help` and a
# misspelled key answer in a fraction of a second. Each command imports its own modules (torch, transformers,
# the engines) when it runs, after its config loaded (tests/test_cli_imports.py keeps it so).

EXIT_CONFIG_ERROR = 2
KEYS_HINT = (
    "\nEvery key with its type, default and allowed values: posttrain explain --keys "
    "(also docs/config.md). Check a config before running it: posttrain explain CONFIG.yaml [key=value ...]."
)
TRAIN_EXAMPLES = """examples:
  posttrain train                                      # GRPO on the built-in arithmetic demo, CPU, ~3 min (2 quiet cores)
  posttrain train trainer.total_steps=10 rollout.n=4   # dotted overrides, any number
  posttrain train examples/gsm8k_grpo_qwen2.5_0.5b.yaml model.path=Qwen/Qwen2.5-0.5B-Instruct \\
      data.train_files=[gsm8k/train.jsonl] data.val_files=[gsm8k/test.jsonl]
  posttrain train model.path=runs/sft/sft_model data.train_files=[train.jsonl] \\
      data.val_files=[val.jsonl] reward.function=reward.py:reward   # your own task: docs/your-task.md
"""


def _split_args(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional words are YAML files unless they contain '=' (then they are overrides)."""
    yamls = [i for i in items if "=" not in i]
    overrides = [i for i in items if "=" in i]
    return yamls, overrides


def _load(args: argparse.Namespace, then_libraries: bool = True):
    """The config; ``then_libraries``: the command's libraries load next (False: after more torch-free checks)."""
    yamls, overrides = _split_args(args.config)
    cfg = build_config(yamls, overrides)
    if then_libraries:
        quiet_library_progress_bars()
    return cfg


def _what_if(args: argparse.Namespace, world_size: int, cfg):
    """The estimate's what-ifs: each flag overrides the config; left out, the config's own value counts."""
    from posttrain.config.plan import fsdp_group_size
    from posttrain.planning.memory_bytes import WhatIf

    r = cfg.rollout
    fsdp = None if args.fsdp_size is None else fsdp_group_size(args.fsdp_size, world_size, "--fsdp-size")
    return WhatIf(
        fsdp_size=fsdp,
        param_offload=args.param_offload,
        optimizer_offload=args.optimizer_offload,
        lora_rank=args.lora_rank,
        master_weights_fp32=args.master_weights_fp32,
        rollout_engine=args.rollout_engine or r.name,
        gpu_memory_utilization=args.gpu_memory_utilization or r.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs or r.max_num_seqs,
        rollout_tp=args.rollout_tp or r.tensor_model_parallel_size,
    )


def _model_shape(cfg, model_config: str | None):
    from posttrain.planning.shape import ModelShape, shape_for_model_path

    if model_config:
        return ModelShape.from_path(model_config)
    return shape_for_model_path(cfg.model.path)


def _world_size(args: argparse.Namespace, cfg) -> int:
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    n = cfg.trainer.ray_ranks
    if n and args.world_size not in (None, n):
        raise ConfigError(
            f"--world-size {args.world_size} disagrees with trainer.ray_ranks={n}, the number of ranks Ray "
            f"starts (the world size); drop --world-size, or set trainer.ray_ranks={args.world_size}"
        )
    if n:
        return n
    return args.world_size if args.world_size is not None else args.nodes * args.gpus_per_node


def _cluster_shape(args: argparse.Namespace, world: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of the memory estimate. --world-size, when given, replaces nodes x gpus-per-node
    (one node of that many GPUs); so do Ray-placed ranks that --nodes x --gpus-per-node do not describe."""
    if args.world_size is None and args.nodes * args.gpus_per_node == world:
        return args.nodes, args.gpus_per_node
    return 1, world


def explain_rm(args: argparse.Namespace) -> int:
    """`posttrain explain rm [CONFIG ...]`: the plan of a `posttrain rm` run (posttrain.planning.rm_plan)."""
    from posttrain.planning.preflight import preflight_rm
    from posttrain.planning.rm_plan import rm_plan, rm_plan_lines

    args.config = args.config[1:]
    cfg = _load(args)
    preflight_rm(cfg, world := _world_size(args, cfg), check_model=not args.model_config)  # rm's checks
    plan = rm_plan(cfg, args.model_config, world)
    print(json.dumps(plan, indent=2) if args.json else "\n".join(rm_plan_lines(cfg, plan)))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    if args.keys:
        print("\n".join(key_lines()))
        return 0
    if args.config[:1] == ["rm"]:  # a reward-model run: pairs, not a task and a rollout
        return explain_rm(args)
    cfg = _load(args)
    from posttrain.config.plan import build_plan
    from posttrain.planning.advice import advise, starting_point
    from posttrain.planning.explain import explain_json
    from posttrain.planning.memory import Cluster, estimate_memory
    from posttrain.planning.multi_turn import multi_turn_plan
    from posttrain.planning.preflight import preflight

    if LAST_TRANSLATED and not args.json:  # verl's key names given: show what each became
        print(
            "verl keys translated (docs/migrating-from-verl.md):\n"
            + "\n".join(translated_lines(LAST_TRANSLATED))
        )
    world = _world_size(args, cfg)
    # The checks train runs; with --model-config the model need not be here: only its shape is used.
    preflight(cfg, "explain", world_size=world, check_model=not args.model_config)
    plan = build_plan(cfg, world_size=world)
    estimate, advice, shape, point = None, {}, _model_shape(cfg, args.model_config), None
    if shape is not None:
        nodes, per_node = _cluster_shape(args, world)
        cluster = Cluster(nodes, per_node, args.gpu_memory_gb)
        what_if = _what_if(args, world, cfg)
        estimate = estimate_memory(cfg, plan, shape, cluster, what_if)
        advice = advise(cfg, estimate, shape, cluster, what_if)
        point = starting_point(shape) if args.suggest else None
    if args.json:
        out = explain_json(plan, estimate, advice, point)
        out["multi_turn"] = multi_turn_plan(cfg)
        print(json.dumps(out, indent=2, default=repr))
        return 0
    _print_explain(cfg, plan, shape, estimate, advice, point)
    return 0


def _print_explain(cfg, plan, shape, estimate, advice, point) -> None:
    """`posttrain explain`'s text: the plan, the multi-turn plan, the sandbox check, the memory estimate."""
    from rich.console import Console

    from posttrain.parallel.runtime import select_device
    from posttrain.planning.explain import advice_lines, estimate_table, plan_tree
    from posttrain.planning.multi_turn import multi_turn_tree
    from posttrain.planning.sandbox_probe import (
        harness_probe_line,  # the code reward's harness, not a bare run
    )
    from posttrain.rewards.code import CodeReward
    from posttrain.rl.collect.phase import scoring_line

    # Piped output (CI logs, files) gets a fixed width instead of rich's 80-column default.
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(plan_tree(cfg, plan))
    if (turns := multi_turn_tree(cfg)) is not None:
        console.print(turns)
    if cfg.reward.function == "code":  # the code reward runs programs: show the sandbox and check it works
        # As plain lines: rich would wrap them where the bwrap path's length puts them, and eat a path's [x]
        scoring = scoring_line(cfg, select_device(cfg).type, CodeReward)
        for line in (harness_probe_line(cfg.sandbox), scoring):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
    if estimate is None:
        console.print(
            f"(no memory estimate: model.path={cfg.model.path!r} has no config.json; pass --model-config)"
        )
        return
    console.print(f"Memory estimate for {shape.name} ({shape.num_params() / 1e6:,.1f}M parameters)")
    console.print(estimate_table(estimate, advice))
    for line in advice_lines(estimate, advice):
        console.print(line)
    if point is not None:
        args_text = " ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in point.overrides.items()
        )
        console.print(f"starting point for a {point.tier} model ({point.source}):\n  {args_text}")


def _checked(args: argparse.Namespace, command: str):
    """The config, after the checks every command runs before any model loads (posttrain.planning.preflight)."""
    return _preflight(_load(args, then_libraries=False), command)


def _preflight(cfg, command: str, model: str | None = None, inputs_checked: bool = False):
    """``cfg`` once it passed the checks ``command`` runs before any model loads; ``model``: eval's --model.
    The torch-free ones first, before the rest is imported: a misspelled file or function fails at once
    (``inputs_checked``: the caller ran them already)."""
    if not inputs_checked:
        check_inputs(cfg, command)
    quiet_library_progress_bars()
    from posttrain.parallel.runtime import launched_world_size
    from posttrain.planning.preflight import preflight
    from posttrain.rl.ray_ranks import wants_ray_ranks

    on_ray = wants_ray_ranks(cfg)
    world = cfg.trainer.ray_ranks if on_ray else launched_world_size()
    preflight(cfg, command, model, world_size=world, ranks_elsewhere=on_ray, inputs_checked=True)
    return cfg


def cmd_tune(args: argparse.Namespace) -> int:
    from posttrain.planning.tune import run_tune

    yamls, overrides = _split_args(args.config)
    return run_tune(args, _load(args), overrides, yamls)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _checked(args, "train")
    from posttrain.rl.ray_ranks import RanksFailed, run_on_ray, wants_ray_ranks
    from posttrain.rl.train_command import run_training

    if not wants_ray_ranks(cfg):
        run_training(cfg)
        return 0
    try:
        last = run_on_ray(cfg)
    except RanksFailed as exc:
        print(f"posttrain train: error: {exc}", file=sys.stderr)
        return 1
    shown = ", ".join(f"{k}={last[k]:.3f}" for k in ("reward/mean", "val/accuracy") if k in last)
    print(f"Trained on {cfg.trainer.ray_ranks} ranks placed by Ray; last step: {shown}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    cfg = _checked(args, "sft")
    from posttrain.sft.command import run_sft_command

    run_sft_command(cfg)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    cfg = _load(args)  # no reward function to check: pairs carry the preference
    from posttrain.parallel.runtime import launched_world_size
    from posttrain.planning.preflight import preflight_rm
    from posttrain.rm.command import run_rm_command

    preflight_rm(cfg, launched_world_size())  # explain rm runs the same checks
    run_rm_command(cfg)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = _load(args, then_libraries=False)
    check_inputs(cfg, "eval")  # data files and the reward before torch loads: a typo fails at once
    from posttrain.rl.eval_command import model_named_by_flag, run_eval_command

    cfg, model = model_named_by_flag(cfg, args.model)  # --model takes what model.path takes
    run_eval_command(_preflight(cfg, "eval", model, inputs_checked=True), model_path=model)
    return 0


def cmd_sandbox_serve(args: argparse.Namespace) -> int:
    settings = settings_from_arguments(args)  # checked before the sandbox is built: refuse at once
    cfg = _load(args)
    from posttrain.sandbox.build import build_sandbox

    serve(build_sandbox(cfg.sandbox), settings)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from posttrain.rl.serve_command import run_serve, serve_settings

    settings = serve_settings(args)  # flags, MODEL_DIR and its tokenizer checked before any weights load
    run_serve(_load(args), settings)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain", description="RL post-training of LLMs (PPO, GRPO and relatives)."
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_command(
        sub,
        "train",
        cmd_train,
        "Run RL training (default: GRPO on the built-in arithmetic task, CPU-sized).",
        TRAIN_EXAMPLES + KEYS_HINT,
    )
    _add_command(sub, "sft", cmd_sft, "Supervised fine-tuning on prompt/response data.")
    _add_command(sub, "rm", cmd_rm, "Train a reward model on preference pairs (Bradley-Terry).")
    p = _add_command(
        sub, "eval", cmd_eval, "Validation accuracy of a model directory or checkpoint on the task."
    )
    p.add_argument(
        "--model",
        default=None,
        help="What model.path takes (a model directory, a Hub id, builtin:tiny, builtin:base), or a checkpoint "
        "or exported adapter over model.path (default: model.path)",
    )
    add_explain_args(
        _add_command(
            sub,
            "explain",
            cmd_explain,
            "Print the batch plan and the per-GPU memory estimate derived from a config "
            "(`posttrain explain rm ...`: the plan of a reward-model run).",
        )
    )
    add_tune_args(
        _add_command(
            sub,
            "tune",
            cmd_tune,
            "Measure micro-batch sizes / token budgets on this device; write a config overlay.",
        )
    )
    sandbox = sub.add_parser("sandbox", help="Sandboxed code execution (docs/sandbox.md).")
    add_serve_arguments(
        _add_command(
            sandbox.add_subparsers(dest="sandbox_command", required=True),
            "serve",
            cmd_sandbox_serve,
            "Serve the sandbox of the `sandbox` config section over SandboxFusion's POST /run_code API "
            "(limits, token: docs/sandbox.md).",
        )
    )
    add_serve_parser(sub, cmd_serve)
    return parser


def _add_command(
    sub: argparse._SubParsersAction,
    name: str,
    fn: Callable[[argparse.Namespace], int],
    help: str,
    epilog: str = "",
) -> argparse.ArgumentParser:
    """A subcommand that takes YAML files and key=value overrides and runs ``fn``."""
    p = sub.add_parser(
        name,
        help=help,
        description=help,
        epilog=epilog or KEYS_HINT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="*", help="YAML override files and key=value overrides")
    p.set_defaults(fn=fn)
    return p


def quiet_library_progress_bars() -> None:
    """Turn off transformers' own progress bars ("Loading weights", "Writing model shards"): they redraw over
    the training display and fill logs with carriage returns. Hub download bars stay (a download of a large
    model can take minutes) unless HF_HUB_DISABLE_PROGRESS_BARS is set."""
    import huggingface_hub.utils
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()  # also turns the Hub's off
    if not os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"):
        huggingface_hub.utils.enable_progress_bars()


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """Options and overrides in any order: `explain rm --json rm.batch_size=32` as well as `explain rm
    rm.batch_size=32 --json` (argparse alone stops collecting a command's positionals at its first option)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if any(a.startswith("-") for a in rest) or (rest and not hasattr(args, "config")):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.config = [*args.config, *rest]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(argv)
    try:
        with sigterm_raises():  # every phase, not only the training loop: one line, exit 143
            return args.fn(args)
    except ConfigError as exc:
        # User errors (config, data, paths, checkpoints): one line, no traceback; anything else keeps its own.
        print(f"posttrain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except Terminated as exc:  # the phase it stopped says what is left (posttrain.utils.signals.stop_note)
        print(f"posttrain {args.command}: {exc}", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as exc:
        # A full or read-only disk where no write site named its path (e.g. a metrics line): one line too.
        problem = storage_problem(exc)
        if problem is None:
            raise
        print(
            f"posttrain {args.command}: error: a write failed: {problem} ({exc}); free space or make the "
            "filesystem writable, then run the same command again",
            file=sys.stderr,
        )
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt as exc:
        said = exc if isinstance(exc, Interrupted) else "interrupted"  # what the phase it stopped left
        print(f"posttrain {args.command}: {said}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
