"""The built-in stat loggers fed with stats sequences as the front end makes them: the Prometheus
text exposition (parsed with prometheus_client's own parser) and the periodic log line; and
`build_stat_loggers` with plugin loggers from the registry. Then the whole path on a real engine
(`AsyncLLM` on a tiny Llama, its engine core in its own process): the Prometheus metrics move by
what the requests did (tokens, steps, prefix-cache hits, a preemption, n and max_tokens)."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagellm.engine.args import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.metrics.loggers import LoggingStatLogger, build_stat_loggers
from pagellm.metrics.prometheus import PrometheusStatLogger, metrics_response
from pagellm.metrics.registry import stat_loggers
from pagellm.metrics.stats import (
    FinishedRequestStats,
    FinishedUserRequestStats,
    IterationStats,
    SchedulerStats,
)
from pagellm.plugins import PluginError
from pagellm.sampling_params import SamplingParams

DUMMY_FRONTEND = Path(__file__).parents[1] / "plugins" / "dummy_frontend"


def finished(reason: str, prompt: int, generated: int, e2e: float) -> FinishedRequestStats:
    return FinishedRequestStats(reason, e2e, prompt, generated, ttft_s=0.1, mean_itl_s=0.01)


# Two steps of an engine: cumulative scheduler counters, per-batch iteration stats.
STEPS = [
    (
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=1,
            kv_cache_usage=0.25,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            num_preemptions=1,
        ),
        IterationStats(num_prompt_tokens=30, num_generation_tokens=2, ttfts_s=[0.1, 0.3]),
    ),
    (
        SchedulerStats(
            num_running_reqs=1,
            num_waiting_reqs=0,
            kv_cache_usage=0.5,
            prefix_cache_queries=160,
            prefix_cache_hits=70,
            num_preemptions=3,
        ),
        IterationStats(
            num_generation_tokens=2,
            itls_s=[0.01, 0.03],
            finished=[finished("length", 20, 5, 1.5), finished("stop", 10, 3, 0.5)],
        ),
    ),
]


def exposition(stat_logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels without model_name): value}, checking model_name."""
    body, content_type = metrics_response(stat_logger)
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            assert s.labels.pop("model_name") == stat_logger.model_name, s
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_prometheus_counters_gauges_and_histograms_follow_the_recorded_stats():
    stat_logger = PrometheusStatLogger(model_name="tiny")
    for scheduler_stats, iteration_stats in STEPS:
        stat_logger.record(scheduler_stats, iteration_stats)
    stat_logger.record(None, IterationStats(finished=[finished("abort", 7, 0, 0.2)]))
    m = exposition(stat_logger)

    assert m[("pagellm:num_requests_running", ())] == 1
    assert m[("pagellm:num_requests_waiting", ())] == 0
    assert m[("pagellm:kv_cache_usage_perc", ())] == 0.5
    assert m[("pagellm:prompt_tokens_total", ())] == 30
    assert m[("pagellm:generation_tokens_total", ())] == 4
    # Cumulative scheduler counters are counted once, not summed over records.
    assert m[("pagellm:prefix_cache_queries_total", ())] == 160
    assert m[("pagellm:prefix_cache_hits_total", ())] == 70
    assert m[("pagellm:num_preemptions_total", ())] == 3
    for reason in ("length", "stop", "abort"):
        assert m[("pagellm:request_success_total", (("finished_reason", reason),))] == 1
    ttft = "pagellm:time_to_first_token_seconds"
    assert m[(f"{ttft}_count", ())] == 2
    assert m[(f"{ttft}_sum", ())] == pytest.approx(0.4)
    assert m[(f"{ttft}_bucket", (("le", "0.25"),))] == 1
    assert m[(f"{ttft}_bucket", (("le", "+Inf"),))] == 2
    assert m[("pagellm:inter_token_latency_seconds_count", ())] == 2
    assert m[("pagellm:inter_token_latency_seconds_sum", ())] == pytest.approx(0.04)
    assert m[("pagellm:e2e_request_latency_seconds_count", ())] == 3
    assert m[("pagellm:e2e_request_latency_seconds_sum", ())] == pytest.approx(2.2)
    assert m[("pagellm:request_prompt_tokens_sum", ())] == 37
    assert m[("pagellm:request_generation_tokens_sum", ())] == 8
    assert m[("pagellm:request_generation_tokens_bucket", (("le", "2.0"),))] == 1


def test_prometheus_counter_restarts_from_zero_when_the_engine_counters_go_back():
    stat_logger = PrometheusStatLogger(model_name="m")
    stat_logger.record(SchedulerStats(prefix_cache_queries=50, num_preemptions=4), None)
    # A restarted engine core reports its counters from zero again.
    stat_logger.record(SchedulerStats(prefix_cache_queries=10, num_preemptions=1), None)
    stat_logger.record(SchedulerStats(prefix_cache_queries=15, num_preemptions=1), None)
    m = exposition(stat_logger)
    assert m[("pagellm:prefix_cache_queries_total", ())] == 65
    assert m[("pagellm:num_preemptions_total", ())] == 5


def test_prometheus_loggers_in_one_process_keep_separate_registries():
    first, second = PrometheusStatLogger("a"), PrometheusStatLogger("b")
    first.record(None, IterationStats(num_generation_tokens=5))
    assert exposition(first)[("pagellm:generation_tokens_total", ())] == 5
    assert exposition(second)[("pagellm:generation_tokens_total", ())] == 0
    # Every metric is exposed before anything is recorded.
    names = {name for name, _ in exposition(second)}
    assert {
        "pagellm:num_requests_running",
        "pagellm:num_preemptions_total",
        "pagellm:request_success_total",
        "pagellm:e2e_request_latency_seconds_count",
        "pagellm:request_prompt_tokens_count",
    } <= names


def test_prometheus_request_phases_parameters_and_prompt_sources_follow_the_stats():
    stat_logger = PrometheusStatLogger(model_name="tiny")
    complete = FinishedRequestStats(
        "length", 2.0, 40, 5, ttft_s=0.5, mean_itl_s=0.25, num_cached_tokens=32, max_tokens=5,
        queue_time_s=0.125, prefill_time_s=0.25, decode_time_s=1.0, inference_time_s=1.25,
    )  # fmt: skip
    # Aborted while waiting: no engine-side interval, no time per output token.
    waited = FinishedRequestStats("abort", 0.5, 7, 0, ttft_s=None, mean_itl_s=None)
    stat_logger.record(
        SchedulerStats(
            num_waiting_reqs=2, num_deferred_reqs=1, num_steps=1, num_scheduled_tokens=9
        ),
        IterationStats(
            num_prompt_tokens=47,
            num_cached_prompt_tokens=32,
            finished=[complete, waited],
            finished_user_requests=[FinishedUserRequestStats(n=2, max_num_generation_tokens=5)],
        ),
    )
    # Stats sent without a step (after an abort) do not count the last step again.
    stat_logger.record(SchedulerStats(num_steps=1, num_scheduled_tokens=9), None)
    stat_logger.record(SchedulerStats(num_steps=2, num_scheduled_tokens=300), None)
    m = exposition(stat_logger)

    assert m[("pagellm:num_requests_waiting", ())] == 0
    assert m[("pagellm:iteration_tokens_total_count", ())] == 2
    assert m[("pagellm:iteration_tokens_total_sum", ())] == 309
    assert m[("pagellm:iteration_tokens_total_bucket", (("le", "16.0"),))] == 1
    source = "pagellm:prompt_tokens_by_source_total"
    assert m[(source, (("source", "local_compute"),))] == 15
    assert m[(source, (("source", "local_cache_hit"),))] == 32
    assert m[(source, (("source", "external_kv_transfer"),))] == 0
    assert m[("pagellm:prompt_tokens_cached_total", ())] == 32
    assert m[("pagellm:request_prefill_kv_computed_tokens_sum", ())] == 8 + 7
    assert m[("pagellm:request_params_max_tokens_count", ())] == 1  # the abort had none
    assert m[("pagellm:request_params_max_tokens_sum", ())] == 5
    assert m[("pagellm:request_params_n_count", ())] == 1
    assert m[("pagellm:request_params_n_sum", ())] == 2
    assert m[("pagellm:request_max_num_generation_tokens_sum", ())] == 5
    assert m[("pagellm:e2e_request_latency_seconds_count", ())] == 2
    for name, value in (
        ("request_time_per_output_token_seconds", 0.25),
        ("request_queue_time_seconds", 0.125),
        ("request_prefill_time_seconds", 0.25),
        ("request_decode_time_seconds", 1.0),
        ("request_inference_time_seconds", 1.25),
    ):
        assert m[(f"pagellm:{name}_count", ())] == 1, name
        assert m[(f"pagellm:{name}_sum", ())] == value, name

    stat_logger.record(SchedulerStats(num_waiting_reqs=2, num_deferred_reqs=1), None)
    m = exposition(stat_logger)
    assert m[("pagellm:num_requests_waiting", ())] == 3
    waiting = "pagellm:num_requests_waiting_by_reason"
    assert m[(waiting, (("reason", "capacity"),))] == 2
    assert m[(waiting, (("reason", "deferred"),))] == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


LINE = re.compile(
    r"Prompt throughput: (?P<prompt>[\d.]+) tokens/s, generation throughput: (?P<gen>[\d.]+) "
    r"tokens/s, running: (?P<running>\d+) reqs, waiting: (?P<waiting>\d+) reqs, KV cache usage: "
    r"(?P<kv>[\d.]+)%, prefix cache hit rate: (?P<hit>[\d.]+)%, preemptions: (?P<pre>\d+)$"
)


def logged_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "pagellm.metrics.loggers"]
    caplog.clear()
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    return [m.groupdict() for m in matches if m]


def test_log_line_reports_throughput_and_hit_rate_over_each_interval(caplog):
    caplog.set_level(logging.INFO, logger="pagellm.metrics.loggers")
    clock = FakeClock()
    stat_logger = LoggingStatLogger("tiny", clock=clock)
    stat_logger.record(*STEPS[0])
    clock.now += 2.0
    stat_logger.log()
    assert logged_lines(caplog) == [
        dict(prompt="15.0", gen="1.0", running="2", waiting="1", kv="25.0", hit="40.0", pre="1")
    ]
    stat_logger.record(*STEPS[1])
    stat_logger.record(None, IterationStats(num_generation_tokens=6))
    clock.now += 4.0
    stat_logger.log()
    # Interval: 60 queries, 30 hits, 2 preemptions, 8 generated tokens in 4 s.
    assert logged_lines(caplog) == [
        dict(prompt="0.0", gen="2.0", running="1", waiting="0", kv="50.0", hit="50.0", pre="2")
    ]


def test_idle_engine_is_logged_once_until_work_resumes(caplog):
    caplog.set_level(logging.INFO, logger="pagellm.metrics.loggers")
    clock = FakeClock()
    stat_logger = LoggingStatLogger("tiny", clock=clock)
    idle = SchedulerStats(prefix_cache_queries=8, prefix_cache_hits=8)
    stat_logger.record(idle, None)
    stat_logger.log()
    stat_logger.record(idle, None)
    stat_logger.log()
    assert len(logged_lines(caplog)) == 1
    stat_logger.record(SchedulerStats(num_waiting_reqs=1), IterationStats())
    clock.now += 1.0
    stat_logger.log()
    assert logged_lines(caplog)[0]["waiting"] == "1"


@pytest.fixture
def dummy_frontend_importable(monkeypatch):
    """The dummy front-end plugin's classes, importable without installing the package (the
    entry-point route through `pip install -e` is covered by tests/plugins/test_plugins.py)."""
    monkeypatch.syspath_prepend(str(DUMMY_FRONTEND))


def test_build_stat_loggers_adds_plugin_loggers_built_with_the_model_name(
    dummy_frontend_importable,
):
    stat_loggers.register(
        "test_collecting", "pagellm_dummy_frontend.processors:CollectingStatLogger"
    )
    loggers = build_stat_loggers("tiny", ["test_collecting"])
    assert [type(s).__name__ for s in loggers] == [
        "LoggingStatLogger",
        "PrometheusStatLogger",
        "CollectingStatLogger",
    ]
    assert {s.model_name for s in loggers} == {"tiny"}
    collecting = loggers[-1]
    for stats in STEPS:
        for s in loggers:
            s.record(*stats)
    assert collecting.records == STEPS  # type: ignore[attr-defined]
    assert [type(s).__name__ for s in build_stat_loggers("tiny", None)] == [
        "LoggingStatLogger",
        "PrometheusStatLogger",
    ]
    # --disable-log-stats: no periodic line; /metrics keeps its engine metrics.
    assert [type(s).__name__ for s in build_stat_loggers("tiny", None, log_stats=False)] == [
        "PrometheusStatLogger",
    ]


def test_build_stat_loggers_rejects_unknown_builtin_and_foreign_names(dummy_frontend_importable):
    with pytest.raises(ValueError, match="'nope' is not installed"):
        build_stat_loggers("tiny", ["nope"])
    with pytest.raises(ValueError, match="'prometheus' is built in and always on"):
        build_stat_loggers("tiny", ["prometheus"])
    stat_loggers.register(
        "test_not_a_logger", "pagellm_dummy_frontend.processors:UpperTextProcessor"
    )
    with pytest.raises(PluginError, match="is not a StatLoggerBase subclass"):
        stat_loggers.get("test_not_a_logger")


# ---------------------------------------------------------------------------- on a real engine

BLOCK_SIZE = 16
NUM_BLOCKS = 6  # the null block and 5 more: two 53-token completions (4 blocks each) cannot share
BYTES_PER_BLOCK = (
    2 * 2 * BLOCK_SIZE * 2 * 16 * 4
)  # layers × (K, V) × tokens × KV heads × head × fp32


@pytest.fixture(scope="module")
def served(tiny_models):
    """An `AsyncLLM` reporting to a `PrometheusStatLogger`, with a KV cache of six blocks, every
    one followed for the residency metrics."""
    prometheus = PrometheusStatLogger(model_name="tiny")
    args = EngineArgs(
        tiny_models["llama3"],
        max_model_len=64,
        block_size=BLOCK_SIZE,
        kv_cache_memory=NUM_BLOCKS * BYTES_PER_BLOCK,
        kv_cache_metrics=True,
        kv_cache_metrics_sample=1.0,
    )
    engine = AsyncLLM.from_engine_args(args, [prometheus])
    yield engine, prometheus
    engine.shutdown()


def run(engine: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str) -> None:
    async def main():
        async for _ in engine.generate(prompt, params, request_id):
            pass
        state = await engine.get_engine_state()
        assert state["num_free_blocks"] == state["num_total_blocks"]

    asyncio.run(main())


class Moves:
    """The samples of a `PrometheusStatLogger` before and after something: ``moves[name]`` is the
    change of an unlabelled sample, ``moves[name, label, value]`` of a labelled one."""

    def __init__(self, stat_logger: PrometheusStatLogger) -> None:
        self.stat_logger = stat_logger
        self.before = exposition(stat_logger)

    def __enter__(self) -> Moves:
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = exposition(self.stat_logger)

    def __getitem__(self, key: str | tuple[str, str, str]) -> float:
        name, labels = (key, ()) if isinstance(key, str) else (key[0], ((key[1], key[2]),))
        return self.after[(name, labels)] - self.before.get((name, labels), 0.0)


def test_cache_config_info_names_the_engines_kv_cache(served):
    _, prometheus = served
    [labels] = [dict(labels) for name, labels in exposition(prometheus) if "cache_config" in name]
    assert labels == {
        "block_size": "16",
        "cache_dtype": "float32",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "kv_cache_memory": str(NUM_BLOCKS * BYTES_PER_BLOCK),
        "num_gpu_blocks": str(NUM_BLOCKS),
    }


def test_an_n2_request_moves_each_metric_by_what_it_did(served):
    engine, prometheus = served
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    with Moves(prometheus) as moved:
        run(engine, [5, 6, 7, 8, 9], params, "n2")
    assert moved["pagellm:request_success_total", "finished_reason", "length"] == 2
    assert moved["pagellm:prompt_tokens_total"] == 10
    assert moved["pagellm:prompt_tokens_by_source_total", "source", "local_compute"] == 10
    assert moved["pagellm:prompt_tokens_cached_total"] == 0
    assert moved["pagellm:generation_tokens_total"] == 12
    # Each completion computes its 5 prompt tokens and 5 of its 6 tokens (the last is sampled,
    # never fed back); the two may start one step apart.
    assert moved["pagellm:iteration_tokens_total_sum"] == 20
    assert moved["pagellm:iteration_tokens_total_count"] in (6, 7)
    for histogram, count, total in (
        ("request_prompt_tokens", 2, 10),
        ("request_generation_tokens", 2, 12),
        ("request_prefill_kv_computed_tokens", 2, 10),
        ("request_params_max_tokens", 2, 12),
        ("request_params_n", 1, 2),
        ("request_max_num_generation_tokens", 1, 6),
    ):
        assert moved[f"pagellm:{histogram}_count"] == count, histogram
        assert moved[f"pagellm:{histogram}_sum"] == total, histogram
    assert moved["pagellm:time_to_first_token_seconds_count"] == 2
    assert moved["pagellm:inter_token_latency_seconds_count"] == 10
    for histogram in (
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    ):
        assert moved[f"pagellm:{histogram}_count"] == 2, histogram
    prefill, decode = (
        moved[f"pagellm:request_{p}_time_seconds_sum"] for p in ("prefill", "decode")
    )
    assert prefill > 0 and decode > 0
    assert moved["pagellm:request_inference_time_seconds_sum"] == pytest.approx(prefill + decode)
    # Five inter-token latencies per completion add up to its decode time.
    assert moved["pagellm:inter_token_latency_seconds_sum"] == pytest.approx(decode)
    assert moved["pagellm:request_time_per_output_token_seconds_sum"] == pytest.approx(decode / 5)
    assert moved["pagellm:e2e_request_latency_seconds_sum"] > prefill + decode
    assert moved["pagellm:num_preemptions_total"] == 0


def test_a_prompt_seen_before_is_counted_as_cached(served):
    engine, prometheus = served
    prompt = list(range(100, 140))  # 40 tokens: two full blocks can be found again
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    run(engine, prompt, params, "first")
    with Moves(prometheus) as moved:
        run(engine, prompt, params, "again")
    assert moved["pagellm:prefix_cache_queries_total"] == 40
    assert moved["pagellm:prefix_cache_hits_total"] == 32
    assert moved["pagellm:prompt_tokens_total"] == 40
    assert moved["pagellm:prompt_tokens_cached_total"] == 32
    assert moved["pagellm:prompt_tokens_by_source_total", "source", "local_cache_hit"] == 32
    assert moved["pagellm:prompt_tokens_by_source_total", "source", "local_compute"] == 8
    assert moved["pagellm:request_prefill_kv_computed_tokens_sum"] == 8
    assert moved["pagellm:iteration_tokens_total_sum"] == 8 + 1


def test_completions_too_long_to_share_the_kv_cache_are_preempted_and_counted(served):
    engine, prometheus = served
    params = SamplingParams(n=2, temperature=0.0, max_tokens=50, ignore_eos=True)
    with Moves(prometheus) as moved:
        run(engine, [5, 6, 7], params, "preempted")
    assert moved["pagellm:num_preemptions_total"] >= 1
    assert moved["pagellm:request_success_total", "finished_reason", "length"] == 2
    assert moved["pagellm:generation_tokens_total"] == 100
    # A preempted completion computes its tokens again, but for those its twin (greedy: the
    # same tokens) left in the prefix cache.
    assert moved["pagellm:iteration_tokens_total_sum"] >= 2 * (3 + 49)
    assert moved["pagellm:request_prefill_time_seconds_count"] == 2
    m = exposition(prometheus)
    assert m[("pagellm:num_requests_running", ())] == m[("pagellm:num_requests_waiting", ())] == 0
    assert m[("pagellm:kv_cache_usage_perc", ())] == 0


def test_an_evicted_cached_block_reports_its_residency(served):
    engine, prometheus = served
    assert asyncio.run(engine.reset_prefix_cache())
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(200, 240))  # two full blocks cached, found by the next two runs
    with Moves(prometheus) as moved:
        for i in range(3):
            run(engine, prompt, params, f"resident-{i}")
        # 62 tokens: four blocks, three free and never cached, then the oldest cached one.
        run(engine, list(range(300, 360)), params, "evicting")
    for name in ("lifetime", "idle_before_evict", "reuse_gap"):
        assert moved[f"pagellm:kv_block_{name}_seconds_count"] == 1, name
    lifetime = moved["pagellm:kv_block_lifetime_seconds_sum"]
    assert 0 < moved["pagellm:kv_block_idle_before_evict_seconds_sum"] < lifetime
    assert 0 < moved["pagellm:kv_block_reuse_gap_seconds_sum"] < lifetime
