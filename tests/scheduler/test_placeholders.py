"""Output placeholders: the scheduler plans a step while the one before it is still running
(asynchronous scheduling), so requests whose last token is not known yet hold a placeholder for
it. Budgets, block allocation and length limits count it; the real token replaces it when the
step's output comes; a request preempted or finished meanwhile loses nothing and leaks nothing.
"""

from __future__ import annotations

import zlib
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.kv_cache.manager import cdiv
from pagellm.request import RequestStatus
from pagellm.scheduler.output import ModelRunnerOutput
from test_scheduler import _PHASES, SAMPLED, make_request, make_scheduler, num_free


def launch(scheduler):
    """Schedule a step; returns it with the requests that sample in it (those that got a
    placeholder), as the model runner would report them."""
    before = {r: q.num_output_placeholders for r, q in scheduler.requests.items()}
    out = scheduler.schedule()
    sampling = {
        r
        for r in out.num_scheduled_tokens
        if scheduler.requests[r].num_output_placeholders > before[r]
    }
    return out, sampling


def result(out, sampling, token=SAMPLED):
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=[[token] if r in sampling else [] for r in req_ids]
    )


def test_a_step_planned_before_the_last_one_returned_schedules_the_token_in_flight():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(6), max_tokens=8))
    first, sampling = launch(scheduler)
    request = scheduler.requests["a"]
    assert sampling == {"a"} and request.num_output_placeholders == 1
    # Step 2 planned while step 1 runs: one token, the one step 1 is sampling.
    second, sampling2 = launch(scheduler)
    assert second.num_scheduled_tokens == {"a": 1} and sampling2 == {"a"}
    assert second.scheduled_cached_reqs.num_computed_tokens == [6]
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 7
    scheduler.update_from_output(result(first, sampling, token=42))
    assert request.output_token_ids == [42] and request.num_output_placeholders == 1
    scheduler.update_from_output(result(second, sampling2, token=43))
    assert request.output_token_ids == [42, 43] and request.num_output_placeholders == 0


def test_a_prefill_chunk_that_does_not_reach_the_end_gets_no_placeholder():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", range(10)))
    _, sampling = launch(scheduler)
    assert sampling == set() and scheduler.requests["a"].num_output_placeholders == 0


def test_no_step_is_planned_past_max_tokens_while_the_last_token_is_in_flight():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("one", range(5), max_tokens=1))
    scheduler.add_request(make_request("two", range(5), max_tokens=2))
    first, sampling = launch(scheduler)
    second, sampling2 = launch(scheduler)
    # "one" gets its only token in step 1: step 2 does not run it.
    assert second.num_scheduled_tokens == {"two": 1}
    out = scheduler.update_from_output(result(first, sampling))
    assert [o.request_id for o in out.outputs if o.finish_reason is not None] == ["one"]
    third, _ = launch(scheduler)
    assert third.num_scheduled_tokens == {}  # "two"'s second token is in flight: its last
    scheduler.update_from_output(result(second, sampling2))
    assert not scheduler.has_unfinished_requests() and num_free(scheduler) == 63


def test_a_request_finished_by_the_step_in_flight_drops_the_step_planned_after_it():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5), max_tokens=8, eos_token_id=2))
    first, sampling = launch(scheduler)
    second, sampling2 = launch(scheduler)
    assert second.num_scheduled_tokens == {"a": 1}
    out = scheduler.update_from_output(result(first, sampling, token=2))  # the EOS
    assert out.outputs[0].finish_reason is not None and "a" not in scheduler.requests
    assert num_free(scheduler) == 63
    assert scheduler.update_from_output(result(second, sampling2)).outputs == []
    assert launch(scheduler)[0].finished_req_ids == {"a"}


def test_a_request_preempted_with_a_token_in_flight_keeps_it_and_resumes_whole():
    # 3 blocks of 4 tokens: "a" (7 prompt tokens) fills its second block in step 2 and needs
    # a third in step 3, which "b" (3 prompt tokens, one block) holds.
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", range(7), max_tokens=6))
    scheduler.add_request(make_request("b", range(10, 13), max_tokens=6))
    first, sampling = launch(scheduler)
    scheduler.update_from_output(result(first, sampling))
    second, sampling2 = launch(scheduler)
    third, sampling3 = launch(scheduler)  # planned while the second runs: "b" must yield
    assert third.preempted_req_ids == {"b"}
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    scheduler.update_from_output(result(second, sampling2, token=50))
    assert b.output_token_ids == [SAMPLED, 50] and b.num_output_placeholders == 0
    scheduler.update_from_output(result(third, sampling3))
    while scheduler.has_unfinished_requests():
        out, sampling = launch(scheduler)
        scheduler.update_from_output(result(out, sampling))
    assert num_free(scheduler) == 3


def test_a_preempted_request_whose_token_in_flight_ends_it_leaves_the_waiting_queue():
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", range(7), max_tokens=6))
    scheduler.add_request(make_request("b", range(10, 13), max_tokens=2))
    first, sampling = launch(scheduler)
    scheduler.update_from_output(result(first, sampling))
    second, sampling2 = launch(scheduler)
    third, _ = launch(scheduler)  # "b"'s last token is in flight: not run, but preempted
    assert third.preempted_req_ids == {"b"} and "b" not in third.num_scheduled_tokens
    out = scheduler.update_from_output(result(second, sampling2))
    ended = {o.request_id for o in out.outputs if o.finish_reason is not None}
    assert ended == {"b"} and "b" not in scheduler.requests and not len(scheduler.waiting)


def test_a_failed_step_clears_the_placeholders_it_gave():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5)))
    scheduler.add_request(make_request("b", range(8, 12)))
    out, _ = launch(scheduler)
    scheduler.fail_step(out)
    assert [r.num_output_placeholders for r in scheduler.quarantine] == [0, 0]
    probe, sampling = launch(scheduler)
    assert probe.num_scheduled_tokens == {"a": 5}  # its prompt again, alone
    scheduler.update_from_output(result(probe, sampling))
    assert scheduler.requests["a"].output_token_ids == [SAMPLED]


def fake_token(req_id: str, position: int, vocab: int) -> int:
    """What the fake model samples: a function of the request and the position alone, as a
    greedy model's token is of the tokens before it."""
    return zlib.crc32(f"{req_id}@{position}".encode()) % vocab  # 0: the EOS, now and then


def run_engine(cfg, adds, overlapped: bool):
    """Step a scheduler as the engine core does, with one step in flight when ``overlapped``;
    check the budgets and the blocks each step; return each request's tokens and status."""
    sched = make_scheduler(**{k: v for k, v in cfg.items() if k != "vocab"})
    kv = sched.kv_cache_manager
    requests, in_flight = {}, deque()
    pending = list(adds)
    for step in range(2000):
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            req_id = f"r{len(requests)}"
            requests[req_id] = make_request(req_id, prompt, max_tokens=max_tokens, eos_token_id=0)
            sched.add_request(requests[req_id])
        if not (pending or sched.has_unfinished_requests() or in_flight):
            break
        out, sampling = launch(sched)
        assert out.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            request = requests[req_id]
            in_flight_tokens = request.num_output_placeholders
            assert 0 <= in_flight_tokens <= (2 if overlapped else 1)
            assert request.num_computed_tokens <= request.num_tokens + in_flight_tokens
            # No step past the limits: the workers' rows hold max_model_len tokens.
            assert request.num_computed_tokens < cfg["max_model_len"]
            assert len(request.output_token_ids) + in_flight_tokens <= request.max_tokens
            if req_id in sampling:  # the token it samples goes at the position just computed
                assert request.num_computed_tokens == request.num_tokens + in_flight_tokens - 1
                sampled[req_id] = fake_token(req_id, request.num_computed_tokens, cfg["vocab"])
        in_flight.append(
            ModelRunnerOutput(
                req_ids=list(out.num_scheduled_tokens),
                sampled_token_ids=[
                    [sampled[r]] if r in sampled else [] for r in out.num_scheduled_tokens
                ],
            )
        )
        keep = 1 if overlapped and out.total_num_scheduled_tokens else 0
        while len(in_flight) > keep:
            sched.update_from_output(in_flight.popleft())
        for request in sched.running:
            held = len(kv.req_to_blocks[request.request_id])
            assert held == cdiv(request.num_computed_tokens, cfg["block_size"])
    assert not sched.requests and kv.num_free_blocks == cfg["num_blocks"] - 1
    return {r: (q.output_token_ids, q.status) for r, q in requests.items()}


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4))
    max_model_len = draw(st.integers(4, 24))
    min_blocks = cdiv(max_model_len, block_size) + 1
    cfg = {
        "block_size": block_size,
        "num_blocks": draw(st.integers(min_blocks, min_blocks + 3)),  # preemption is common
        "max_model_len": max_model_len,
        "max_num_batched_tokens": draw(st.integers(1, 2 * max_model_len)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "enable_caching": draw(st.booleans()),
        "vocab": draw(st.integers(3, 30)),
    }
    prompt = st.lists(st.integers(1, 3), min_size=1, max_size=max_model_len - 1)
    add = st.tuples(st.integers(0, 12), prompt, st.one_of(st.none(), st.integers(1, 16)))
    adds = sorted(draw(st.lists(add, min_size=2, max_size=10)), key=lambda a: a[0])
    return cfg, adds


@settings(max_examples=150, deadline=None, derandomize=True, phases=_PHASES)
@given(workload=workloads())
def test_one_step_in_flight_gives_the_tokens_of_synchronous_steps_and_frees_every_block(workload):
    """Random arrivals, prompts sharing prefixes, a small cache (preemption), EOS and length
    limits: the same tokens and finish states with and without a step in flight."""
    cfg, adds = workload
    assert run_engine(cfg, adds, overlapped=True) == run_engine(cfg, adds, overlapped=False)
