"""Sessions kept between the turns of multi-turn trajectories: which slot of the slot KV cache holds whose context.

After a turn, the trajectory's slot still holds the keys/values of its context (the request's ids and every token
sampled but the last, which was never fed back). :class:`SessionCache` keeps that slot for the request's
``session``, so that the next turn of the trajectory, whose ids extend that context, prefills only the new
suffix. A kept slot is evictable: when a request needs a slot and none is free, the least recently used session
gives its slot up (a trajectory waiting for its tools thus frees its slot for others) and is prefilled in full
when its next turn comes. Pure bookkeeping, no tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable
from dataclasses import dataclass


@dataclass
class CachedPrefix:
    """Positions ``[0, len(ids))`` of cache slot ``slot`` hold the keys/values of ``ids``."""

    slot: int
    ids: list[int]


def reusable_length(cached: list[int], ids: list[int]) -> int:
    """How many leading positions of ``cached`` a request for ``ids`` can reuse: their common prefix, leaving at
    least the last token of ``ids`` to compute (its logits give the first sampled token)."""
    limit = min(len(cached), len(ids) - 1)
    if cached[:limit] == ids[:limit]:  # the usual case: the new ids extend the cached ones
        return limit
    common = 0
    while common < limit and cached[common] == ids[common]:
        common += 1
    return common


class SessionCache:
    """Cached prefixes by session, least recently used first. ``generation`` is the cache allocation they belong
    to: a re-allocated cache (another shape, or freed and re-allocated) holds none of them."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, CachedPrefix] = OrderedDict()
        self.generation = -1

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: Hashable) -> bool:
        return session in self._entries

    def slots(self) -> set[int]:
        """The slots the cached sessions hold."""
        return {entry.slot for entry in self._entries.values()}

    def count_except(self, sessions: set[Hashable]) -> int:
        """How many cached sessions are not in ``sessions``."""
        return sum(1 for session in self._entries if session not in sessions)

    def sync(self, generation: int) -> None:
        """Forget every session if the cache was re-allocated since they were kept."""
        if generation != self.generation:
            self._entries.clear()
            self.generation = generation

    def peek(self, session: Hashable) -> CachedPrefix | None:
        return self._entries.get(session)

    def take(self, session: Hashable) -> CachedPrefix | None:
        """Remove and return ``session``'s entry (its request now runs in that slot)."""
        return self._entries.pop(session, None)

    def put(self, session: Hashable, slot: int, ids: list[int]) -> int | None:
        """Keep ``slot`` for ``session`` as its most recent entry; return the slot of an entry it replaced (two
        requests of one session in one call), which the caller frees."""
        old = self._entries.pop(session, None)
        self._entries[session] = CachedPrefix(slot=slot, ids=ids)
        return None if old is None or old.slot == slot else old.slot

    def evict(self, spare: Container[Hashable] | None = None) -> int | None:
        """Drop the least recently used session not in ``spare`` and return its slot (None when there is none)."""
        for session in self._entries:
            if spare is None or session not in spare:
                return self._entries.pop(session).slot
        return None

    def clear(self) -> None:
        self._entries.clear()
