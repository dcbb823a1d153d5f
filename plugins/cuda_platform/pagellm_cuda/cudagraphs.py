"""Which decode batch sizes get a captured CUDA graph.

A decode-only batch of ``n`` requests is padded up to the next captured size and replays that
graph, so sizes are dense where batches are small (each padding row is wasted work) and sparser
where they are large (each graph costs capture time and memory).
"""

from __future__ import annotations

MAX_CAPTURE_SIZE = 512
"""Decode batches above this many requests run eagerly: launch overhead no longer dominates."""


def cudagraph_capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 256 and of 16 up to ``limit``; none above
    ``max_num_seqs`` (no batch is larger), and ``max_num_seqs`` itself when it is within ``limit``
    so a full batch needs no padding. Sorted, unique."""
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, limit + 1, 16)]
    sizes = {s for s in ladder if s <= min(max_num_seqs, limit)}
    if max_num_seqs <= limit:
        sizes.add(max_num_seqs)
    return sorted(sizes)
