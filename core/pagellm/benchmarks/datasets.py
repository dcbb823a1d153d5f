"""Benchmark workloads: random prompt token ids with seeded lengths (vLLM's "random" dataset)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    token_range: tuple[int, int] | None = None,
    exclude_ids: set[int] | None = None,
    input_len_range: tuple[int, int] | None = None,
    output_len_range: tuple[int, int] | None = None,
) -> list[BenchRequest]:
    """Lengths uniform in [len * (1 - ratio), len * (1 + ratio)], or in the inclusive
    ``*_len_range`` when given; token ids uniform in ``token_range`` (default: the whole
    vocabulary) minus ``exclude_ids`` (special tokens)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    for name, bounds in (("input", input_len_range), ("output", output_len_range)):
        if bounds is not None and not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"--{name}-len-range must satisfy 1 <= LOW <= HIGH, got {bounds}.")
    rng = np.random.default_rng(seed)
    low, high = token_range or (0, vocab_size)
    candidates = np.setdiff1d(
        np.arange(low, high), np.array(sorted(exclude_ids or ()), dtype=np.int64)
    )
    in_low, in_high = input_len_range or (
        int(input_len * (1 - range_ratio)),
        int(input_len * (1 + range_ratio)),
    )
    out_low, out_high = output_len_range or (
        int(output_len * (1 - range_ratio)),
        int(output_len * (1 + range_ratio)),
    )
    in_lens = rng.integers(in_low, in_high + 1, num_prompts)
    out_lens = rng.integers(out_low, out_high + 1, num_prompts)
    return [
        BenchRequest(rng.choice(candidates, size=max(int(n), 1)).tolist(), max(int(m), 1))
        for n, m in zip(in_lens, out_lens, strict=True)
    ]
