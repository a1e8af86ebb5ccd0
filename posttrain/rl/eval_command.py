"""`posttrain eval`: validation accuracy of a model directory, an exported adapter or a training checkpoint."""

from __future__ import annotations

from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.config.load import apply_values
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import tokenize_prompts
from posttrain.data.splits import load_splits
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.models.lora import apply_lora
from posttrain.parallel.runtime import select_device
from posttrain.rewards.functions import resolve_reward_function
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.build import load_checkpoint_policy
from posttrain.rl.eval_report import report_eval
from posttrain.rl.evaluate import validate
from posttrain.rollout.native.engine import NativeEngine
from posttrain.sft.builtin import resolve_model_path
from posttrain.utils.seed import seed_everything


def run_eval_command(cfg: PostTrainConfig, model_path: str | None = None) -> dict[str, float]:
    """`posttrain eval`: validation accuracy of a model directory or a training checkpoint."""
    device = select_device(cfg)
    seed_everything(cfg.trainer.seed)
    path = Path(model_path) if model_path else None
    if path is not None and not path.exists():
        raise ConfigError(f"--model {path} does not exist")
    if path is not None and (path / "config.json").exists():
        tokenizer, model = load_tokenizer(path), load_causal_lm(path, cfg.model.dtype, device)
        described = str(path)
    else:
        base = resolve_model_path(cfg)
        described = f"{path} on {base}" if path is not None else f"{base} (model.path={cfg.model.path})"
        tokenizer, model = load_tokenizer(base), load_causal_lm(base, cfg.model.dtype, device)
        if path is not None and (path / "adapter_config.json").exists():  # an exported LoRA adapter
            model = apply_lora(
                model, apply_values(cfg, {"model.lora_rank": 0, "model.lora_adapter_path": str(path)})
            )
        elif path is not None:  # a training checkpoint: a LoRA run's holds the adapters of model.lora_*
            model = apply_lora(model, cfg)
            load_checkpoint_policy(path, model)
    splits = load_splits(cfg)
    if not splits.val:
        raise ConfigError("no validation prompts: set data.val_files (or use a built-in task)")
    prompts = tokenize_prompts(splits.val, tokenizer, cfg.data.max_prompt_length, cfg.data.overlong_prompts)
    r = cfg.rollout
    engine = NativeEngine(
        model,
        [tokenizer.eos_token_id],
        tokenizer.pad_token_id,
        r.chunk_size,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        enable_chunked_prefill=r.enable_chunked_prefill,
        enforce_eager=r.enforce_eager,
    )
    reward_fn = resolve_reward_function(splits.reward_spec, splits.data_source)
    rows: list[dict] = []
    with RewardRunner(reward_fn, timeout_s=cfg.reward.timeout_s) as runner:
        metrics = validate(engine, tokenizer, prompts, runner, cfg, seed=cfg.trainer.seed, samples=rows)
    report_eval(cfg, described, rows, metrics)
    return metrics
