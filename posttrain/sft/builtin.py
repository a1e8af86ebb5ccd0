"""The built-in model: a tiny Qwen2 built from the seed, then warm-started with SFT on the task.

Both directories are cached (keyed by everything that shapes them), so only the first run pays
for building and warm-starting. Set POSTTRAIN_CACHE to move the cache (default ~/.cache/posttrain).

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

from posttrain.config.errors import ConfigError
from posttrain.config.load import apply_values
from posttrain.config.schema import PostTrainConfig
from posttrain.data.splits import load_splits
from posttrain.models.hf import load_causal_lm, load_tokenizer, save_hf
from posttrain.models.tiny import create_tiny_model_dir
from posttrain.parallel.runtime import select_device
from posttrain.sft.loop import run_sft
from posttrain.utils.seed import seed_everything

# Version the recipe: bump when the tiny model, its tokenizer or the warm start change.
RECIPE_VERSION = 2
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


def _atomic_build(target: Path, build) -> Path:
    """Build into a temporary sibling, then rename: an interrupted build never looks complete."""
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
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


def builtin_model_dir(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """The warm-started built-in model for this config's task and seed (built once, then cached)."""
    base = builtin_base_dir(cfg)
    ws = warm_start_config(cfg)
    shape = {
        "recipe": RECIPE_VERSION,
        "seed": cfg.trainer.seed,
        "data": dataclasses.asdict(cfg.data),
        "sft": dataclasses.asdict(ws.sft),
        "dtype": cfg.model.dtype,
        "error_rate": DEMONSTRATION_ERROR_RATE,
    }
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

    return _atomic_build(target, build)


def resolve_model_path(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """model.path, or the warm-started built-in tiny model for 'builtin:tiny'."""
    if cfg.model.path == "builtin:tiny":
        return builtin_model_dir(cfg, quiet=quiet)
    path = Path(cfg.model.path)
    if not (path / "config.json").exists():
        raise ConfigError(
            f"model.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json); "
            "give a local directory saved with save_pretrained, or model.path=builtin:tiny"
        )
    return path
