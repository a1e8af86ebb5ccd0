"""Dynamic micro-batches by token budget, with a hard cap.

A micro-batch is a set of sequences whose valid tokens are processed in one forward (and backward) pass; its
memory grows with its token count, so a token budget ``max_tokens`` bounds peak activation memory no matter
how the lengths are distributed. Two requirements drive the design:

* **The cap is hard.** A budget is chosen to fit memory; a micro-batch above it can run out of memory on the
  one step where lengths happen to line up badly. verl's dynamic batching fixes the count at
  ``ceil(total / max_tokens)`` and then balances with Karmarkar–Karp, which ignores the cap: four sequences
  of 33 tokens with a 64-token budget give three micro-batches, one of them holding 66 tokens. Here the count
  starts at the lower bound and grows until a partition within the cap is found.
* **Few, even micro-batches.** Each micro-batch costs a fixed overhead (kernel launches, FSDP all-gathers),
  so the count is the smallest one for which a capped partition is found, and among partitions with that
  count the largest load is minimised (the slowest micro-batch sets the step time of every rank).

Search for a given count ``k`` (all deterministic, stable tie-breaking by index): LPT with the cap,
first-fit decreasing, best-fit decreasing and Karmarkar–Karp, each improved by the local search of
:func:`posttrain.batching.balance.refine_partition` (which never raises the maximum load, so it never breaks
the cap); if all miss the cap, a depth-first search with a node budget (exact for small inputs). The count
found is minimal whenever one of these finds a partition at the lower bound, which is the common case.

Distributed use: all DP ranks must run the same number of micro-batches (each one triggers collectives).
Each rank computes :func:`minimal_num_micro_batches` locally, all-reduces the maximum, then calls
:func:`plan_token_micro_batches` with ``min_num_micro_batches`` set to it.
:func:`plan_token_micro_batches_for_ranks` does the same for all ranks in one process.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from posttrain.batching.balance import karmarkar_karp_partition, lpt_partition, refine_partition

__all__ = [
    "minimal_num_micro_batches",
    "plan_token_micro_batches",
    "plan_token_micro_batches_for_ranks",
    "restore_order",
]

_DFS_STEP_BUDGET = 50_000


def _validate(seq_lens: Sequence[int], max_tokens: int) -> list[int]:
    if int(max_tokens) < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    values = [int(v) for v in seq_lens]
    for i, v in enumerate(values):
        if v < 0:
            raise ValueError(f"seq_lens[{i}] = {v} is negative; sequence lengths must be >= 0")
        if v > max_tokens:
            raise ValueError(
                f"sequence {i} has {v} tokens, more than the micro-batch token budget max_tokens={max_tokens}; "
                f"raise the budget to at least {v} (e.g. max_prompt_length + max_response_length) "
                f"or truncate the sequence"
            )
    return values


def _lower_bound(values: list[int], cap: int) -> int:
    """Lower bound on the number of capped bins: Martello–Toth L2 (at least the volume bound) and a
    cardinality bound.

    For a threshold ``a <= cap / 2``: items above ``cap - a`` each need a bin that nothing of size >= ``a``
    can join; items in ``(cap / 2, cap - a]`` each need their own bin too, and items in ``[a, cap / 2]`` fill
    the room those leave before opening new bins.
    """
    n = len(values)
    ordered = sorted(values)
    prefix = [0]
    for v in ordered:
        prefix.append(prefix[-1] + v)
    best = max(1, -(-prefix[-1] // cap))
    half_hi = bisect.bisect_right(ordered, cap // 2)  # items <= cap / 2 (integers)
    for a in sorted(set(ordered[:half_hi]) | {0}):
        big_start = bisect.bisect_right(ordered, cap - a)  # items > cap - a
        mid_start = half_hi  # items in (cap / 2, cap - a]
        mid_count = max(0, big_start - mid_start)
        mid_sum = prefix[big_start] - prefix[mid_start] if mid_count else 0
        small_start = bisect.bisect_left(ordered, a)  # items in [a, cap / 2]
        small = prefix[half_hi] - prefix[small_start]
        room = mid_count * cap - mid_sum
        extra = max(0, -(-(small - room) // cap))
        best = max(best, (n - big_start) + mid_count + extra)
    # Cardinality bound: no micro-batch can hold more items than the smallest ones that fit together.
    fit = bisect.bisect_right(prefix, cap) - 1  # largest t with sum of the t smallest <= cap
    if fit > 0:
        best = max(best, -(-n // fit))
    return best


def _fit_decreasing(values: list[int], k: int, cap: int, *, best_fit: bool) -> list[list[int]] | None:
    """First-fit (or best-fit) decreasing into exactly ``k`` bins; ``None`` when an item fits nowhere."""
    parts: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(values)), key=lambda i: (-values[i], i)):
        v = values[i]
        fits = [j for j in range(k) if loads[j] + v <= cap]
        if not fits:
            return None
        # best fit: the fullest bin that still takes the item (leaves room in the others for big items)
        j = min(fits, key=lambda j: (-loads[j], j)) if best_fit else fits[0]
        parts[j].append(i)
        loads[j] += v
    return parts


def _dfs(values: list[int], k: int, cap: int, budget: int) -> list[list[int]] | None:
    """Exact capped assignment into ``k`` bins by depth-first search, giving up after ``budget`` bin inspections.

    Items go in decreasing order; bins with equal load are interchangeable for the remaining items, so only
    one of them is tried, and a branch stops when the remaining items exceed the remaining room.
    """
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    weights = [values[i] for i in order]
    loads = [0] * k
    assign = [0] * len(order)
    suffix = [0] * (len(order) + 1)
    for pos in range(len(order) - 1, -1, -1):
        suffix[pos] = suffix[pos + 1] + weights[pos]
    room_total = k * cap
    tries = 0

    def rec(pos: int, used: int) -> bool:
        nonlocal tries
        if pos == len(order):
            return True
        if suffix[pos] > room_total - used:
            return False
        v = weights[pos]
        seen: set[int] = set()
        tries += k  # the scan below costs k steps whatever it finds
        if tries > budget:
            return False
        for j in range(k):
            load = loads[j]
            if load in seen or load + v > cap:
                continue
            seen.add(load)
            loads[j] = load + v
            assign[pos] = j
            if rec(pos + 1, used + v):
                return True
            loads[j] = load
        return False

    if not rec(0, 0):
        return None
    parts: list[list[int]] = [[] for _ in range(k)]
    for pos, i in enumerate(order):
        parts[assign[pos]].append(i)
    return parts


def _fill_empty(values: list[int], parts: list[list[int]]) -> list[list[int]]:
    """Give every empty part one item, taken from the part with most items (its smallest item).

    Moving an item out of a part only lowers that part's load, and the item alone is within the cap, so the
    cap still holds. Needs at least as many items as parts.
    """
    parts = [list(p) for p in parts]
    for j in range(len(parts)):
        if parts[j]:
            continue
        src = max(range(len(parts)), key=lambda s: (len(parts[s]), -s))
        pos = min(range(len(parts[src])), key=lambda q: (values[parts[src][q]], parts[src][q]))
        parts[j].append(parts[src].pop(pos))
    return parts


def _load(values: list[int], part: list[int]) -> int:
    return sum(values[i] for i in part)


def _capped_partition(values: list[int], k: int, cap: int) -> list[list[int]] | None:
    """Best capped partition of all items into exactly ``k`` non-empty parts that the heuristics find."""
    candidates = [
        lpt_partition(values, k, cap=cap),
        _fit_decreasing(values, k, cap, best_fit=False),
        _fit_decreasing(values, k, cap, best_fit=True),
        karmarkar_karp_partition(values, k, equal_size=False),
    ]
    best: list[list[int]] | None = None
    best_max = 0
    for cand in candidates:
        if cand is None:
            continue
        refined = refine_partition(values, _fill_empty(values, cand), allow_moves=True)
        cur = max(_load(values, p) for p in refined)
        if cur <= cap and (best is None or cur < best_max):
            best, best_max = refined, cur
    if best is None:
        exact = _dfs(values, k, cap, _DFS_STEP_BUDGET)
        if exact is not None:
            best = refine_partition(values, _fill_empty(values, exact), allow_moves=True)
    return best


def _search_minimal(values: list[int], cap: int) -> list[list[int]]:
    # First-fit decreasing with unlimited bins gives a feasible count (upper bound); the counts between the
    # lower bound and it are tried in increasing order, and the first capped partition found wins.
    upper = sum(1 for p in _fit_decreasing(values, len(values), cap, best_fit=False) or [] if p)
    for k in range(min(_lower_bound(values, cap), upper), upper + 1):
        parts = _capped_partition(values, k, cap)
        if parts is not None:
            return parts
    raise AssertionError("unreachable: first-fit decreasing found a capped partition with this count")


def _ordered(values: list[int], parts: list[list[int]]) -> list[list[int]]:
    # Indices ascending inside a micro-batch; heaviest micro-batch first so an out-of-memory shows at once.
    out = [sorted(p) for p in parts]
    out.sort(key=lambda p: (-_load(values, p), p[0] if p else -1))
    return out


def minimal_num_micro_batches(seq_lens: Sequence[int], max_tokens: int) -> int:
    """Smallest number of micro-batches found for which every micro-batch holds at most ``max_tokens``
    valid tokens (0 for an empty input). This is what each DP rank all-reduces (max) before planning."""
    values = _validate(seq_lens, max_tokens)
    return len(_search_minimal(values, int(max_tokens))) if values else 0


def plan_token_micro_batches(
    seq_lens: Sequence[int], max_tokens: int, *, min_num_micro_batches: int = 1
) -> list[list[int]]:
    """Split sequences into micro-batches of at most ``max_tokens`` valid tokens each.

    Args:
        seq_lens: ``[n]`` valid-token counts of the sequences on this rank.
        max_tokens: hard per-micro-batch token budget; never exceeded.
        min_num_micro_batches: use at least this many micro-batches (pass the all-reduced maximum of
            :func:`minimal_num_micro_batches` over DP ranks so every rank gets the same count; pipeline
            schedules may also need a minimum).

    Returns:
        ``k`` non-empty lists of indices into ``seq_lens`` (ascending inside each list), heaviest first,
        where ``k = max(min_num_micro_batches, minimal feasible count)``; an empty input gives ``[]``.

    Raises:
        ValueError: a sequence longer than ``max_tokens`` (the message names both numbers), a negative
            length, ``max_tokens < 1``, or ``min_num_micro_batches`` greater than the number of sequences.
    """
    values = _validate(seq_lens, max_tokens)
    cap = int(max_tokens)
    if not values:
        return []
    if min_num_micro_batches > len(values):
        raise ValueError(
            f"min_num_micro_batches={min_num_micro_batches} exceeds the number of sequences ({len(values)}); "
            f"a micro-batch cannot be empty. Give every DP rank the same number of sequences "
            f"(balance_batch with equal_size=True) so the common count never exceeds a rank's batch"
        )
    minimal = _search_minimal(values, cap)
    k = max(min_num_micro_batches, len(minimal))
    if k == len(minimal):
        return _ordered(values, minimal)
    # More micro-batches than needed: split the minimal plan (always feasible, cap kept) and compare it with
    # a direct search at k; keep the one with the lower maximum load.
    split = refine_partition(
        values, _fill_empty(values, minimal + [[] for _ in range(k - len(minimal))]), allow_moves=True
    )
    direct = _capped_partition(values, k, cap)
    if direct is not None and max(_load(values, p) for p in direct) < max(_load(values, p) for p in split):
        split = direct
    return _ordered(values, split)


def plan_token_micro_batches_for_ranks(
    per_rank_seq_lens: Sequence[Sequence[int]], max_tokens: int, *, min_num_micro_batches: int = 1
) -> list[list[list[int]]]:
    """Plan micro-batches for every DP rank with the SAME count on each rank.

    The count is the maximum over ranks of their minimal counts (and ``min_num_micro_batches``), so each
    rank issues the same number of forward/backward passes and its collectives line up.

    Args:
        per_rank_seq_lens: ``[world][n_r]`` valid-token counts per rank.
        max_tokens: hard per-micro-batch token budget.

    Returns:
        ``[world][k][...]`` indices into each rank's own ``seq_lens``.

    Raises:
        ValueError: as :func:`plan_token_micro_batches`, or a rank with fewer sequences than the common count.
    """
    counts = [minimal_num_micro_batches(lens, max_tokens) for lens in per_rank_seq_lens]
    k = max([min_num_micro_batches, *counts])
    for rank, lens in enumerate(per_rank_seq_lens):
        if len(lens) < k:
            raise ValueError(
                f"rank {rank} has {len(lens)} sequences but every rank needs {k} micro-batches "
                f"(minimal counts per rank: {counts}); give every rank the same number of sequences "
                f"(balance_batch with equal_size=True)"
            )
    return [plan_token_micro_batches(lens, max_tokens, min_num_micro_batches=k) for lens in per_rank_seq_lens]


def restore_order(
    outputs_per_micro: Sequence[torch.Tensor], micro_indices: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Put per-sequence outputs of micro-batches back in the original batch order (exact, no arithmetic).

    Args:
        outputs_per_micro: one tensor per micro-batch, ``[len(micro_indices[m]), ...]``, all with the same
            trailing shape (e.g. log-probs ``[b_m, T]`` padded to a common ``T``).
        micro_indices: the plan that produced the micro-batches; together a permutation of ``range(n)``.

    Returns:
        ``[n, ...]`` where row ``i`` is the output of original sequence ``i``.
    """
    if len(outputs_per_micro) != len(micro_indices):
        raise ValueError(
            f"got {len(outputs_per_micro)} output tensors for {len(micro_indices)} micro-batches"
        )
    flat: list[int] = []
    for m, (out, idx) in enumerate(zip(outputs_per_micro, micro_indices)):
        if out.shape[0] != len(idx):
            raise ValueError(f"micro-batch {m}: output has {out.shape[0]} rows but the plan lists {len(idx)}")
        flat.extend(int(i) for i in idx)
    n = len(flat)
    if sorted(flat) != list(range(n)):
        raise ValueError("micro_indices is not a permutation of range(n): an index is missing or repeated")
    if n == 0:
        raise ValueError("nothing to restore: micro_indices is empty")
    stacked = torch.cat(list(outputs_per_micro), dim=0)
    # stacked[j] belongs to original index flat[j]; invert the permutation and gather.
    inverse = torch.empty(n, dtype=torch.long)
    inverse[torch.tensor(flat, dtype=torch.long)] = torch.arange(n)
    return stacked.index_select(0, inverse.to(stacked.device))
