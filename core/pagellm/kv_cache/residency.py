"""KV block residency, sampled (``--kv-cache-metrics``): how long a cached block lived, how long it
sat unused before its eviction, and the gaps between its prefix-cache hits, for vLLM's
``kv_block_*_seconds`` histograms.

A sampled fraction of the blocks handed out is followed from its allocation; it is *evicted* when
the pool hands it out again while it still held a cached prefix (a block never cached just goes
back). Times are the engine core's `time.monotonic()`.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable

import msgspec

_MAX_ACCESSES = 4
"""Prefix-cache hits remembered per block (the most recent ones give the reuse gaps)."""


class KVBlockEviction(msgspec.Struct, array_like=True):
    lifetime_s: float
    """From its allocation to its eviction."""
    idle_s: float
    """From its last use (allocation or prefix-cache hit) to its eviction."""
    reuse_gaps_s: list[float]
    """Between its last few prefix-cache hits."""


class _Followed:
    __slots__ = ("born", "last_use", "hits")

    def __init__(self, now: float) -> None:
        self.born = self.last_use = now
        self.hits: deque[float] = deque(maxlen=_MAX_ACCESSES)


class KVBlockResidency:
    """The block pool calls `reallocated` for each block it hands out, `hit` for each prefix-cache
    hit and `reset` when its cache is emptied; the engine core takes the evictions with each
    step's stats (`take_evictions`)."""

    def __init__(
        self,
        sample_rate: float,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.sample_rate = sample_rate
        self._clock = clock
        self._draw = draw
        self._followed: dict[int, _Followed] = {}
        self._evictions: list[KVBlockEviction] = []

    def reallocated(self, block_id: int, was_cached: bool) -> None:
        """The pool hands the block out (again): the end of its previous content, an eviction if
        that was cached; then it may be followed anew."""
        now = self._clock()
        followed = self._followed.pop(block_id, None)
        if followed is not None and was_cached:
            hits = list(followed.hits)
            self._evictions.append(
                KVBlockEviction(
                    lifetime_s=now - followed.born,
                    idle_s=now - followed.last_use,
                    reuse_gaps_s=[b - a for a, b in zip(hits, hits[1:], strict=False)],
                )
            )
        if self._draw() < self.sample_rate:
            self._followed[block_id] = _Followed(now)

    def hit(self, block_id: int) -> None:
        """A request found the block in the prefix cache."""
        followed = self._followed.get(block_id)
        if followed is not None:
            followed.last_use = now = self._clock()
            followed.hits.append(now)

    def reset(self) -> None:
        """The prefix cache was emptied: no block holds a cached prefix any more."""
        self._followed.clear()

    def take_evictions(self) -> list[KVBlockEviction]:
        evictions, self._evictions = self._evictions, []
        return evictions
