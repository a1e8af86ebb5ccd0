"""Supervised fine-tuning: loss on response tokens only, on the same batch machinery as RL.

An SFT example is a prompt (chat template applied) and a target response followed by EOS, or a whole
conversation (multi-turn, with tool calls and tool results) trained on its assistant messages only
(posttrain.sft.conversation). It is laid out like a rollout sample, so each optimizer step is the RL update's own
(``posttrain.train.update.update_mini_batch``: global loss normalisation, micro-batches, clipping), and the
steps run on the training loop of every command (posttrain.train.loop).

Several data-parallel ranks (launched by torchrun, the model sharded with FSDP2 as `posttrain rm` shards its
model): every rank draws the same step's examples and trains its contiguous share of them (sft.batch_size
divides over the ranks); the loss is normalised by the response tokens of the whole step, over all ranks, so
the update is the one-rank update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer, aggregate_loss
from posttrain.batching.epochs import EpochSchedule
from posttrain.config.errors import ConfigError, DataError
from posttrain.config.plan import UpdatePlan, build_sft_plan
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.roles import ShardingConfig
from posttrain.data.batch import RolloutBatch, build_rollout_batch
from posttrain.data.datasets import encode_prompt, load_records, warn_dropped, warn_truncated
from posttrain.data.records import PromptRecord
from posttrain.forward.options import pass_options
from posttrain.forward.passes import DEFAULT_OPTIONS, ForwardOptions, policy_logprobs
from posttrain.models.hf import resolve_dtype
from posttrain.models.prepare import check_policy_switches, prepare_policy
from posttrain.parallel.data_parallel import SINGLE_RANK, DataParallel, data_parallel
from posttrain.parallel.fsdp import shard_model
from posttrain.parallel.runtime import DistContext, shard_bounds
from posttrain.sft.conversation import conversation_example, is_conversation
from posttrain.train.loop import Checkpoints, LoopSettings, TrainLoop
from posttrain.train.trainable import Trainable
from posttrain.train.update import update_mini_batch
from posttrain.utils.console import TrainingDisplay

log = logging.getLogger("posttrain.sft")


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int] | None = None  # 1 on the trained response tokens; None: all of them
    truncated: bool = False  # the target was cut at data.max_response_length


def _conversation(rec: PromptRecord, tokenizer, where: str, max_response_length: int) -> SFTExample:
    """A multi-turn example: every assistant message of the record's messages is trained on."""
    prompt, response, mask = conversation_example(list(rec.prompt), tokenizer, rec.extra.get("tools"), where)
    cut = len(response) > max_response_length
    return SFTExample(prompt, response[:max_response_length], mask[:max_response_length], truncated=cut)


def make_examples(records: list[PromptRecord], tokenizer, max_prompt_length: int, max_response_length: int):
    """Tokenize (prompt, ground-truth response) pairs; responses end with EOS so the model learns to stop."""
    template = bool(getattr(tokenizer, "chat_template", None))
    examples = []
    for i, rec in enumerate(records):
        # Without a response, a prompt of messages with assistant turns is a whole conversation to learn; with
        # one, earlier assistant turns are few-shot context, as before.
        if template and rec.ground_truth is None and is_conversation(rec.prompt):
            example = _conversation(rec, tokenizer, rec.source or f"SFT example {i}", max_response_length)
            if len(example.prompt_ids) <= max_prompt_length and any(example.mask):
                examples.append(example)
            continue
        if rec.ground_truth is None:
            where = rec.source or f"SFT example {i}"
            raise DataError(
                f"{where}: the response is null; every SFT example needs one (sft.response_key), or a "
                "conversation prompt with assistant messages (data.prompt_key=messages sft.response_key='')"
            )
        prompt = encode_prompt(rec.prompt, tokenizer, template, where=f"row {i}")
        response = tokenizer(str(rec.ground_truth), add_special_tokens=False)["input_ids"]
        response = list(response) + [tokenizer.eos_token_id]
        if len(prompt) <= max_prompt_length:
            cut = (
                len(response) > max_response_length
            )  # a cut target also loses its EOS: it never learns to stop
            examples.append(SFTExample(prompt, response[:max_response_length], truncated=cut))
    if not examples:
        raise ConfigError(f"no SFT example fits data.max_prompt_length={max_prompt_length}; raise it")
    warn_dropped(len(records) - len(examples), len(records), "SFT", max_prompt_length)
    warn_truncated(sum(e.truncated for e in examples), len(examples), "SFT", max_response_length)
    return examples


def _sft_loss(model: nn.Module, options: ForwardOptions = DEFAULT_OPTIONS):
    def loss_fn(mb: RolloutBatch, normalizer: LossNormalizer):
        logprobs, _ = policy_logprobs(model, mb, options=options)
        nll = aggregate_loss(-logprobs, mb.response_mask, "token-mean", normalizer)
        return nll, {
            "sft/token_nll": (-(logprobs * mb.response_mask).sum() / mb.response_mask.sum()).detach()
        }

    return loss_fn


def sft_schedule(seed: int, num_examples: int, plan: UpdatePlan, max_steps: int) -> EpochSchedule:
    """Which examples each optimizer step takes: plan.mini_batch_samples (sft.batch_size) per step,
    plan.ppo_epochs (sft.epochs) passes, at most ``max_steps`` (sft.max_steps; 0: all)."""
    return EpochSchedule(
        num_items=num_examples,
        batch_size=plan.mini_batch_samples,
        epochs=plan.ppo_epochs,
        seed=seed,
        max_steps=max_steps,
        shuffle="one_generator",
    )


@dataclass(frozen=True)
class SFTTraining:
    """SFT of one model, ready to run: its examples, their schedule, the optimizer and the loss.
    ``step(s)`` trains optimizer step s (1-based), the step function of the training loop."""

    model: nn.Module
    examples: list[SFTExample]
    plan: UpdatePlan
    schedule: EpochSchedule
    trainable: Trainable
    loss_fn: Callable
    pad_token_id: int
    dist: DistContext = field(default_factory=DistContext)
    dp: DataParallel = field(default_factory=DataParallel)

    def step(self, step: int) -> dict[str, float]:
        self.model.train()  # validation puts it back as it found it; this is for the first step
        chunk = [self.examples[i] for i in self.schedule.indices(step)]
        lo, hi = shard_bounds(len(chunk), self.dp.dp_rank, self.dp.dp_size)  # this rank's share
        out = _sft_step(chunk[lo:hi], self.plan, self.trainable, self.loss_fn, self.pad_token_id, self.dp)
        if self.any_truncated:  # a metric of runs that cut targets only: no column of zeros elsewhere
            out["sft/truncated_share"] = sum(e.truncated for e in chunk) / len(chunk)
        return out

    @cached_property
    def any_truncated(self) -> bool:
        return any(e.truncated for e in self.examples)

    def checkpoints(self, run_dir: Path, keep_last: int) -> Checkpoints:
        """What a checkpoint of SFT holds: the model (a LoRA model's adapters only), its optimizer and
        schedule; the step alone says which examples come next (the schedule)."""
        t = self.trainable
        return Checkpoints(
            run_dir=run_dir,
            modules={"sft": t.module},
            optimizers={"sft": t.optimizer},
            schedulers={"sft": t.scheduler},
            keep_last=keep_last,
            dist=self.dist,
        )


def _sft_step(
    chunk: list[SFTExample],
    plan: UpdatePlan,
    trainable: Trainable,
    loss_fn: Callable,
    pad_token_id: int,
    dp: DataParallel = SINGLE_RANK,
) -> dict[str, float]:
    """One optimizer step on ``chunk`` (this rank's share of the step), laid out as a rollout batch: the RL
    update's own mini-batch step, its loss normalised over every rank's tokens."""
    mini = build_rollout_batch(
        [e.prompt_ids for e in chunk],
        [e.response_ids for e in chunk],
        list(range(len(chunk))),
        pad_token_id,
        trainable_mask=[e.mask if e.mask is not None else [1] * len(e.response_ids) for e in chunk],
    )
    metrics = update_mini_batch(
        trainable,
        mini,
        loss_fn,
        micro_batch_size=plan.micro_batch_size_per_rank,
        max_tokens=None,
        norm_constant=mini.response_width,
        dp=dp,
    )
    out = {"sft/loss": metrics["loss"], "sft/grad_norm": metrics["grad_norm"], "sft/lr": trainable.lr}
    if "skipped_steps" in metrics:  # a non-finite gradient: the step was skipped (the loop's guard reads it)
        out["sft/skipped_steps"] = metrics["skipped_steps"]
    return out


def sft_records(cfg: PostTrainConfig, fallback: list[PromptRecord]) -> list[PromptRecord]:
    """sft.train_files (prompt under data.prompt_key, target under sft.response_key) or `fallback`."""
    if not cfg.sft.train_files:
        return fallback
    return [
        r for f in cfg.sft.train_files for r in load_records(f, cfg.data.prompt_key, cfg.sft.response_key)
    ]


def prepare_sft(
    cfg: PostTrainConfig,
    model: nn.Module,
    tokenizer,
    records: list[PromptRecord],
    dist: DistContext | None = None,
) -> SFTTraining:
    """SFT of `model` in place on `records` with the `sft` section's settings.

    The model section's switches apply as for the actor (model.use_remove_padding, enable_gradient_checkpointing,
    enable_activation_offload, use_liger), checked before any step runs. ``dist`` with several ranks: the
    model is sharded with FSDP2 over them (actor.fsdp_config's layout is not read: SFT's is the default one)
    and each rank trains its share of every step.
    """
    dist = dist or DistContext()
    device = next(model.parameters()).device
    check_policy_switches(cfg, device, model.config)
    prepare_policy(model, cfg)
    if dist.distributed:
        shard_model(model, dist, ShardingConfig(), resolve_dtype(cfg.model.dtype))
    options = pass_options(cfg, device).sft
    examples = make_examples(records, tokenizer, cfg.data.max_prompt_length, cfg.data.max_response_length)
    plan = build_sft_plan(cfg, world_size=dist.world_size)
    if len(examples) < plan.mini_batch_samples:
        raise ConfigError(
            f"sft.batch_size ({cfg.sft.batch_size}) exceeds the {len(examples)} usable SFT examples; lower it"
        )
    schedule = sft_schedule(cfg.trainer.seed, len(examples), plan, cfg.sft.max_steps)
    return SFTTraining(
        model=model,
        examples=examples,
        plan=plan,
        schedule=schedule,
        trainable=Trainable.create(model, cfg.sft.optim, schedule.total_steps),
        loss_fn=_sft_loss(model, options),
        pad_token_id=tokenizer.pad_token_id,
        dist=dist,
        dp=data_parallel(dist),
    )


def sft_display(total_steps: int, start: int, quiet: bool) -> TrainingDisplay:
    return TrainingDisplay(
        total_steps=total_steps, start_step=start, description="sft", disable=quiet, every=10
    )


def run_sft(
    cfg: PostTrainConfig, model: nn.Module, tokenizer, records: list[PromptRecord], quiet: bool = False
) -> list[dict[str, float]]:
    """SFT `model` in place on `records` on the training loop, without a run directory (no checkpoints, no
    metrics file, no validation: the built-in model's warm start); returns each step's metrics."""
    training = prepare_sft(cfg, model, tokenizer, records)
    history: list[dict[str, float]] = []

    def step(s: int) -> dict[str, float]:
        history.append(training.step(s))
        return history[-1]

    total = training.schedule.total_steps
    TrainLoop(
        settings=LoopSettings.of(cfg.trainer, total),
        step=step,
        roles=("sft",),
        display=sft_display(total, 0, quiet),
    ).run(0)
    return history
