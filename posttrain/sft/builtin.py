"""The built-in model: a tiny Qwen2 built from the seed, then warm-started with SFT on the task.

Two names (model.path):
- ``builtin:tiny``: the arithmetic demo's model, warm-started on the generated task. It is refused when the
  config names the user's own data files: the demo's warm start (imperfect arithmetic demonstrations)
  means nothing on another task, and training on it silently would hide that.
- ``builtin:base``: the same tiny model and tokenizer, untrained (random weights from trainer.seed): the
  starting point for a user's own SFT (docs/your-task.md).

Both directories are cached (keyed by everything that shapes them and nothing else), so only the first
run pays for building and warm-starting. Set POSTTRAIN_CACHE to move the cache (default
~/.cache/posttrain). Builds go to ``.tmp-<name>-<pid>`` and are renamed when complete; leftovers of a
process that died mid-build are removed by the next build.

The warm start is part of the built-in model's definition, like its architecture. It imitates
imperfect demonstrations: each time a training problem is drawn, its answer is off by one with
probability DEMONSTRATION_ERROR_RATE, as human- or model-written data often carries a systematic
mistake. The warm-started policy therefore knows the task and samples the right answer often, but
prefers a wrong one. Imitation cannot remove that habit; RL with the exact-match reward can, which
is what the main job shows. (Trained on clean answers for as long, the tiny model starts RL above
40% and RL on 480 problems then improves the training problems more than held-out ones.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
import yaml

from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.config.load import apply_values
from posttrain.config.schema import PostTrainConfig
from posttrain.data.splits import load_splits
from posttrain.models.hf import load_causal_lm, load_tokenizer, save_hf
from posttrain.models.hub import looks_like_hub_id, resolve_hub_model
from posttrain.models.tiny import create_tiny_model_dir
from posttrain.parallel.runtime import select_device
from posttrain.sft.loop import run_sft
from posttrain.utils.seed import seed_everything
from posttrain.utils.signals import stop_note

# Version the recipe: bump when the tiny model, its tokenizer or the warm start change.
RECIPE_VERSION = 3  # 3: the forward narrows the last MLP (float rounding moved the warm start)
WARM_START = {
    "sft.batch_size": 64,
    "sft.micro_batch_size_per_gpu": 64,
    "sft.epochs": 1,
    "sft.max_steps": 800,
    "sft.optim.lr": 1e-3,
    "sft.optim.warmup_steps": 20,
    "sft.optim.lr_schedule": "constant",
    "sft.optim.weight_decay": 0.0,
    "sft.optim.grad_clip": 1.0,
}
DEMONSTRATION_ERROR_RATE = 0.7


def imperfect_demonstrations(records: list, steps: int, batch_size: int, seed: int) -> list:
    """`steps * batch_size` draws of the training records, each answer off by one with probability
    DEMONSTRATION_ERROR_RATE (drawn independently per occurrence, so every problem has both)."""
    rng = random.Random(seed)
    copies = -(-steps * batch_size // len(records))
    out = []
    for rec in records * copies:
        wrong = rng.random() < DEMONSTRATION_ERROR_RATE
        if wrong and rec.ground_truth is not None and rec.ground_truth.lstrip("-").isdigit():
            rec = dataclasses.replace(rec, ground_truth=str(int(rec.ground_truth) + 1))
        out.append(rec)
    return out


def cache_root() -> Path:
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))


def _key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by someone else
    return True


def remove_stale_builds(root: Path) -> list[Path]:
    """Delete ``.tmp-*-<pid>`` build folders whose process is gone (a killed or crashed build)."""
    removed = []
    for tmp in root.glob(".tmp-*") if root.is_dir() else []:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def _atomic_build(target: Path, build) -> Path:
    """Build into a temporary sibling, then rename: an interrupted build never looks complete."""
    if (target / "config.json").exists():
        return target
    remove_stale_builds(target.parent)
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
    except BaseException:  # a signal or an error: nothing half-built is left for the next run to sweep
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():  # a concurrent build finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return target
    os.replace(tmp, target)
    return target


def builtin_base_dir(cfg: PostTrainConfig) -> Path:
    """The untrained tiny model + tokenizer for trainer.seed."""
    seed = cfg.trainer.seed
    target = cache_root() / f"tiny-base-v{RECIPE_VERSION}-seed{seed}"
    return _atomic_build(target, lambda tmp: create_tiny_model_dir(tmp, seed=seed))


def warm_start_config(cfg: PostTrainConfig) -> PostTrainConfig:
    """cfg with the warm-start recipe in its sft section (data settings stay the user's). The warm start
    trains every weight: it defines the built-in model, whatever the RL run does (e.g. LoRA)."""
    full = {"model.lora_rank": 0, "model.lora_adapter_path": "", "trainer.export_merged": False}
    return apply_values(cfg, {**WARM_START, **full})


# The data keys that change the generated task or the SFT examples made from it; anything else (batch
# sizes of RL or validation, file lists, reward settings) leaves the warm-started weights unchanged.
TASK_KEYS = (
    "task",
    "num_train_examples",
    "num_val_examples",  # the generator draws train and val together, so it shapes the train split too
    "max_operand",
    "task_options",
    "max_prompt_length",  # longer prompts are dropped from the SFT examples
    "max_response_length",  # SFT targets are cut to it
)


def warm_start_key(cfg: PostTrainConfig) -> dict:
    """What shapes the warm-started model, and only that: its cache key."""
    return {
        "recipe": RECIPE_VERSION,
        "seed": cfg.trainer.seed,
        "data": {k: getattr(cfg.data, k) for k in TASK_KEYS},
        "sft": WARM_START,
        "dtype": cfg.model.dtype,
        "error_rate": DEMONSTRATION_ERROR_RATE,
        # Float rounding follows torch's thread count: a warm start built on one thread is another model.
        "torch_threads": torch.get_num_threads(),
    }


def builtin_model_dir(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """The warm-started built-in model for this config's task and seed (built once, then cached)."""
    base = builtin_base_dir(cfg)
    ws = warm_start_config(cfg)
    shape = warm_start_key(cfg)
    target = cache_root() / f"tiny-{cfg.data.task}-sft-{_key(shape)}"
    if (target / "config.json").exists():
        return target

    def build(tmp: Path) -> None:
        if not quiet:
            print(f"Building the built-in model: SFT warm start on '{cfg.data.task}' (cached in {target})")
        seed_everything(cfg.trainer.seed)
        tokenizer = load_tokenizer(base)
        model = load_causal_lm(base, cfg.model.dtype, select_device(cfg))
        demos = imperfect_demonstrations(
            load_splits(cfg).train, ws.sft.max_steps, ws.sft.batch_size, cfg.trainer.seed
        )
        run_sft(ws, model, tokenizer, demos, quiet=quiet)
        save_hf(model, tokenizer, tmp)
        (tmp / "posttrain_builtin.json").write_text(json.dumps(shape, indent=2))

    note = (
        "the built-in model's SFT warm start was stopped before it was cached: the next run builds it again"
    )
    with stop_note(note):
        return _atomic_build(target, build)


BUILTIN_NAMES = ("builtin:tiny", "builtin:base")


def user_data_keys(cfg: PostTrainConfig) -> list[str]:
    """The config keys that name the user's own data files (empty: the built-in task)."""
    keys = [("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)]
    keys.append(("sft.train_files", cfg.sft.train_files))
    return [f"{k}={v}" for k, v in keys if v]


def check_builtin_choice(cfg: PostTrainConfig) -> None:
    """builtin:tiny is the arithmetic demo's warm-started model: refuse it on the user's own data."""
    path = cfg.model.path
    if path.startswith("builtin:") and path not in BUILTIN_NAMES:
        raise ConfigError(f"model.path={path!r} is not a built-in model; use one of {list(BUILTIN_NAMES)}")
    given = user_data_keys(cfg)
    if path == "builtin:tiny" and given:
        raise ConfigError(
            f"model.path=builtin:tiny is the arithmetic demo's model, warm-started on imperfect arithmetic "
            f"demonstrations, but the config names your own data ({', '.join(given)}). Use "
            "model.path=builtin:base (the same tiny model, untrained; fine-tune it with `posttrain sft` first, "
            "see docs/your-task.md) or your own model directory or Hub id"
        )


def resolve_model_path(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """The model directory a run uses: the built-in models ('builtin:tiny', 'builtin:base'), a local
    directory, or a Hugging Face Hub id (from the local cache, downloaded when not there and online)."""
    check_builtin_choice(cfg)
    if cfg.model.path == "builtin:tiny":
        return builtin_model_dir(cfg, quiet=quiet)
    if cfg.model.path == "builtin:base":
        return builtin_base_dir(cfg)
    path = Path(cfg.model.path)
    if not path.exists() and looks_like_hub_id(cfg.model.path):
        return resolve_hub_model(cfg.model.path)
    if not (path / "config.json").exists():
        raise MissingPathError(
            f"model.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json) nor a Hub "
            "id ('org/name'); give a local directory saved with save_pretrained, a Hub id, "
            "model.path=builtin:base (untrained tiny model) or builtin:tiny (the arithmetic demo)"
        )
    return path


def write_run_info(run_dir: Path, cfg: PostTrainConfig, model_path: Path) -> Path:
    """run_info.yaml: which model directory a run used (model.path as given, and what it resolved to)."""
    info = {"model_path": cfg.model.path, "resolved_model_path": str(Path(model_path).resolve())}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run_info.yaml"
    path.write_text(yaml.safe_dump(info, sort_keys=False))
    return path
