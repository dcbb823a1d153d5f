"""Benchmark workloads: random prompt token ids with seeded lengths (vLLM's "random" dataset)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

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


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The random workload's flags, shared by `bench throughput` and `bench serve`."""
    parser.add_argument("--dataset", choices=["random"], default="random")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    for name, what in (("input", "Prompt"), ("output", "Output")):
        parser.add_argument(
            f"--{name}-len-range",
            type=int,
            nargs=2,
            default=None,
            metavar=("LOW", "HIGH"),
            help=f"{what} lengths uniform in [LOW, HIGH] "
            f"(overrides --{name}-len/--random-range-ratio).",
        )
    parser.add_argument(
        "--random-token-range",
        type=int,
        nargs=2,
        default=None,
        metavar=("LOW", "HIGH"),
        help="Draw prompt token ids from [LOW, HIGH) instead of the whole vocabulary (needed when "
        "the model's vocabulary is smaller than its tokenizer's).",
    )


def requests_from_args(
    args: argparse.Namespace, vocab_size: int, exclude_ids: set[int]
) -> list[BenchRequest]:
    """`random_requests` with the flags of `add_dataset_args` (and ``--seed``)."""
    return random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.random_range_ratio,
        vocab_size,
        args.seed,
        tuple(args.random_token_range) if args.random_token_range else None,
        exclude_ids,
        tuple(args.input_len_range) if args.input_len_range else None,
        tuple(args.output_len_range) if args.output_len_range else None,
    )


def dataset_record(args: argparse.Namespace) -> dict[str, Any]:
    """The flags `requests_from_args` reads, as the result JSON's workload records them."""
    names = "dataset num_prompts input_len output_len input_len_range output_len_range"
    return {name: getattr(args, name) for name in (*names.split(), "random_range_ratio", "seed")}
