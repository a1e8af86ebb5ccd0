"""Balance sequences over data-parallel ranks (and the partition primitives the planners share).

Every DP rank runs the same number of optimizer steps, so the slowest rank sets the pace: the quantity to
minimise is the *largest* per-rank token load, reported as ``max / mean`` (1.0 is perfect).

Algorithm (deterministic, no randomness):

1. Build several candidate partitions:
   * Karmarkar–Karp largest differencing (the method verl uses); with ``equal_size`` the items are fed in
     groups of ``k`` consecutive sorted values so every set receives exactly one item per group.
   * LPT (longest processing time first): items in decreasing order, each to the least-loaded part that
     still has room (in item count when ``equal_size``).
2. Improve every candidate by local search (:func:`refine_partition`): repeatedly take the most loaded part
   and apply the single swap (or, without ``equal_size``, the single move) with any other part that lowers
   the larger of the two loads the most. Each accepted step strictly lowers the sum of squared loads, so the
   search terminates.
3. Keep the candidate with the smallest maximum load (ties: the first candidate, KK).

Because the KK candidate is only ever improved, the result is never worse than KK alone on the same input.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

__all__ = [
    "balance_batch",
    "karmarkar_karp_partition",
    "lpt_partition",
    "partition_stats",
    "refine_partition",
]


def _check_lengths(seq_lens: Sequence[int]) -> list[int]:
    values = [int(v) for v in seq_lens]
    for i, v in enumerate(values):
        if v < 0:
            raise ValueError(f"seq_lens[{i}] = {v} is negative; sequence lengths must be >= 0")
    return values


def karmarkar_karp_partition(values: Sequence[int], k: int, *, equal_size: bool) -> list[list[int]]:
    """Karmarkar–Karp largest differencing method for ``k``-way number partitioning.

    Each state is ``k`` sets kept in decreasing order of sum. The two states with the largest spread
    (max sum - min sum) are merged by pairing the largest set of one with the smallest set of the other,
    which cancels as much of both spreads as possible. With ``equal_size`` the initial states hold ``k``
    consecutive items of the sorted list, one per set, so all sets end with ``len(values) / k`` items.

    Args:
        values: item weights, ``[n]`` non-negative ints.
        k: number of parts, ``1 <= k``.
        equal_size: every part gets the same number of items (needs ``n % k == 0``).

    Returns:
        ``k`` lists of indices into ``values`` (some may be empty when ``n < k`` and not ``equal_size``).
    """
    n = len(values)
    if equal_size and n % k != 0:
        raise ValueError(f"equal_size needs len(values) divisible by k; got {n} items and k={k}")
    order = sorted(range(n), key=lambda i: (values[i], i))
    # A state: (sums, members) with sums in decreasing order. The heap key puts the largest spread first;
    # ties go to the state with the largest top set, then to the creation counter (stable, deterministic).
    heap: list[tuple[int, int, int, list[int], list[list[int]]]] = []
    counter = 0

    def push(sums: list[int], members: list[list[int]]) -> None:
        nonlocal counter
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], counter, sums, members))
        counter += 1

    if equal_size:
        for start in range(0, n, k):
            group = order[start : start + k]
            pairs = sorted(((values[i], i) for i in group), key=lambda p: (-p[0], p[1]))
            push([p[0] for p in pairs], [[p[1]] for p in pairs])
    else:
        for i in order:
            push([values[i]] + [0] * (k - 1), [[i]] + [[] for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, _, sums_a, mem_a = heapq.heappop(heap)
        _, _, _, sums_b, mem_b = heapq.heappop(heap)
        merged = [(sums_a[j] + sums_b[k - 1 - j], mem_a[j] + mem_b[k - 1 - j]) for j in range(k)]
        merged.sort(key=lambda p: -p[0])  # stable: equal sums keep their pairing order
        push([p[0] for p in merged], [p[1] for p in merged])
    return [list(m) for m in heap[0][4]]


def lpt_partition(
    values: Sequence[int], k: int, *, equal_size: bool = False, cap: int | None = None
) -> list[list[int]] | None:
    """Longest-processing-time-first: items in decreasing order, each to the least-loaded part.

    With ``equal_size`` a part that already holds ``n / k`` items is closed. With ``cap`` an item goes to the
    least-loaded part only if it fits there; since that part has the most room, no fit anywhere means the
    greedy failed and ``None`` is returned.
    """
    n = len(values)
    if equal_size and n % k != 0:
        raise ValueError(f"equal_size needs len(values) divisible by k; got {n} items and k={k}")
    per_part = n // k if equal_size else n
    heap = [(0, j) for j in range(k)]  # (load, part index): ties go to the lower index
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(n), key=lambda i: (-values[i], i)):
        load, j = heapq.heappop(heap)
        if cap is not None and load + values[i] > cap:
            return None
        parts[j].append(i)
        if len(parts[j]) < per_part:
            heapq.heappush(heap, (load + values[i], j))
    return parts


def refine_partition(
    values: Sequence[int], parts: list[list[int]], *, allow_moves: bool, max_steps: int | None = None
) -> list[list[int]]:
    """Local search that lowers the maximum part load; returns a new partition.

    Each step takes the most loaded part ``A`` (lowest index on ties) and considers every other part ``B``
    with a smaller load (gap ``g = load[A] - load[B]``). Moving an item of weight ``x`` from A to B, or
    swapping items ``a in A``, ``b in B`` with ``d = a - b``, helps only when ``0 < x (or d) < g``; the best
    choice is the one closest to ``g / 2``. The step with the lowest resulting ``max(load[A'], load[B'])``
    is applied. Both new loads stay below ``load[A]``, so a hard cap respected by ``A`` is respected after
    the step, and counts per part never change when ``allow_moves`` is False (swaps only).
    """
    parts = [list(p) for p in parts]
    loads = [sum(values[i] for i in p) for p in parts]
    k = len(parts)
    steps_left = max_steps if max_steps is not None else 50 * (len(values) + k)
    while steps_left > 0:
        steps_left -= 1
        a_idx = max(range(k), key=lambda j: (loads[j], -j))
        top = loads[a_idx]
        best: tuple[int, int, int, int, int] | None = None  # (new pair max, B, pos in A, pos in B or -1, d)
        a_items = parts[a_idx]
        for b_idx in range(k):
            gap = top - loads[b_idx]
            if b_idx == a_idx or gap <= 1:
                continue
            if allow_moves:
                for pa, ia in enumerate(a_items):
                    x = values[ia]
                    if 0 < x < gap:
                        new_max = max(top - x, loads[b_idx] + x)
                        cand = (new_max, b_idx, pa, -1, x)
                        if best is None or cand < best:
                            best = cand
            b_sorted = sorted((values[ib], pb) for pb, ib in enumerate(parts[b_idx]))
            b_vals = [v for v, _ in b_sorted]
            for pa, ia in enumerate(a_items):
                va = values[ia]
                # Ideal partner weight b = va - gap / 2; inspect the neighbours of that point.
                pos = bisect.bisect_left(b_vals, va - gap / 2)
                for q in (pos - 1, pos):
                    if 0 <= q < len(b_vals):
                        d = va - b_vals[q]
                        if 0 < d < gap:
                            new_max = max(top - d, loads[b_idx] + d)
                            cand = (new_max, b_idx, pa, b_sorted[q][1], d)
                            if best is None or cand < best:
                                best = cand
        if best is None:
            break
        _, b_idx, pa, pb, d = best
        ia = parts[a_idx][pa]
        if pb < 0:
            parts[a_idx].pop(pa)
            parts[b_idx].append(ia)
        else:
            parts[a_idx][pa], parts[b_idx][pb] = parts[b_idx][pb], parts[a_idx][pa]
        loads[a_idx] -= d
        loads[b_idx] += d
    return parts


def _max_load(values: Sequence[int], parts: list[list[int]]) -> int:
    return max((sum(values[i] for i in p) for p in parts), default=0)


def balance_batch(seq_lens: Sequence[int], k: int, *, equal_size: bool = True) -> list[list[int]]:
    """Spread sequences over ``k`` data-parallel ranks, minimising the largest per-rank token load.

    Args:
        seq_lens: ``[n]`` valid-token counts (prompt + response) of the global batch.
        k: number of DP ranks.
        equal_size: every rank gets exactly ``n / k`` sequences (what DP training needs: the same number of
            samples per rank keeps per-sample loss normalisation and collective calls aligned).

    Returns:
        ``k`` lists of indices into ``seq_lens``; indices are ascending inside each list, list ``r`` is
        what rank ``r`` processes.

    Raises:
        ValueError: ``k < 1``, a negative length, ``equal_size`` with ``n % k != 0``, or ``n < k``.
    """
    values = _check_lengths(seq_lens)
    n = len(values)
    if k < 1:
        raise ValueError(f"k (number of ranks) must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"cannot give each of k={k} ranks a sequence: only {n} sequences")
    if equal_size and n % k != 0:
        raise ValueError(
            f"equal_size=True needs the number of sequences ({n}) divisible by k={k}; "
            f"make the global batch a multiple of the DP size or pass equal_size=False"
        )
    starts = [karmarkar_karp_partition(values, k, equal_size=equal_size)]
    lpt = lpt_partition(values, k, equal_size=equal_size)
    if lpt is not None:
        starts.append(lpt)
    best: list[list[int]] | None = None
    best_max = 0
    for start in starts:
        refined = refine_partition(values, start, allow_moves=not equal_size)
        if not equal_size and any(not p for p in refined):
            continue  # every rank must receive work
        cur = _max_load(values, refined)
        if best is None or cur < best_max:
            best, best_max = refined, cur
    if best is None:  # only reachable without equal_size when every candidate left a rank empty
        best = [[i] for i in range(k)]
        for i in range(k, n):
            best[i % k].append(i)
    return [sorted(p) for p in best]


def partition_stats(seq_lens: Sequence[int], partitions: Sequence[Sequence[int]]) -> dict[str, float | int]:
    """Load statistics of a partition: ``max``, ``min``, ``mean`` token load, ``max_over_mean`` and ``count``
    (number of parts). ``max_over_mean`` is 1.0 for an empty workload."""
    loads = [sum(int(seq_lens[i]) for i in p) for p in partitions]
    count = len(loads)
    mean = sum(loads) / count if count else 0.0
    mx = max(loads, default=0)
    return {
        "max": float(mx),
        "min": float(min(loads, default=0)),
        "mean": float(mean),
        "max_over_mean": float(mx / mean) if mean > 0 else 1.0,
        "count": count,
    }
