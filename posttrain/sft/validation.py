"""Validation during and after `posttrain sft`: held-out loss, and accuracy when a reward is configured.

The held-out records are sft.val_files, else data.val_files, read with data.prompt_key and
sft.response_key (a row without the response is a DataError naming file, row and key). Accuracy is
the share of held-out prompts whose greedy response gets reward >= 1 from reward.function, or from the
built-in task's reward when no files are given; it is measured like `train`'s validation, against the
answer under data.answer_key (verl's reward_model.ground_truth for verl-layout rows) when the row has one,
else against the response itself. Prompts longer than data.max_prompt_length are dropped (counted in the log)
or an error, as data.overlong_prompts says; each validation's samples are appended to
``<trainer.run_dir>/samples.jsonl`` with their step, as `train` writes them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import build_rollout_batch
from posttrain.data.datasets import load_records, tokenize_prompts, warn_dropped, warn_truncated
from posttrain.data.fields import VERL_ANSWER_KEY, get_path, has_path, is_verl_row
from posttrain.data.records import PromptRecord
from posttrain.forward.passes import policy_logprobs
from posttrain.models.lora import policy_weights
from posttrain.parallel.runtime import DistContext
from posttrain.rewards.functions import resolve_reward_function
from posttrain.rewards.runner import RewardInput, RewardRunner
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native.engine import NativeEngine
from posttrain.sandbox.build import RunSandbox
from posttrain.utils.metrics import SAMPLES_FILENAME, write_samples

CORRECT_THRESHOLD = 1.0  # as train's validation: the rule rewards give 1.0 for a right answer


def sft_val_records(cfg: PostTrainConfig, fallback: list[PromptRecord]) -> list[PromptRecord]:
    """The held-out prompt/response records: sft.val_files, else data.val_files, else ``fallback``."""
    files = cfg.sft.val_files or cfg.data.val_files
    if not files:
        return fallback
    return [r for f in files for r in load_records(f, cfg.data.prompt_key, cfg.sft.response_key)]


def sft_reward_spec(cfg: PostTrainConfig, default: str) -> str:
    """reward.function, else ``default`` (the built-in task's reward; empty with user files: no accuracy)."""
    return cfg.reward.function or default


def answer_of(record: PromptRecord, answer_key: str) -> str | None:
    """What the reward compares against: the row's data.answer_key field when it has one (a worked SFT
    response like "... #### 46" is not the answer "46"), else the record's response."""
    row = record.extra
    if answer_key == "answer" and "answer" not in row and is_verl_row(row):
        answer_key = VERL_ANSWER_KEY
    if not answer_key or not has_path(row, answer_key):
        return record.ground_truth
    value = get_path(row, answer_key)
    return None if value is None else str(value)


class SFTValidator:
    """Computes ``val/loss`` (token-mean NLL of the held-out responses) and ``val/accuracy``."""

    def __init__(
        self,
        cfg: PostTrainConfig,
        tokenizer,
        records: list[PromptRecord],
        reward_spec: str,
    ) -> None:
        d = cfg.data
        kept = tokenize_prompts(records, tokenizer, d.max_prompt_length, d.overlong_prompts)
        self.n_dropped = kept.n_filtered
        warn_dropped(kept.n_filtered, len(records), "SFT validation", d.max_prompt_length)
        records = kept.records
        self.cfg, self.tokenizer, self.records, self.prompts = cfg, tokenizer, records, kept.prompt_ids
        self.dist: DistContext = DistContext()
        self.plain: nn.Module | None = None  # with several ranks: rank 0's unsharded copy that generates
        # code rewards run their programs in the run's sandbox, as in train
        self.reward_fn = (
            resolve_reward_function(reward_spec, sandbox=RunSandbox(cfg.sandbox)) if reward_spec else None
        )
        self.answers = [answer_of(r, cfg.data.answer_key) for r in records]
        targets = [
            list(tokenizer(str(r.ground_truth), add_special_tokens=False)["input_ids"])
            + [tokenizer.eos_token_id]
            for r in records
        ]
        self.responses = [t[: d.max_response_length] for t in targets]
        cut = sum(len(t) > d.max_response_length for t in targets)
        warn_truncated(cut, len(records), "SFT validation", d.max_response_length)

    @torch.no_grad()
    def loss(self, model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        total, tokens = 0.0, 0.0
        step = self.cfg.sft.micro_batch_size_per_gpu
        for lo in range(0, len(self.prompts), step):
            idx = list(range(lo, min(lo + step, len(self.prompts))))
            batch = build_rollout_batch(
                [self.prompts[i] for i in idx],
                [self.responses[i] for i in idx],
                list(range(len(idx))),
                self.tokenizer.pad_token_id,
            ).to(next(model.parameters()).device)
            logprobs, _ = policy_logprobs(model, batch)
            total += float(-(logprobs * batch.response_mask).sum())
            tokens += float(batch.response_mask.sum())
        model.train(was_training)
        return total / max(tokens, 1.0)

    @torch.no_grad()
    def accuracy(self, model: nn.Module, step: int = 0) -> dict[str, float]:
        if self.reward_fn is None:
            return {}
        was_training = model.training
        model.eval()
        engine = NativeEngine(
            model, [self.tokenizer.eos_token_id], self.tokenizer.pad_token_id, self.cfg.rollout.chunk_size
        )
        params = SamplingParams(
            max_tokens=self.cfg.data.max_response_length, greedy=True, seed=self.cfg.trainer.seed
        )
        result = engine.generate(self.prompts, params)
        texts = self.tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
        inputs = [
            RewardInput(self.records[p].prompt, t, self.answers[p], self.records[p].extra)
            for p, t in zip(result.prompt_index, texts)
        ]
        with RewardRunner(self.reward_fn, timeout_s=self.cfg.reward.timeout_s or None) as runner:
            scores, _ = runner.score(inputs)
        model.train(was_training)
        rows = [
            {"prompt": i.prompt, "response": i.response, "ground_truth": i.ground_truth, "reward": s}
            for i, s in zip(inputs, scores, strict=True)
        ]
        write_samples(Path(self.cfg.trainer.run_dir) / SAMPLES_FILENAME, rows, step)
        return {
            "val/accuracy": sum(s >= CORRECT_THRESHOLD for s in scores) / len(scores),
            "val/reward_mean": sum(scores) / len(scores),
        }

    def on_ranks(self, dist: DistContext, model: nn.Module) -> None:
        """Validate a model that will be sharded over ``dist``'s ranks: the held-out loss is a forward of the
        sharded model on every rank; generation (accuracy) runs on rank 0 alone, on an unsharded copy of
        ``model`` taken now (before LoRA and sharding) and refreshed with the gathered weights at each
        validation, as `train`'s rollout engines are."""
        self.dist = dist
        if dist.distributed and dist.is_main and self.reward_fn is not None:
            self.plain = copy.deepcopy(model).eval().requires_grad_(False)

    def _sharded_accuracy(self, model: nn.Module, step: int) -> dict[str, float]:
        state = {name: t.detach() for name, t in policy_weights(model)}  # a collective: every rank gathers
        found = {}
        if self.plain is not None:
            self.plain.load_state_dict(state, strict=False)  # tied weights may appear under one name only
            found = self.accuracy(self.plain, step)
        return self.dist.broadcast_object(found if self.dist.is_main else None)

    def __call__(self, model: nn.Module, step: int = 0) -> dict[str, float]:
        loss = self.loss(model)
        if self.dist.distributed and self.reward_fn is not None:
            return {"val/loss": loss, **self._sharded_accuracy(model, step)}
        return {"val/loss": loss, **self.accuracy(model, step)}
