"""`posttrain sft`: fine-tune model.path (or the built-in tiny model) on prompt/response data and save it."""

from __future__ import annotations

from pathlib import Path

from posttrain.config.schema import PostTrainConfig
from posttrain.data.splits import load_splits
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.models.lora import apply_lora, export_policy, is_lora_model, lora_memory_summary
from posttrain.models.prepare import check_policy_switches, read_model_config
from posttrain.parallel.runtime import select_device
from posttrain.sft.builtin import builtin_base_dir
from posttrain.sft.loop import run_sft, sft_records
from posttrain.utils.seed import seed_everything


def run_sft_command(cfg: PostTrainConfig) -> Path:
    """`posttrain sft`: fine-tune model.path (or the built-in tiny model) and save it."""

    device = select_device(cfg)
    check_policy_switches(cfg, device, read_model_config(cfg.model.path))  # before any weights load
    seed_everything(cfg.trainer.seed)
    # Data first: a bad file or row is reported before any model loads.
    records = sft_records(cfg, load_splits(cfg).train if not cfg.sft.train_files else [])
    path = builtin_base_dir(cfg) if cfg.model.path == "builtin:tiny" else cfg.model.path
    tokenizer = load_tokenizer(path)
    model = apply_lora(load_causal_lm(path, cfg.model.dtype, device), cfg)  # LoRA: only adapters train
    if is_lora_model(model):
        print(lora_memory_summary(model, uses_reference=False))
    history = run_sft(cfg, model, tokenizer, records)
    out = Path(cfg.sft.output_dir or Path(cfg.trainer.run_dir) / "sft_model")
    out, how = export_policy(model, tokenizer, out, merge=cfg.trainer.export_merged)
    last = history[-1] if history else {}
    print(
        f"SFT done: {len(history)} optimizer steps, final loss {last.get('sft/loss', float('nan')):.4f}; saved {out} ({how})"
    )
    return out
