"""Benchmark workloads: random prompt token ids with seeded lengths (vLLM's "random" dataset), and
what `bench throughput` and `bench serve` share: the workload's flags, its record, the JSON output."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(
    num_prompts: int,
    input_lens: tuple[int, int],
    output_lens: tuple[int, int],
    vocab_size: int,
    seed: int,
    token_range: tuple[int, int] | None = None,
    exclude_ids: set[int] | None = None,
) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the inclusive ranges ``input_lens`` and
    ``output_lens``; token ids uniform in ``token_range`` (default: the whole vocabulary) minus
    ``exclude_ids`` (special tokens)."""
    rng = np.random.default_rng(seed)
    low, high = token_range or (0, vocab_size)
    candidates = np.setdiff1d(
        np.arange(low, high), np.array(sorted(exclude_ids or ()), dtype=np.int64)
    )
    in_lens = rng.integers(input_lens[0], input_lens[1] + 1, num_prompts)
    out_lens = rng.integers(output_lens[0], output_lens[1] + 1, num_prompts)
    return [
        BenchRequest(rng.choice(candidates, size=max(int(n), 1)).tolist(), max(int(m), 1))
        for n, m in zip(in_lens, out_lens, strict=True)
    ]


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The flags `bench throughput` and `bench serve` share: the random workload's, its sampling
    temperature, and where to write the result."""
    parser.add_argument("--dataset", choices=["random"], default="random")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=1.0)
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
        "--output-json", default=None, help="Also write the result JSON to this file."
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


def length_ranges(args: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int]]:
    """The prompt and output length ranges the flags ask for: ``--*-len-range``, else
    [len * (1 - ratio), len * (1 + ratio)] around ``--*-len``."""
    ratio = args.random_range_ratio
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}.")
    ranges = []
    for name in ("input", "output"):
        bounds = getattr(args, f"{name}_len_range")
        if bounds is None:
            length = getattr(args, f"{name}_len")
            bounds = (int(length * (1 - ratio)), int(length * (1 + ratio)))
        elif not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(
                f"--{name}-len-range must satisfy 1 <= LOW <= HIGH, got {tuple(bounds)}."
            )
        ranges.append((bounds[0], bounds[1]))
    return ranges[0], ranges[1]


def requests_from_args(
    args: argparse.Namespace, vocab_size: int, exclude_ids: set[int]
) -> list[BenchRequest]:
    """`random_requests` with the flags of `add_dataset_args` (and ``--seed``)."""
    token_range = args.random_token_range
    return random_requests(
        args.num_prompts,
        *length_ranges(args),
        vocab_size,
        args.seed,
        (token_range[0], token_range[1]) if token_range else None,
        exclude_ids,
    )


def dataset_record(args: argparse.Namespace) -> dict[str, Any]:
    """The flags `requests_from_args` reads, as the result JSON's workload records them."""
    names = "dataset num_prompts input_len output_len input_len_range output_len_range"
    return {
        name: getattr(args, name)
        for name in (*names.split(), "random_range_ratio", "seed", "temperature")
    }


def print_result(result: dict[str, Any], output_json: str | None) -> None:
    """Print the result JSON (for people and scripts alike); also write it to ``output_json``."""
    text = json.dumps(result, indent=2)
    print(text)
    if output_json:
        with open(output_json, "w") as f:
            f.write(text + "\n")
