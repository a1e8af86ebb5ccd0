"""The reward model's step, validation and checkpoint contents; `posttrain rm` runs them on the one training
loop (posttrain.train.loop: checkpoints, resume, the skipped-step guard, signals).

Each step takes the pairs `rm_schedule` (posttrain.batching.epochs) names, a function of the step and
trainer.seed alone, so a resumed run takes exactly the pairs the uninterrupted run would have taken; weights,
optimizer, schedule and RNG states come from the checkpoint (posttrain.train.checkpoint).

Several data-parallel ranks (launched by torchrun, the model sharded with FSDP2): every rank draws the same
step's pairs and trains its contiguous share of them (rm.batch_size divides over the ranks); the loss is
normalised by the pairs of the whole step, over all ranks, so the update is the one-rank update. Validation
scores each rank's share of the held-out pairs and sums the statistics over the ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from posttrain.batching.epochs import EpochSchedule
from posttrain.config.schema import PostTrainConfig
from posttrain.parallel.data_parallel import SINGLE_RANK, DataParallel
from posttrain.parallel.runtime import DistContext, shard_bounds
from posttrain.rm.data import TokenizedPair
from posttrain.rm.loss import pair_batch, pair_micro_rows, pair_rows, pair_token_micro_rows, rm_loss_fn
from posttrain.rm.model import score_sequences
from posttrain.train.loop import Checkpoints
from posttrain.train.trainable import Trainable
from posttrain.train.update import EvenOutCalls, accumulate_and_step, mini_batch_normalizer


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


def rm_checkpoints(run_dir: Path, trainable: Trainable, keep_last: int, dist: DistContext) -> Checkpoints:
    """What a checkpoint of `posttrain rm` holds: the model (a LoRA model's adapters and score head), its
    optimizer and schedule; the step alone says which pairs come next (rm_schedule)."""
    return Checkpoints(
        run_dir=run_dir,
        modules={"rm": trainable.module},
        optimizers={"rm": trainable.optimizer},
        schedulers={"rm": trainable.scheduler},
        keep_last=keep_last,
        dist=dist,
    )
