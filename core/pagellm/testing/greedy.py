"""Two greedy runs of the same prompts compared (two attention backends, CUDA graphs against
eager steps): where they part, the two picks must be a near-tie, not a wrong kernel.

Different kernels sum in different orders, so a token whose two most likely candidates are
within rounding of each other can go either way, and after it the sequences follow different
paths. A count of identical sequences says little of a small model whose top two are often that
close; this checks every position instead: up to the first token where the runs differ the
logprobs agree within ``tol``; at it each run's pick is the other's runner-up and within ``tol``
of it in both runs; after it nothing is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GreedyRun = tuple[Sequence[int], Sequence[dict[int, float]]]
"""One prompt's greedy tokens, and per position the logprobs of the two (or more) most likely
tokens, the pick among them (``SamplingParams(logprobs=2)``)."""


def greedy_run(completion: Any) -> tuple[list[int], list[dict[int, float]]]:
    """A `CompletionOutput` generated with ``logprobs=2`` as a `GreedyRun`."""
    tops = [{tok: lp[tok].logprob for tok in lp} for lp in completion.logprobs]
    return list(completion.token_ids), tops


def chosen_logprobs(run: GreedyRun) -> list[float]:
    """The logprob of each generated token of ``run``."""
    tokens, tops = run
    return [top[tok] for top, tok in zip(tops, tokens, strict=True)]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def count_identical_with_near_ties(
    runs_a: Sequence[GreedyRun], runs_b: Sequence[GreedyRun], tol: float, context: object
) -> int:
    """How many prompts the two runs generated alike; raises AssertionError (naming
    ``context``, the position and both runs' candidates) where they differ otherwise than by
    a near-tie."""
    identical = 0
    for (a_tokens, a_tops), (b_tokens, b_tops) in zip(runs_a, runs_b, strict=True):
        diverged = first_difference(a_tokens, b_tokens)
        end = len(a_tokens) if diverged is None else diverged
        for pos in range(end):
            tok = a_tokens[pos]
            gap = abs(a_tops[pos][tok] - b_tops[pos][tok])
            assert gap <= tol, (context, "logprobs apart", pos, a_tops[pos], b_tops[pos])
        if diverged is None:
            identical += 1
            continue
        a_tok, b_tok = a_tokens[diverged], b_tokens[diverged]
        a_at, b_at = a_tops[diverged], b_tops[diverged]
        tie = (context, "not a near-tie", diverged, a_tok, b_tok, a_at, b_at)
        assert b_tok in a_at and a_tok in b_at, tie  # each pick the other's runner-up
        assert a_at[a_tok] - a_at[b_tok] <= tol and b_at[b_tok] - b_at[a_tok] <= tol, tie
    return identical
