"""The reward-model training loop: steps over shuffled pairs, validation, checkpoints, resume.

Each step takes the pairs `rm_schedule` (posttrain.batching.epochs) names, a function of the step and
trainer.seed alone, so a resumed run takes exactly the pairs the uninterrupted run would have taken; weights, optimizer, schedule and RNG states come from the checkpoint (posttrain.train.checkpoint).

Several data-parallel ranks (launched by torchrun, the model sharded with FSDP2): every rank draws the same
step's pairs and trains its contiguous share of them (rm.batch_size divides over the ranks); the loss is
normalised by the pairs of the whole step, over all ranks, so the update is the one-rank update. Validation
scores each rank's share of the held-out pairs and sums the statistics over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from posttrain.batching.epochs import EpochSchedule
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.parallel.data_parallel import SINGLE_RANK, DataParallel
from posttrain.parallel.runtime import shard_bounds
from posttrain.rm.data import TokenizedPair
from posttrain.rm.loss import pair_batch, pair_micro_rows, pair_rows, pair_token_micro_rows, rm_loss_fn
from posttrain.rm.model import score_sequences
from posttrain.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from posttrain.train.trainable import Trainable
from posttrain.train.update import EvenOutCalls, accumulate_and_step, mini_batch_normalizer
from posttrain.utils.crash_hook import crash_if_asked
from posttrain.utils.signals import RunSignals


def rm_schedule(cfg: PostTrainConfig, num_pairs: int) -> EpochSchedule:
    """Which pairs each optimizer step of `posttrain rm` takes (``num_pairs`` usable training pairs); the
    epoch's order is drawn from ``trainer.seed + epoch`` alone."""
    r = cfg.rm
    return EpochSchedule(
        num_items=num_pairs,
        batch_size=r.batch_size,
        epochs=r.epochs,
        seed=cfg.trainer.seed,
        max_steps=r.max_steps,
    )


def rank_share(items: list, dp: DataParallel) -> list:
    """This rank's contiguous share of ``items`` (all of them on one rank)."""
    lo, hi = shard_bounds(len(items), dp.dp_rank, dp.dp_size)
    return items[lo:hi]


def rm_step(
    trainable: Trainable,
    pairs: list[TokenizedPair],
    pad_token_id: int,
    pairs_per_micro: int,
    center_coef: float = 0.0,
    max_tokens: int = 0,
    packed_row_tokens: int = 0,
    dp: DataParallel = SINGLE_RANK,
) -> dict[str, float]:
    """One optimizer step on the step's ``pairs`` (every rank passes all of them and trains its share):
    micro-batches of ``pairs_per_micro``, or of at most ``max_tokens`` tokens when > 0; one normalisation by
    the step's pairs over all ranks. ``packed_row_tokens`` > 0: the packed forward (no pads)."""
    model = trainable.module
    mine = rank_share(pairs, dp)
    mini, margins = pair_batch(mine, pad_token_id)
    normalizer = mini_batch_normalizer(mini, 1.0, dp)
    if max_tokens:
        rows = pair_token_micro_rows(mine, max_tokens)
    else:
        rows = pair_micro_rows(len(mine), pairs_per_micro)
    m = accumulate_and_step(
        model,
        trainable.optimizer,
        trainable.scheduler,
        mini,
        rows,
        rm_loss_fn(model, margins, center_coef, packed_row_tokens),
        normalizer,
        trainable.grad_clip,
        dp,
        _even_out(mini, len(rows), dp),
    )
    out = {"rm/loss": m["loss"], "rm/accuracy": m["rm/accuracy"], "rm/margin": m["rm/margin"]}
    out.update(
        {"rm/grad_norm": m["grad_norm"], "rm/lr": trainable.lr, "rm/micro_batches": m["micro_batches"]}
    )
    if "skipped_steps" in m:
        out["rm/skipped_steps"] = m["skipped_steps"]
    return out


def _even_out(mini, calls: int, dp: DataParallel) -> EvenOutCalls | None:
    """The calls that bring this rank's micro-batch count to the most any rank makes (token budgets cut the
    ranks' shares differently; a sharded model's collectives must line up): forwards of this rank's first
    pair, both sides (a micro-batch holds whole pairs), with no gradient."""
    if dp.grad_ranks == 1:
        return None
    most = int(dp.all_reduce_max([float(calls)])[0])
    return EvenOutCalls(mini.select(pair_rows(mini.num_rows // 2, [0])), most - calls)


def validate_pairs(
    model: nn.Module,
    pairs: list[TokenizedPair],
    pad_token_id: int,
    batch: int,
    dp: DataParallel = SINGLE_RANK,
) -> dict[str, float]:
    """Held-out accuracy (chosen scored higher), mean margin, and the mean/std of all the scores; with several
    ranks each scores its share of ``pairs`` and the sums are taken over all ranks (the one-rank values)."""
    mine = rank_share(pairs, dp)
    calls = int(dp.all_reduce_max([float(-(-len(mine) // batch))])[0])  # the same forwards on every rank
    chosen = score_sequences(
        model, [p.chosen_ids for p in mine], pad_token_id, batch, calls, pairs[0].chosen_ids
    )
    rejected = score_sequences(
        model, [p.rejected_ids for p in mine], pad_token_id, batch, calls, pairs[0].rejected_ids
    )
    both = torch.cat([chosen, rejected]).double()
    correct, margin, total, count = dp.all_reduce_sum(
        [
            float((chosen > rejected).sum()),
            float((chosen - rejected).double().sum()),
            float(both.sum()),
            len(mine),
        ]
    )
    mean = total / (2 * count)
    (squares,) = dp.all_reduce_sum([float(((both - mean) ** 2).sum())])  # two passes: no cancellation
    return {
        "val/accuracy": correct / count,
        "val/margin": margin / count,
        "val/reward_mean": mean,
        "val/reward_std": (squares / (2 * count)) ** 0.5,
    }


def check_finite(model: nn.Module, dp: DataParallel = SINGLE_RANK) -> None:
    """Refuse to checkpoint non-finite weights: every rank checks its own shards, all learn the verdict."""
    bad = [
        n
        for n, p in model.named_parameters()
        if not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
    ]
    if dp.all_reduce_sum([float(len(bad))])[0]:
        raise RuntimeError(
            f"non-finite weights in {bad[:3] or 'another rank'}; the last checkpoint is left as it was"
        )


def resume(run_dir: Path, how: str, trainable: Trainable, quiet: bool) -> int:
    """Restore the latest (or the named) checkpoint; returns its step (0: a fresh run)."""
    ckpt = find_checkpoint(run_dir, how)
    if ckpt is None:
        return 0
    state = load_checkpoint(
        ckpt,
        modules={"rm": trainable.module},
        optimizers={"rm": trainable.optimizer},
        schedulers={"rm": trainable.scheduler},
        verify=False,
    )
    if not quiet:
        print(f"Resumed from {ckpt} (step {state['step']})")
    return int(state["step"])


def save(
    run_dir: Path, step: int, trainable: Trainable, keep_last: int, dp: DataParallel = SINGLE_RANK
) -> Path:
    check_finite(trainable.module, dp)
    return save_checkpoint(
        run_dir,
        step,
        modules={"rm": trainable.module},
        optimizers={"rm": trainable.optimizer},
        schedulers={"rm": trainable.scheduler},
        trainer_state={"step": step},
        keep_last=keep_last,
    )


@dataclass
class LoopSettings:
    run_dir: Path
    pad_token_id: int
    pairs_per_micro: int
    center_coef: float
    save_freq: int
    keep_last: int
    max_skipped_steps: int
    save_on_terminate: bool
    max_tokens: int = 0  # > 0: micro-batches by token budget (rm.use_dynamic_bsz)
    packed_row_tokens: int = 0  # > 0: packed forward, rows of this many tokens (model.use_remove_padding)
    dp: DataParallel = SINGLE_RANK  # the data-parallel ranks (several under torchrun)


def run_steps(
    s: LoopSettings,
    trainable: Trainable,
    pairs: list[TokenizedPair],
    schedule: EpochSchedule,
    start: int,
    on_step: Callable[[int, dict[str, float]], None],
) -> None:
    """Steps start+1..total: train, report (``on_step`` validates, logs, displays), checkpoint."""
    signals = RunSignals(save_at_step_end=s.save_on_terminate).install()
    skipped = 0
    try:
        for step in range(start + 1, schedule.total_steps + 1):
            crash_if_asked(step, s.dp.dp_rank)  # a test's fault (POSTTRAIN_TEST_CRASH); nothing otherwise
            chunk = [pairs[i] for i in schedule.indices(step)]
            metrics = rm_step(
                trainable, chunk, s.pad_token_id, s.pairs_per_micro, s.center_coef, s.max_tokens,
                s.packed_row_tokens, s.dp,
            )  # fmt: skip
            on_step(step, metrics)
            skipped = skipped + 1 if metrics.get("rm/skipped_steps") else 0
            if skipped > s.max_skipped_steps:
                raise ConfigError(
                    f"{skipped} optimizer steps in a row had a non-finite gradient (trainer.max_skipped_steps="
                    f"{s.max_skipped_steps}); lower rm.optim.lr or check the data"
                )
            saved = (s.save_freq and step % s.save_freq == 0) or step == schedule.total_steps
            if saved:
                with signals.critical():
                    save(s.run_dir, step, trainable, s.keep_last, s.dp)
            signals.stop_after_step(
                step,
                bool(saved),
                lambda st=step: save(s.run_dir, st, trainable, s.keep_last, s.dp),
                lambda asked: s.dp.all_reduce_sum([float(asked)])[0] > 0,  # SIGTERM on any rank
            )
    finally:
        signals.restore()
