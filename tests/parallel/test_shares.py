"""Rank-local data in one process: ranks are threads whose collectives sum (or max) over the threads.

Each check splits a batch into shares of whole prompt groups, computes on every share with the share's
collectives, and compares with the whole batch computed at once.
"""

from __future__ import annotations

import threading

import pytest
import torch

from posttrain.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from posttrain.batching.micro import iter_mini_batches
from posttrain.data.batch import build_rollout_batch
from posttrain.parallel.shares import MAX, MEAN, MIN, SUM, DataShare, ShareMetrics, select_share


def run_ranks(world: int, replicas: int, fn) -> list:
    """``fn(share)`` on ``world`` threads; ``replicas`` consecutive threads hold each share."""
    barrier = threading.Barrier(world)
    slots: list = [None] * world

    def collective(rank: int, op):
        def call(values: list[float]) -> list[float]:
            slots[rank] = list(values)
            barrier.wait()
            out = [op(column) for column in zip(*slots)]
            barrier.wait()
            return out

        return call

    results: list = [None] * world
    errors: list = []

    def body(rank: int) -> None:
        share = DataShare(
            index=rank // replicas,
            count=world // replicas,
            replicas=replicas,
            leader=rank % replicas == 0,
            all_reduce_sum=collective(rank, sum),
            all_reduce_max=collective(rank, max),
        )
        try:
            results[rank] = fn(share)
        except Exception as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def step_batch(prompts: int = 6, n: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids, responses, groups = [], [], []
    for p in range(prompts):
        for _ in range(n):
            ids.append([3 + p] * (1 + p % 3))
            responses.append([5] * int(torch.randint(1, 6, (1,), generator=g)))
            groups.append(p)
    batch = build_rollout_batch(ids, responses, groups, pad_token_id=0)
    shape = batch.response_mask.shape
    scores = torch.randint(0, 3, (shape[0],), generator=g).float()  # some zeros: gpg's alpha counts them
    last = batch.response_mask.sum(-1).long() - 1
    batch.token_level_scores = torch.zeros(shape)
    batch.token_level_scores[torch.arange(shape[0]), last] = scores
    batch.values = torch.randn(shape, generator=g) * batch.response_mask
    return batch


@pytest.mark.parametrize(
    "name", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "grpo"]
)
def test_estimators_on_shares_give_the_whole_batch_advantages(name):
    batch = step_batch()
    estimator = ADVANTAGE_ESTIMATORS[name]

    def advantages(b, batch_sum=None):
        kwargs = dict(
            response_mask=b.response_mask, group_ids=b.group_ids, values=b.values, gamma=0.9, lam=0.8
        )
        return estimator(
            AdvantageInputs(token_level_rewards=b.token_level_scores, batch_sum=batch_sum, **kwargs)
        )[0]

    whole = advantages(batch)

    def on_share(share: DataShare):
        local = select_share(batch, share)
        return local.group_ids, advantages(local, share.batch_sum)

    for groups, adv in run_ranks(2, 1, on_share):
        rows = torch.isin(batch.group_ids, groups).nonzero().flatten()
        torch.testing.assert_close(adv, whole[rows], rtol=1e-5, atol=1e-6)


def test_shares_partition_the_step_into_whole_groups():
    batch = step_batch(prompts=5)
    held = run_ranks(2, 1, lambda share: select_share(batch, share).group_ids.tolist())
    assert held == [[0] * 3 + [1] * 3, [2] * 3 + [3] * 3 + [4] * 3]  # prompts [0, 2) and [2, 5)


def test_mini_batch_membership_does_not_depend_on_the_ranks():
    batch = step_batch(prompts=6)

    def groups_per_mini_batch(b, step_groups=None):
        gen = torch.Generator().manual_seed(5)
        minis = iter_mini_batches(b, 2, 2, True, gen, step_groups)
        return [sorted(set(m.group_ids.tolist())) for _, m in minis]

    whole = groups_per_mini_batch(batch)
    per_rank = run_ranks(
        3, 1, lambda share: groups_per_mini_batch(select_share(batch, share), torch.arange(6))
    )
    for k, groups in enumerate(whole):
        assert sorted(g for rank in per_rank for g in rank[k]) == groups


def test_metrics_combine_over_shares_and_count_replicas_once():
    def metrics(share: DataShare) -> dict[str, float]:
        m = ShareMetrics()
        d = share.index
        m.add({"reward/mean": [1.0, 4.0][d]}, MEAN, weight=[1, 3][d])  # 1 sample of 1.0, 3 of 4.0
        m.add({"response_length/max": [7.0, 5.0][d]}, MAX)
        m.add({"x/min": [2.0, -1.0][d]}, MIN)
        m.add({"x/count": 2.0}, SUM)  # per share: both replicas pass it, counted once
        m.add({"reward/num_failures": 1.0}, SUM, own=True)  # per rank: every rank counts
        return share.reduce(m)

    for reduced in run_ranks(4, 2, metrics):
        assert reduced == {
            "reward/mean": pytest.approx(13 / 4),
            "response_length/max": 7.0,
            "x/min": -1.0,
            "x/count": 4.0,
            "reward/num_failures": 4.0,
        }
