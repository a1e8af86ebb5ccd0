"""`posttrain eval`: validation accuracy of a model directory, an exported adapter or a training checkpoint."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.config.load import apply_values
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import tokenize_prompts, warn_dropped
from posttrain.data.splits import load_splits
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.models.lora import apply_lora
from posttrain.models.model_path import BUILTIN_NAMES, looks_like_hub_id, resolve_model_path
from posttrain.parallel.runtime import select_device
from posttrain.rl.build import build_engine, build_reward_runner, load_checkpoint_policy
from posttrain.rl.collect.harness_loop import build_rollout_loop
from posttrain.rl.collect.validation import validate
from posttrain.rl.eval_report import report_eval, trajectory_summary
from posttrain.rollout.weights import RolloutWeights
from posttrain.sandbox.build import RunSandbox
from posttrain.sft.builtin import builtin_model_dir
from posttrain.train.integrity import check_model_dir
from posttrain.utils.run_lock import lock_run_dir
from posttrain.utils.seed import seed_everything
from posttrain.utils.signals import stop_note


def model_named_by_flag(cfg: PostTrainConfig, model: str | None) -> tuple[PostTrainConfig, str | None]:
    """(the config, the directory eval reads over it) for ``--model``. A directory is read as itself: a Hugging
    Face model, an exported LoRA adapter or a training checkpoint over model.path. Anything else names the model
    as model.path does (builtin:tiny, builtin:base, a Hub id) and replaces model.path, with its checks."""
    if model is None:
        return cfg, None
    if Path(model).is_dir():
        return cfg, model
    if model not in BUILTIN_NAMES and (Path(model).exists() or not looks_like_hub_id(model)):
        raise MissingPathError(
            f"--model {model} is not a directory: pass a model directory, a checkpoint, an exported adapter, "
            f"a Hub id ('org/name') or one of {', '.join(BUILTIN_NAMES)}, as model.path takes"
        )
    return apply_values(cfg, {"model.path": model}), None


def load_eval_model(cfg: PostTrainConfig, path: Path | None, device) -> tuple[object, nn.Module, Path, str]:
    """(tokenizer, model, the Hugging Face directory it was read from, which model in words) of ``--model``: a
    Hugging Face directory, an exported LoRA adapter over model.path, or a training checkpoint's actor over
    model.path (a LoRA run's checkpoint holds the adapters of model.lora_*)."""
    if path is not None and (path / "config.json").exists():
        check_model_dir(path)  # a truncated weights file is named here, not deep in the loader
        return load_tokenizer(path), load_causal_lm(path, cfg.model.dtype, device), path, str(path)
    base = resolve_model_path(cfg, warm_start=builtin_model_dir)
    described = f"{path} on {base}" if path is not None else f"{base} (model.path={cfg.model.path})"
    tokenizer, model = load_tokenizer(base), load_causal_lm(base, cfg.model.dtype, device)
    if path is not None and (path / "adapter_config.json").exists():
        adapter = apply_values(cfg, {"model.lora_rank": 0, "model.lora_adapter_path": str(path)})
        model = apply_lora(model, adapter)
    elif path is not None:
        model = apply_lora(model, cfg)
        load_checkpoint_policy(path, model)
    return tokenizer, model, base, described


def run_eval_command(cfg: PostTrainConfig, model_path: str | None = None) -> dict[str, float]:
    """`posttrain eval`: validation accuracy of a model directory or a training checkpoint.

    Data and the reward function are checked before any weights load; the engine and the reward runner come
    from the same builders as training, so both score alike.
    """
    device = select_device(cfg)
    seed_everything(cfg.trainer.seed)
    path = Path(model_path) if model_path else None
    if path is not None and not path.exists():
        raise MissingPathError(f"--model {path} does not exist; pass a model directory or a checkpoint")
    splits = load_splits(cfg)
    if not splits.val:
        raise ConfigError("no validation prompts: set data.val_files (or use a built-in task)")
    # eval writes trainer.run_dir/eval_samples.jsonl: it holds that directory's run lock, so it never writes
    # into a directory a training run (or another eval) is writing. It only reads --model.
    lock = lock_run_dir(cfg.trainer.run_dir)
    try:
        with stop_note("eval stopped before its results were written (it wrote nothing): run it again"):
            return _evaluate(cfg, splits, path, device)
    finally:
        lock.release()


def _evaluate(cfg: PostTrainConfig, splits, path: Path | None, device) -> dict[str, float]:
    rows: list[dict] = []
    sandbox = RunSandbox(cfg.sandbox)  # the run's one sandbox: the code reward's and the python tool's
    with build_reward_runner(cfg, splits.reward_spec, splits.data_source, sandbox) as runner:
        tokenizer, model, hf_dir, described = load_eval_model(cfg, path, device)
        prompts = tokenize_prompts(
            splits.val, tokenizer, cfg.data.max_prompt_length, cfg.data.overlong_prompts
        )
        warn_dropped(prompts.n_filtered, len(splits.val), "validation", cfg.data.max_prompt_length)
        engine = build_engine(cfg, model, tokenizer, device, hf_dir)
        # vLLM reads hf_dir; a checkpoint's or an adapter's weights follow (a no-op for the native engine).
        RolloutWeights(cfg, engine).push(model)
        agent = build_rollout_loop(cfg, tokenizer, sandbox)
        try:
            metrics = validate(
                engine, tokenizer, prompts, runner, cfg, seed=cfg.trainer.seed, samples=rows, agent=agent
            )
        finally:
            if agent is not None:
                agent.close()  # a harness's gateway
    if any(
        "messages" in r for r in rows
    ):  # a multi-turn task: success, turns and tool use of the trajectories
        metrics.update(
            {f"val/{k}": v for k, v in trajectory_summary(rows).items() if f"val/{k}" not in metrics}
        )
    report_eval(cfg, described, rows, metrics)
    return metrics
