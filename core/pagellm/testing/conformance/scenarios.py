"""The steps the attention cases run: small (a few dozen tokens, so Triton's interpreter takes
about a second) yet crossing blocks, with rows unsorted and mixed as the model runner mixes
them."""

from __future__ import annotations

from pagellm.testing.conformance.paged import Scenario

PREFILL = Scenario("prefill", [7, 19, 1], [[(0, 7), (1, 19), (2, 1)]])
"""Whole prompts without cached context (one of a single token)."""

DECODE = Scenario(
    "decode",
    [23, 36, 10],
    [[(0, 21), (1, 34), (2, 8)], [(0, 1), (1, 1), (2, 1)], [(2, 1), (0, 1), (1, 1)]],
)
"""Prompts, then two steps of one token per row over the context the backend wrote."""

CHUNKED_PREFILL = Scenario(
    "chunked prefill",
    [40, 11],
    [[(0, 16), (1, 9)], [(1, 1), (0, 16)], [(0, 8), (1, 1)]],
)
"""A 40-token prompt in chunks of 16, 16 and 8, each attending to the chunks before it in the
cache, next to a request that decodes."""

MIXED = Scenario("mixed batch", [21, 19], [[(0, 20), (1, 11)], [(1, 8), (0, 1)]])
"""A step of prompts, then one with a prompt's second chunk next to a decode: the cases that try
one declared value (or a head layout) run it."""


def shared_prefix(block_size: int) -> Scenario:
    """Two requests with the same first two blocks: the first writes them in the step in which
    the second, a prefix-cache hit on them, reads them for its remaining tokens."""
    first = 2 * block_size + 3
    return Scenario(
        "prefix blocks written and read in one step",
        [first + 1, 2 * block_size + 9],
        [[(0, first), (1, 8)], [(1, 1), (0, 1)]],
        shared_prefix={1: (0, 2)},
    )


GRAPH_DECODE = Scenario(
    "CUDA-graph decode",
    [22, 35, 11],
    [[(0, 19), (1, 32), (2, 8)], *[[(0, 1), (1, 1), (2, 1)]] * 2, [(2, 1), (1, 1), (0, 1)]],
)
"""Prompts (eager), two decode steps replayed from graph metadata, one more eager decode step
(which reads what the replays wrote and shows that their padding rows wrote nothing it reads)."""
