"""The kernels FA4 compiles on first use, logged with the time they took.

FA4 keeps each compiled kernel variant in in-memory caches (one per entry point); a call that
adds entries compiled them, or loaded them from its on-disk cache (which then does not grow).
The host-side time of that call is the compile (or load) time: the launch itself is
asynchronous. Counting entries costs two attribute reads per call, and nothing in a graph replay.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The functions of flash_attn.cute.interface whose compile caches a forward pass can fill.
_COMPILING_FUNCTIONS = (
    "_flash_attn_fwd",
    "_flash_attn_fwd_combine",
    "_get_scheduler_metadata",
    "_compute_tile_cumsum",
    "_compute_blocks_to_batch",
)


class JitLog:
    def __init__(self, interface: Any, cache_dir: Path | None) -> None:
        self._caches: list[dict[Any, Any]] = []
        for function in _COMPILING_FUNCTIONS:
            cache = getattr(getattr(interface, function, None), "compile_cache", None)
            if isinstance(getattr(cache, "cache", None), dict):
                self._caches.append(cache.cache)  # type: ignore[union-attr]
        self.cache_dir = cache_dir
        self._on_disk = self._count_on_disk()
        self.compiled = 0
        self.loaded = 0
        self.seconds = 0.0

    def entries(self) -> int:
        return sum(len(cache) for cache in self._caches)

    def _count_on_disk(self) -> int:
        if self.cache_dir is None or not self.cache_dir.is_dir():
            return 0
        return sum(1 for _ in self.cache_dir.rglob("*.o"))

    def after_call(self, entries_before: int, started: float, what: str) -> None:
        """Log the kernels the call that began at ``started`` (``time.perf_counter()``, when
        there were ``entries_before`` entries) compiled or loaded."""
        new = self.entries() - entries_before
        if new <= 0:
            return
        seconds = time.perf_counter() - started
        self.seconds += seconds
        on_disk = self._count_on_disk()
        compiled = min(new, max(0, on_disk - self._on_disk)) if self.cache_dir else new
        self._on_disk = on_disk
        self.compiled += compiled
        self.loaded += new - compiled
        how = "compiled" if compiled else f"loaded from the JIT cache {self.cache_dir}"
        logger.info(
            "FLASH_ATTN: FA4 %s %d kernel(s) for %s in %.2f s (%d compiled, %d loaded so far, "
            "%.1f s in all)",
            how,
            new,
            what,
            seconds,
            self.compiled,
            self.loaded,
            self.seconds,
        )
