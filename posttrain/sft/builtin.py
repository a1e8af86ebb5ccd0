"""The built-in model's warm start: builtin:tiny is the tiny Qwen2 (posttrain/models/model_path.py)
warm-started with SFT on the task, built once per task and seed, then cached.

The warm start is part of the built-in model's definition, like its architecture. It imitates
imperfect demonstrations: each time a training problem is drawn, its answer is off by one with
probability DEMONSTRATION_ERROR_RATE, as human- or model-written data often carries a systematic
mistake. The warm-started policy therefore knows the task and samples the right answer often, but
prefers a wrong one. Imitation cannot remove that habit; RL with the exact-match reward can, which
is what the main job shows. (Trained on clean answers for as long, the tiny model starts RL above
40% and RL on 480 problems then improves the training problems more than held-out ones.)

The commands resolve model.path with `posttrain.models.model_path:resolve_model_path` and hand it
`builtin_model_dir` below as its warm start.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch
import transformers

from posttrain.config.load import apply_values
from posttrain.config.schema import PostTrainConfig
from posttrain.data.splits import load_splits
from posttrain.models.hf import load_causal_lm, load_tokenizer, save_hf
from posttrain.models.model_path import RECIPE_VERSION, atomic_build, builtin_base_dir, cache_key, cache_root
from posttrain.parallel.runtime import select_device
from posttrain.sft.loop import run_sft
from posttrain.utils.seed import seed_everything
from posttrain.utils.signals import stop_note

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


# The sft keys that do not reach the warm start's weights: its examples come from the task, not from files.
SFT_KEYS_UNUSED = ("train_files", "val_files", "prompt_key", "response_key", "output_dir")
# The model keys that change the forward's arithmetic (padding-free packing, fused kernels) besides the dtype.
MODEL_KEYS = ("dtype", "use_remove_padding", "remove_padding_max_row_tokens", "use_liger")


def warm_start_key(cfg: PostTrainConfig) -> dict:
    """What shapes the warm-started model, and only that: its cache key. Besides the recipe and the task, the
    float rounding of where it is built: a model built with other kernels is another model (the same seed
    gives other weights), so it is built again rather than silently reused."""
    ws = warm_start_config(cfg)
    sft = {k: v for k, v in dataclasses.asdict(ws.sft).items() if k not in SFT_KEYS_UNUSED}
    return {
        "recipe": RECIPE_VERSION,
        "seed": cfg.trainer.seed,
        "data": {k: getattr(cfg.data, k) for k in TASK_KEYS},
        "sft": sft,
        "model": {k: getattr(ws.model, k) for k in MODEL_KEYS},
        "error_rate": DEMONSTRATION_ERROR_RATE,
        "kernels": build_kernels(cfg),
    }


def build_kernels(cfg: PostTrainConfig) -> dict:
    """What decides the float rounding of a build here: the libraries' versions, the device and, on a CPU, the
    instruction set torch's kernels use (AVX2, AVX-512, ...; ATEN_CPU_CAPABILITY chooses a lower one) and the
    thread count (reductions are split by thread)."""
    device = select_device(cfg)
    kernels = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device.type,
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        kernels["gpu"] = torch.cuda.get_device_name(device)
    else:
        kernels["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return kernels


def builtin_model_dir(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """The warm-started built-in model for this config's task and seed (built once, then cached)."""
    base = builtin_base_dir(cfg)
    ws = warm_start_config(cfg)
    shape = warm_start_key(cfg)
    target = cache_root() / f"tiny-{cfg.data.task}-sft-{cache_key(shape)}"
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
        return atomic_build(target, build)
