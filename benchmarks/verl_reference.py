"""Benchmark-only reproduction of verl's sequence-length balancing, used as the baseline to compare against.

This re-implements the *behaviour* described by verl's ``seqlen_balancing`` module (Karmarkar–Karp largest
differencing with its tie-breaking, ``get_seqlen_balanced_partitions`` and the dynamic-batch split
``rearrange_micro_batches``) so posttrain's planners can be measured against it on identical inputs. It is
not used by the package.

What the baseline does for dynamic micro-batches: the count is fixed up front at
``min(n, ceil(total_tokens / max_token_len))`` and the sequences are then balanced over that many
micro-batches by Karmarkar–Karp, which knows nothing about the budget. When lengths do not pack well (for
example many sequences just over half the budget), some micro-batch receives more tokens than the budget.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import total_ordering

__all__ = ["verl_kk_partitions", "verl_rearrange_micro_batches", "verl_workload"]


@total_ordering
@dataclass
class _Set:
    total: int = 0
    items: list[tuple[int, int]] = field(default_factory=list)  # (index, value)

    def key(self) -> tuple[int, int, list[tuple[int, int]]]:
        # Sets order by sum, then by item count, then by their items.
        return (self.total, len(self.items), self.items)

    def __lt__(self, other: _Set) -> bool:
        return self.key() < other.key()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Set) and self.key() == other.key()


class _State:
    """``k`` sets in decreasing order; the heap pops the largest spread first, then the largest top set."""

    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for j, (idx, val) in enumerate(items):
            self.sets[j].items.append((idx, val))
            self.sets[j].total += val
        self.sets.sort(reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].total - self.sets[-1].total

    def merge(self, other: _State) -> None:
        for j in range(self.k):
            partner = other.sets[self.k - 1 - j]
            self.sets[j].items.extend(partner.items)
            self.sets[j].total += partner.total
        self.sets.sort(reverse=True)

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def verl_kk_partitions(seq_lens: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """verl-style Karmarkar–Karp partition into ``k`` parts (indices sorted inside each part)."""
    n = len(seq_lens)
    if n < k:
        raise ValueError(f"{n} items < {k} partitions")
    ordered = sorted((int(v), i) for i, v in enumerate(seq_lens))
    heap: list[_State] = []
    if equal_size:
        if n % k:
            raise ValueError(f"{n} % {k} != 0")
        for start in range(0, n, k):
            heapq.heappush(heap, _State([(i, v) for v, i in ordered[start : start + k]], k))
    else:
        for v, i in ordered:
            heapq.heappush(heap, _State([(i, v)], k))
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    return [sorted(i for i, _ in s.items) for s in heap[0].sets]


def verl_workload(seq_len: int) -> int:
    """verl's attention-aware cost model for a sequence (calibrated for a 7B model)."""
    return 24576 * seq_len + seq_len * seq_len


def verl_rearrange_micro_batches(
    seq_lens: Sequence[int], max_token_len: int, *, use_workload: bool = True
) -> list[list[int]]:
    """verl-style dynamic micro-batches: count = ``min(n, ceil(total / max_token_len))``, then KK balance.

    Recent verl balances the workload model (``use_workload=True``); older releases balanced raw token
    counts. Neither checks the token budget after partitioning.
    """
    if max(seq_lens) > max_token_len:
        raise ValueError("max_token_len must be >= the longest sequence")
    total = sum(seq_lens)
    count = min(len(seq_lens), -(-total // max_token_len))
    weights = [verl_workload(v) for v in seq_lens] if use_workload else list(seq_lens)
    return verl_kk_partitions(weights, count, equal_size=False)
