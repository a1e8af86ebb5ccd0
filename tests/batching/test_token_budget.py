"""Token-budget micro-batches: the cap is hard, the count minimal, ranks agree, order restores exactly."""

import math
import random

import pytest
import torch

from posttrain.batching.token_budget import (
    minimal_num_micro_batches,
    plan_token_micro_batches,
    plan_token_micro_batches_for_ranks,
    restore_order,
)


def _rl_lengths(rng: random.Random, n: int, max_response: int = 1024) -> list[int]:
    # prompt 50-300 tokens + a long-tailed response, capped like a rollout's max_response_length
    return [rng.randint(50, 300) + min(max_response, int(rng.lognormvariate(5.5, 1.0))) for _ in range(n)]


def _random_case(rng: random.Random) -> tuple[list[int], int]:
    kind = rng.randrange(7)
    cap = rng.choice([64, 100, 257, 1024, 4096])
    n = rng.randint(1, 96)
    if kind == 0:  # uniform over the whole budget
        lens = [rng.randint(1, cap) for _ in range(n)]
    elif kind == 1:  # adversarial: just over half the budget, nothing can pair up
        lens = [cap // 2 + 1 + rng.randint(0, max(0, cap // 8)) for _ in range(n)]
    elif kind == 2:  # bimodal: near-cap giants and many tiny sequences
        lens = [rng.choice([cap - rng.randint(0, 3), rng.randint(1, max(1, cap // 10))]) for _ in range(n)]
    elif kind == 3:  # every sequence exactly at the cap
        lens = [cap] * n
    elif kind == 4:  # thirds: items slightly above cap/3 (three never fit together)
        lens = [cap // 3 + 1 + rng.randint(0, 2) for _ in range(n)]
    elif kind == 5:  # RL rollout lengths with a budget of 2-3 max sequences
        cap = rng.choice([2, 3]) * 1324
        lens = _rl_lengths(rng, n)
    else:  # includes zero-length entries
        lens = [rng.choice([0, rng.randint(1, cap)]) for _ in range(n)]
    return lens, cap


def _check_plan(lens: list[int], cap: int, plan: list[list[int]]) -> None:
    assert sorted(i for mb in plan for i in mb) == list(range(len(lens)))
    assert all(mb for mb in plan), "empty micro-batch"
    for mb in plan:
        assert sum(lens[i] for i in mb) <= cap, f"over budget: {sum(lens[i] for i in mb)} > {cap}"


def test_hard_cap_never_exceeded_on_random_and_adversarial_distributions():
    rng = random.Random(1234)
    for _ in range(300):
        lens, cap = _random_case(rng)
        plan = plan_token_micro_batches(lens, cap)
        _check_plan(lens, cap, plan)
        assert len(plan) >= max(1, math.ceil(sum(lens) / cap))
        assert len(plan) == minimal_num_micro_batches(lens, cap)


def _fits(order: list[int], loads: list[int], cap: int, pos: int = 0) -> bool:
    """Exhaustive search: can items order[pos:] be added to bins with these loads?"""
    if pos == len(order):
        return True
    tried = set()
    for j in range(len(loads)):
        if loads[j] in tried or loads[j] + order[pos] > cap:
            continue
        tried.add(loads[j])
        loads[j] += order[pos]
        if _fits(order, loads, cap, pos + 1):
            return True
        loads[j] -= order[pos]
    return False


def _exact_min_bins(lens: list[int], cap: int) -> int:
    order = sorted(lens, reverse=True)
    return next(k for k in range(1, len(order) + 1) if _fits(order, [0] * k, cap))


def test_count_is_minimal_against_exhaustive_search():
    rng = random.Random(7)
    for _ in range(150):
        cap = rng.choice([10, 16, 50])
        lens = [rng.randint(1, cap) for _ in range(rng.randint(1, 9))]
        assert len(plan_token_micro_batches(lens, cap)) == _exact_min_bins(lens, cap), (lens, cap)


def test_typical_rl_batches_reach_volume_bound_and_balance():
    rng = random.Random(3)
    for _ in range(20):
        lens = _rl_lengths(rng, 64)
        cap = 3 * 1324
        plan = plan_token_micro_batches(lens, cap)
        _check_plan(lens, cap, plan)
        assert len(plan) == math.ceil(sum(lens) / cap)
        loads = [sum(lens[i] for i in mb) for mb in plan]
        assert max(loads) / (sum(loads) / len(loads)) <= 1.05


def test_verl_style_split_overflows_where_ours_does_not(verl_reference):
    ref = verl_reference
    lens, cap = [33, 33, 33, 33], 64
    theirs = ref.verl_rearrange_micro_batches(lens, cap, use_workload=False)
    assert max(sum(lens[i] for i in mb) for mb in theirs) > cap  # 3 micro-batches, one holds 66 tokens
    ours = plan_token_micro_batches(lens, cap)
    _check_plan(lens, cap, ours)
    assert len(ours) == 4


def test_over_long_sequence_names_length_and_budget():
    with pytest.raises(ValueError, match=r"100 tokens.*max_tokens=64"):
        plan_token_micro_batches([10, 100, 5], 64)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="max_tokens"):
        plan_token_micro_batches([1], 0)
    with pytest.raises(ValueError, match="negative"):
        plan_token_micro_batches([1, -2], 8)
    with pytest.raises(ValueError, match="min_num_micro_batches"):
        plan_token_micro_batches([1, 2], 8, min_num_micro_batches=3)
    assert plan_token_micro_batches([], 8) == []


def test_min_num_micro_batches_forces_count_and_keeps_cap():
    rng = random.Random(11)
    for _ in range(50):
        lens, cap = _random_case(rng)
        k0 = minimal_num_micro_batches(lens, cap)
        want = min(len(lens), k0 + rng.randint(0, 4))
        plan = plan_token_micro_batches(lens, cap, min_num_micro_batches=want)
        assert len(plan) == want
        _check_plan(lens, cap, plan)


def test_same_count_on_every_rank():
    rng = random.Random(5)
    for _ in range(40):
        world = rng.choice([2, 4])
        cap = rng.choice([1324, 2648])
        per_rank = [_rl_lengths(rng, 32) for _ in range(world)]
        per_rank[0] = [min(cap, 4 * v) for v in per_rank[0]]  # one rank much heavier than the others
        plans = plan_token_micro_batches_for_ranks(per_rank, cap)
        counts = {len(p) for p in plans}
        assert len(counts) == 1
        assert counts.pop() == max(minimal_num_micro_batches(lens, cap) for lens in per_rank)
        for lens, plan in zip(per_rank, plans):
            _check_plan(lens, cap, plan)


def test_ranks_with_too_few_sequences_raise():
    with pytest.raises(ValueError, match="rank 1"):
        plan_token_micro_batches_for_ranks([[60, 60, 60, 60], [5]], 64)


def test_deterministic():
    rng = random.Random(9)
    lens = _rl_lengths(rng, 128)
    assert plan_token_micro_batches(lens, 2648) == plan_token_micro_batches(list(lens), 2648)


def test_restore_order_is_exact_inverse():
    rng = random.Random(2)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lens = _rl_lengths(rng, rng.randint(1, 40))
        plan = plan_token_micro_batches(lens, 2648)
        values = torch.randn(len(lens), 5, generator=g)
        outputs = [values[torch.tensor(mb)] * 1 for mb in plan]  # what a forward-only pass returns per micro
        restored = restore_order(outputs, plan)
        assert torch.equal(restored, values)


def test_restore_order_validates():
    with pytest.raises(ValueError, match="permutation"):
        restore_order([torch.zeros(2), torch.zeros(1)], [[0, 1], [1]])
    with pytest.raises(ValueError, match="rows"):
        restore_order([torch.zeros(3)], [[0, 1]])
