"""`pagellm.testing.greedy`: two greedy runs may part only at a near-tie."""

from __future__ import annotations

import pytest

from pagellm.testing.greedy import count_identical_with_near_ties, first_difference


def run(tokens: list[int], tops: list[dict[int, float]]):
    return (tokens, tops)


SAME = run([5, 7, 9], [{5: -0.1, 6: -2.5}, {7: -0.3, 1: -1.9}, {9: -0.2, 3: -3.0}])


def test_identical_runs_count_and_small_drift_passes():
    drifted = run([5, 7, 9], [{5: -0.12, 6: -2.4}, {7: -0.28, 1: -1.9}, {9: -0.25, 3: -3.0}])
    assert count_identical_with_near_ties([SAME, SAME], [SAME, drifted], 0.1, "ctx") == 2


def test_a_near_tie_may_part_the_runs():
    # At position 1 run a picks 7 (runner-up 1), run b picks 1 (runner-up 7), each within 0.1.
    a = run([5, 7, 9], [{5: -0.1, 6: -2.5}, {7: -0.69, 1: -0.70}, {9: -0.2, 3: -3.0}])
    b = run([5, 1, 4], [{5: -0.1, 6: -2.5}, {1: -0.68, 7: -0.72}, {4: -0.1, 2: -4.0}])
    assert first_difference(a[0], b[0]) == 1
    assert count_identical_with_near_ties([a, SAME], [b, SAME], 0.1, "ctx") == 1


def test_parting_where_one_pick_leads_by_more_than_tol_fails():
    a = run([5, 7], [{5: -0.1, 6: -2.5}, {7: -0.2, 1: -1.5}])
    b = run([5, 1], [{5: -0.1, 6: -2.5}, {1: -0.6, 7: -0.65}])
    with pytest.raises(AssertionError, match="not a near-tie"):
        count_identical_with_near_ties([a], [b], 0.1, "ctx")


def test_parting_to_a_token_outside_the_other_runs_top_two_fails():
    a = run([5, 7], [{5: -0.1, 6: -2.5}, {7: -0.7, 1: -0.72}])
    b = run([5, 8], [{5: -0.1, 6: -2.5}, {8: -0.7, 1: -0.72}])
    with pytest.raises(AssertionError, match="not a near-tie"):
        count_identical_with_near_ties([a], [b], 0.1, "ctx")


def test_logprobs_apart_before_the_runs_part_fail():
    b = run([5, 7, 9], [{5: -0.1, 6: -2.5}, {7: -0.5, 1: -1.9}, {9: -0.2, 3: -3.0}])
    with pytest.raises(AssertionError, match="logprobs apart"):
        count_identical_with_near_ties([SAME], [b], 0.1, "ctx")


def test_a_completion_becomes_a_run_and_its_chosen_logprobs():
    from types import SimpleNamespace as NS

    from pagellm.testing.greedy import chosen_logprobs, greedy_run

    lp = lambda v: NS(logprob=v)  # noqa: E731
    completion = NS(
        token_ids=(5, 7), logprobs=[{5: lp(-0.1), 6: lp(-2.5)}, {7: lp(-0.3), 1: lp(-1.9)}]
    )
    run = greedy_run(completion)
    assert run == ([5, 7], [{5: -0.1, 6: -2.5}, {7: -0.3, 1: -1.9}])
    assert chosen_logprobs(run) == [-0.1, -0.3]
