"""`AsyncLLM` against a real engine-core process: outputs equal the in-process `LLM`'s under
concurrency, streaming, n > 1, stop strings, bad input, cancellation and aborts free the KV cache,
stats reach the stat loggers, and a killed engine fails every request promptly."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine import async_llm as async_llm_module
from pagellm.engine.args import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.errors import EngineDeadError
from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase
from pagellm.sampling_params import RequestOutputKind

PROMPTS = ["in the of and to", "is it that for the", "on with as at by and of", "a"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
ENGINE_KWARGS = dict(max_model_len=128, kv_cache_memory=8 << 20)


class RecordingStatLogger(StatLoggerBase):
    def __init__(self) -> None:
        super().__init__(model_name="tiny")
        self.records: list[tuple[SchedulerStats | None, IterationStats | None]] = []
        self.num_logs = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records.append((scheduler_stats, iteration_stats))

    def log(self) -> None:
        self.num_logs += 1


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama3"]


@pytest.fixture(scope="module")
def stat_logger():
    return RecordingStatLogger()


@pytest.fixture(scope="module")
def engine(model, stat_logger):
    llm = AsyncLLM.from_engine_args(EngineArgs(model, **ENGINE_KWARGS), [stat_logger])
    yield llm
    llm.shutdown()
    assert not os.path.exists(llm.core_client.ipc_dir)


@pytest.fixture(scope="module")
def reference(model):
    """The in-process `LLM`, for expected outputs."""
    return LLM(model, **ENGINE_KWARGS)


def with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    return msgspec.structs.replace(params, output_kind=kind)


async def collect(engine, prompt, params, request_id, priority=0):
    return [out async for out in engine.generate(prompt, params, request_id, priority)]


async def assert_all_blocks_free(engine) -> None:
    state = await engine.get_engine_state()
    assert state["num_running"] == state["num_waiting"] == 0
    assert state["num_free_blocks"] == state["num_total_blocks"] > 0


def test_concurrent_greedy_generations_equal_the_in_process_llm(engine, reference):
    prompts = PROMPTS * 5
    expected = reference.generate(prompts, GREEDY, use_tqdm=False)

    async def main():
        final = with_kind(GREEDY, RequestOutputKind.FINAL_ONLY)
        streams = await asyncio.gather(
            *(collect(engine, p, final, f"greedy-{i}") for i, p in enumerate(prompts))
        )
        await assert_all_blocks_free(engine)
        return streams

    streams = asyncio.run(main())
    for want, stream in zip(expected, streams, strict=True):
        assert len(stream) == 1 and stream[0].finished  # FINAL_ONLY: one output
        have = stream[0].outputs[0]
        assert have.token_ids == want.outputs[0].token_ids and have.text == want.outputs[0].text
        assert have.finish_reason == "length"


def test_streamed_deltas_concatenate_to_the_final_text(engine, reference):
    expected = reference.generate(PROMPTS[0], LONG, use_tqdm=False)[0].outputs[0]

    async def main():
        delta = await collect(engine, PROMPTS[0], with_kind(LONG, RequestOutputKind.DELTA), "d")
        cumulative = await collect(engine, PROMPTS[0], LONG, "c")
        return delta, cumulative

    delta, cumulative = asyncio.run(main())
    assert len(delta) > 1 and [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    assert "".join(o.outputs[0].text for o in delta) == expected.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == expected.token_ids
    # A consumer that falls behind gets the newest cumulative output (never an older one).
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert len(lengths) > 1 and lengths == sorted(set(lengths)) and lengths[-1] == 100
    for o in cumulative:
        have = o.outputs[0]
        assert have.token_ids == expected.token_ids[: len(have.token_ids)]
        assert expected.text.startswith(have.text)
    assert cumulative[-1].outputs[0].text == expected.text


def test_a_slow_consumer_gets_merged_deltas_that_add_up(engine, reference):
    """While the consumer sleeps, the step outputs that arrive are merged into one: fewer outputs
    than tokens, and texts, token ids, logprobs of every choice (n=2) still add up exactly."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2, logprobs=2)
    expected = reference.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs

    async def main():
        outputs = []
        stream = engine.generate(
            PROMPTS[1], with_kind(params, RequestOutputKind.DELTA), "slow-consumer"
        )
        async for out in stream:
            outputs.append(out)
            await asyncio.sleep(0.05)
        await assert_all_blocks_free(engine)
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert len(outputs) < 40  # merged: well under one output per step
    for want in expected:
        parts = [c for o in outputs for c in o.outputs if c.index == want.index]
        assert "".join(c.text for c in parts) == want.text
        assert sum((c.token_ids for c in parts), []) == want.token_ids
        logprobs = sum((c.logprobs for c in parts), [])
        assert len(logprobs) == 40
        for have_pos, want_pos in zip(logprobs, want.logprobs, strict=True):
            assert have_pos.keys() == want_pos.keys()
        assert parts[-1].finish_reason == "length"
        assert parts[-1].cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)


def test_stop_string_ends_the_stream_and_frees_the_engine_request(engine, reference):
    text = reference.generate(PROMPTS[1], LONG, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 4 : len(text) // 4 + 3]
    params = msgspec.structs.replace(LONG, stop=[stop], output_kind=RequestOutputKind.DELTA)
    expected = reference.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 100

    async def main():
        stream = await collect(engine, PROMPTS[1], params, "stop")
        # Without the front end's abort the engine would still be generating to max_tokens.
        await assert_all_blocks_free(engine)
        return stream

    stream = asyncio.run(main())
    assert "".join(o.outputs[0].text for o in stream) == expected.text
    assert stream[-1].outputs[0].finish_reason == "stop"
    assert stream[-1].outputs[0].stop_reason == stop


def test_n_completions_equal_the_in_process_llm(engine, reference):
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    expected = reference.generate(PROMPTS[2], params, use_tqdm=False)[0]

    async def main():
        return await collect(engine, PROMPTS[2], params, "n2")

    final = asyncio.run(main())[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in expected.outputs]
    assert final.outputs[0].token_ids != final.outputs[1].token_ids


def test_bad_request_raises_value_error_and_the_engine_keeps_serving(engine, reference):
    expected = reference.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, [5, 10**6], GREEDY, "bad-ids")
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, list(range(5, 200)), GREEDY, "too-long")
        with pytest.raises(ValueError, match="logit_bias"):
            await collect(engine, "a", SamplingParams(logit_bias={10**6: 1.0}), "bad-bias")
        good = engine.generate(PROMPTS[0], LONG, "dup")
        await good.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await collect(engine, PROMPTS[0], GREEDY, "dup")
        await good.aclose()
        fanned = engine.generate(PROMPTS[0], msgspec.structs.replace(LONG, n=2), "fan")
        await fanned.__anext__()
        with pytest.raises(ValueError, match="already running"):  # its engine requests' id
            await collect(engine, PROMPTS[0], GREEDY, "0_fan")
        await fanned.aclose()
        outputs = await collect(engine, PROMPTS[0], GREEDY, "after-bad")
        await assert_all_blocks_free(engine)
        return outputs

    assert asyncio.run(main())[-1].outputs[0].token_ids == expected
    assert not engine.errored


def test_cancelled_or_abandoned_consumers_abort_their_requests(engine, stat_logger):
    params = with_kind(
        SamplingParams(n=2, temperature=0.0, max_tokens=100, ignore_eos=True),
        RequestOutputKind.DELTA,
    )

    async def consume_forever(request_id: str, started: asyncio.Event) -> None:
        async for _ in engine.generate(PROMPTS[3], params, request_id):
            started.set()

    async def main():
        # 1. The consumer's task is cancelled mid-stream.
        started = asyncio.Event()
        task = asyncio.create_task(consume_forever("cancel-me", started))
        await started.wait()
        state = await engine.get_engine_state()
        assert state["num_running"] + state["num_waiting"] == 2  # one engine request each
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_all_blocks_free(engine)

        # 2. The consumer stops iterating and closes the generator (GeneratorExit).
        stream = engine.generate(PROMPTS[3], params, "leave-me")
        async for _ in stream:
            break
        await stream.aclose()
        await assert_all_blocks_free(engine)

        # 3. abort(): the stream ends with a finished output, and the stat loggers hear of both
        # aborted requests at once (not with some later step's outputs).
        stream = engine.generate(PROMPTS[3], params, "abort-me")
        await stream.__anext__()
        stat_logger.records.clear()
        await engine.abort("abort-me")
        aborted = [f for _, i in stat_logger.records for f in i.finished]
        assert [f.finish_reason for f in aborted] == ["abort", "abort"]
        # (A child may be aborted before its first token: the first output needs only one.)
        assert all(f.num_prompt_tokens > 0 and f.e2e_latency_s > 0 for f in aborted)
        rest = [out async for out in stream]
        assert rest[-1].finished
        assert {c.finish_reason for c in rest[-1].outputs} == {"abort"}
        await assert_all_blocks_free(engine)

    asyncio.run(main())


def test_stat_loggers_get_scheduler_and_iteration_stats(engine, stat_logger, monkeypatch):
    monkeypatch.setattr(async_llm_module, "_LOG_INTERVAL_S", 0.05)
    stat_logger.records.clear()

    async def main():
        await collect(engine, PROMPTS[0], GREEDY, "stats")
        await asyncio.sleep(0.3)

    asyncio.run(main())
    sched = [s for s, _ in stat_logger.records]
    iters = [i for _, i in stat_logger.records]
    assert all(s is not None and s.num_total_blocks > 0 for s in sched)
    assert [s.num_steps for s in sched] == sorted({s.num_steps for s in sched})  # one per step
    assert sum(i.num_generation_tokens for i in iters) == 8
    assert sum(len(i.ttfts_s) for i in iters) == 1 and sum(len(i.itls_s) for i in iters) == 7
    assert sum(i.num_prompt_tokens for i in iters) == 5
    (finished,) = [f for i in iters for f in i.finished]
    assert finished.finish_reason == "length" and finished.num_generation_tokens == 8
    assert finished.num_prompt_tokens == 5 and finished.mean_itl_s is not None
    assert 0 < finished.ttft_s <= finished.e2e_latency_s
    assert stat_logger.num_logs > 0


def test_health_prefix_cache_reset_and_state(engine):
    async def main():
        engine.check_health()
        long_prompt = " ".join([PROMPTS[0]] * 10)
        await collect(engine, long_prompt, GREEDY, "warm-cache")
        await collect(engine, long_prompt, GREEDY, "hit-cache")
        state = await engine.get_engine_state()
        assert state["prefix_cache_hit_rate"] > 0
        assert await engine.reset_prefix_cache() is True

    asyncio.run(main())
    assert engine.config.model.model and engine.tokenizer is not None


def test_a_cache_salt_in_the_prompt_keeps_prefix_cache_blocks_apart(engine):
    prompt = " ".join([PROMPTS[2]] * 8)

    async def main():
        outputs = [
            await collect(engine, {"prompt": prompt, "cache_salt": salt}, GREEDY, f"salt-{i}")
            for i, salt in enumerate("aba")
        ]
        return [o[-1].num_cached_tokens for o in outputs]

    first, other_salt, same_salt = asyncio.run(main())
    assert first == other_salt == 0 < same_salt


def test_priority_decides_which_waiting_request_runs_first(model):
    """The engine process is stopped while three requests reach it: when it goes on, the first
    (of the highest priority) runs, and the other two wait for it, one sequence at a time."""
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model, max_num_seqs=1, scheduling_policy="priority", **ENGINE_KWARGS)
    )
    finished: list[str] = []

    async def run(request_id: str, priority: int, params: SamplingParams) -> None:
        await collect(llm, PROMPTS[0], params, request_id, priority)
        finished.append(request_id)

    async def main():
        tasks = []
        os.kill(llm.core_client.proc.pid, signal.SIGSTOP)
        try:
            for request in [("first", -10, LONG), ("low", 5, GREEDY), ("high", -1, GREEDY)]:
                tasks.append(asyncio.create_task(run(*request)))
                await asyncio.sleep(0.05)  # each reaches the engine's queue in turn
        finally:
            os.kill(llm.core_client.proc.pid, signal.SIGCONT)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert finished == ["first", "high", "low"]


def test_killed_engine_fails_in_flight_requests_and_health(model):
    llm = AsyncLLM.from_engine_args(EngineArgs(model, max_model_len=512, kv_cache_memory=8 << 20))
    params = with_kind(
        SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True), RequestOutputKind.DELTA
    )

    async def consume(request_id: str, first: asyncio.Event) -> int:
        count = 0
        async for _ in llm.generate("a", params, request_id):
            count += 1
            first.set()
        return count

    async def main():
        first = asyncio.Event()
        tasks = [asyncio.create_task(consume(f"k{i}", first)) for i in range(4)]
        await first.wait()
        os.kill(llm.core_client.proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert llm.errored
        with pytest.raises(EngineDeadError):
            llm.check_health()
        with pytest.raises(EngineDeadError):
            await collect(llm, "a", GREEDY, "after-death")
        with pytest.raises(EngineDeadError):
            await llm.get_engine_state()

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert not os.path.exists(llm.core_client.ipc_dir)


def test_a_failing_stat_logger_is_logged_and_requests_go_on(engine, caplog):
    class Broken(StatLoggerBase):
        def record(self, scheduler_stats, iteration_stats) -> None:
            raise RuntimeError("broken stat logger")

        def log(self) -> None:
            pass

    engine.stat_loggers.append(Broken(model_name="tiny"))
    try:
        outputs = asyncio.run(collect(engine, PROMPTS[2], GREEDY, "broken-logger"))
    finally:
        engine.stat_loggers.pop()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8
    assert not engine.errored
    assert "Stat logger Broken failed" in caplog.text


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_completion_ending_before_its_sibling_is_reported_once_when_it_ends(kind):
    """The stats the front end hands its stat loggers, from a real `OutputProcessor` fed the
    engine outputs of an n=2 request whose completions end two steps apart."""
    from pagellm.engine.output_processor import OutputProcessor
    from pagellm.engine.processor import ProcessedPrompt, fan_out
    from pagellm.engine.request_timing import RequestTimings
    from pagellm.request import FinishReason
    from pagellm.scheduler.output import EngineCoreOutput, EngineCoreOutputs

    params = SamplingParams(n=2, max_tokens=4, output_kind=kind)
    processor, timings = OutputProcessor(None), RequestTimings()
    engine_requests = fan_out("r", params)
    processor.add_request("r", ProcessedPrompt(None, [5, 6, 7], params), engine_requests)
    engine_ids = [engine_id for engine_id, _ in engine_requests]
    timings.start("r", engine_ids, num_prompt_tokens=3, max_tokens=4, arrival=time.monotonic())
    length = int(FinishReason.LENGTH)
    steps = [
        [EngineCoreOutput("0_r", [11]), EngineCoreOutput("1_r", [12])],
        [EngineCoreOutput("0_r", [13], finish_reason=length), EngineCoreOutput("1_r", [14])],
        [EngineCoreOutput("1_r", [15])],
        [EngineCoreOutput("1_r", [16], finish_reason=length)],
    ]
    finished_per_step, user_requests_per_step = [], []
    for step in steps:
        outputs = EngineCoreOutputs(outputs=step, timestamp=time.monotonic())
        results, _ = processor.process_outputs(outputs)
        stats = timings.step(outputs, results)
        finished_per_step.append(
            [(f.finish_reason, f.num_generation_tokens) for f in stats.finished]
        )
        user_requests_per_step.append(
            [(u.n, u.max_num_generation_tokens) for u in stats.finished_user_requests]
        )
    assert finished_per_step == [[], [("length", 2)], [], [("length", 4)]]
    # The user request is reported once, when its last completion ends.
    assert user_requests_per_step == [[], [], [], [(2, 4)]]
    assert timings.abort("r") is None  # nothing left behind


def test_a_shutdown_from_the_running_loop_is_not_logged_as_the_engine_dying(
    model, caplog, monkeypatch
):
    """`shutdown_async` (the API server's on SIGTERM) while the output task still watches the
    process: its exit is the one asked for, so no error is logged, and a request after it is
    refused with the shutdown's own error. The output task is made to see the exit first (no
    drain wait; `shutdown_async` polls the exit code slowly), the order that logged the exit as
    a death when the server's loop was busy."""
    from pagellm.engine import async_core_client

    real_sleep = asyncio.sleep

    class SlowPolls:  # `asyncio` as the client module sees it, its sleeps at least 0.5 s
        def __getattr__(self, name):
            return getattr(asyncio, name)

        @staticmethod
        async def sleep(delay):
            await real_sleep(max(delay, 0.5))

    monkeypatch.setattr(async_core_client, "DRAIN_MS", 0)
    monkeypatch.setattr(async_core_client, "asyncio", SlowPolls())
    llm = AsyncLLM.from_engine_args(EngineArgs(model, **ENGINE_KWARGS))

    async def main():
        await collect(llm, "a", GREEDY, "before")
        await llm.shutdown_async(timeout=10)
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(llm, "a", GREEDY, "after")

    with caplog.at_level("INFO", logger="pagellm"):
        asyncio.run(main())
    assert llm.core_client.proc.exitcode == 0
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [], errors
    assert not os.path.exists(llm.core_client.ipc_dir)
