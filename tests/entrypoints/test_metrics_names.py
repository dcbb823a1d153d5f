"""vLLM's metrics under ``pagellm:`` on a real ``pagellm serve`` (with ``--kv-cache-metrics``):
every name docs/serving.md lists is on ``/metrics`` (and nothing undocumented is), and real
requests (one with ``max_tokens``, one with ``n=2``, one whose two completions cannot share the
tiny KV cache and get preempted) move the counters and histograms by what they did."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from servers import (
    MODEL_NAME,
    ROOT,
    Server,
    ServerSpecs,
    module_servers,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 6  # the null block and 5 more: two 50-token completions (4 blocks each) cannot share
BYTES_PER_BLOCK = (
    2 * 2 * BLOCK_SIZE * 2 * 16 * 4
)  # layers × (K, V) × tokens × KV heads × head × fp32
DOCUMENTED = re.findall(
    r"^\| `vllm:\w+` \| `(pagellm:\w+)` \|",
    (ROOT / "docs" / "serving.md").read_text(),
    re.MULTILINE,
)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def server_specs(request: pytest.FixtureRequest) -> tuple[str, ServerSpecs]:
    """The ``tiny_cache`` server, from session fixtures only: `module_servers` may start it
    ahead of this module."""
    args = ("--max-model-len", "64", "--block-size", str(BLOCK_SIZE))
    args += ("--kv-cache-memory", str(NUM_BLOCKS * BYTES_PER_BLOCK))
    args += ("--kv-cache-metrics", "--kv-cache-metrics-sample", "1")  # serves kv_block_*
    return request.getfixturevalue("model_dir"), {
        "tiny_cache": ({"VLLM_PLUGINS": "openai,admin"}, args)
    }


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    with module_servers(request) as running:
        yield running["tiny_cache"]


def scrape(server: Server) -> tuple[Samples, dict[str, str]]:
    """Every ``pagellm:`` sample as {(name, labels without model_name): value}, and the metric
    names as docs/serving.md writes them (type for each)."""
    response = server.get("/metrics")
    assert response.status_code == 200, response.text
    samples: Samples = {}
    names = {}
    for family in text_string_to_metric_families(response.text):
        # prometheus_client's creation timestamps read as families of their own here.
        if not family.name.startswith("pagellm:") or family.name.endswith("_created"):
            continue
        # The parser drops a counter's "_total"; the docs (and the exposition) keep it.
        names[family.name + ("_total" if family.type == "counter" else "")] = family.type
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            assert s.labels.pop("model_name") == MODEL_NAME, s
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, names


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def test_every_documented_metric_is_served_and_every_served_one_documented(server: Server):
    assert len(DOCUMENTED) == len(set(DOCUMENTED)) > 25
    samples, names = scrape(server)
    assert set(names) == set(DOCUMENTED)
    [info] = [dict(labels) for name, labels in samples if name == "pagellm:cache_config_info"]
    assert info["num_gpu_blocks"] == str(NUM_BLOCKS) and info["block_size"] == str(BLOCK_SIZE)
    assert info["enable_prefix_caching"] == "True" and info["cache_dtype"] == "float32"
    waiting = "pagellm:num_requests_waiting_by_reason"
    assert {labels for name, labels in samples if name == waiting} == {
        (("reason", "capacity"),),
        (("reason", "deferred"),),
    }


def test_requests_move_the_metrics_by_what_they_did(server: Server):
    client = server.client()
    before, _ = scrape(server)
    one = client.completions.create(
        model=MODEL_NAME,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    two = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        n=2,
        max_tokens=4,
        temperature=0.8,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert server.wait_idle()["num_free_blocks"] == NUM_BLOCKS - 1
    after, _ = scrape(server)
    p1, p2 = one.usage.prompt_tokens, two.usage.prompt_tokens
    assert (one.usage.completion_tokens, two.usage.completion_tokens) == (5, 8)

    assert moved(before, after, "pagellm:request_success_total", finished_reason="length") == 3
    assert moved(before, after, "pagellm:prompt_tokens_total") == p1 + 2 * p2
    assert moved(before, after, "pagellm:generation_tokens_total") == 13
    # Prompts shorter than a block: nothing to find in the prefix cache, all computed.
    assert moved(before, after, "pagellm:prefix_cache_queries_total") == p1 + 2 * p2
    assert moved(before, after, "pagellm:prefix_cache_hits_total") == 0
    assert moved(before, after, "pagellm:prompt_tokens_cached_total") == 0
    local = moved(before, after, "pagellm:prompt_tokens_by_source_total", source="local_compute")
    assert local == p1 + 2 * p2
    # Each completion computes its prompt and all its tokens but the last.
    assert moved(before, after, "pagellm:iteration_tokens_total_sum") == p1 + 4 + 2 * (p2 + 3)
    assert moved(before, after, "pagellm:iteration_tokens_total_count") >= 5
    for histogram, count, total in (
        ("request_prompt_tokens", 3, p1 + 2 * p2),
        ("request_generation_tokens", 3, 13),
        ("request_prefill_kv_computed_tokens", 3, p1 + 2 * p2),
        ("request_params_max_tokens", 3, 5 + 2 * 4),
        ("request_params_n", 2, 1 + 2),
        ("request_max_num_generation_tokens", 2, 5 + 4),
    ):
        assert moved(before, after, f"pagellm:{histogram}_count") == count, histogram
        assert moved(before, after, f"pagellm:{histogram}_sum") == total, histogram
    assert moved(before, after, "pagellm:inter_token_latency_seconds_count") == 13 - 3
    for histogram in (
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    ):
        assert moved(before, after, f"pagellm:{histogram}_count") == 3, histogram
    assert moved(before, after, "pagellm:request_decode_time_seconds_sum") > 0
    assert moved(before, after, "pagellm:num_preemptions_total") == 0
    assert after[("pagellm:num_requests_running", ())] == 0
    assert after[("pagellm:num_requests_waiting", ())] == 0
    assert after[("pagellm:kv_cache_usage_perc", ())] == 0


def test_completions_that_outgrow_the_kv_cache_are_preempted_and_counted(server: Server):
    before, _ = scrape(server)
    completion = server.client().completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        n=2,
        max_tokens=50,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.finish_reason for c in completion.choices] == ["length", "length"]
    assert server.wait_idle()["num_free_blocks"] == NUM_BLOCKS - 1
    after, _ = scrape(server)
    assert moved(before, after, "pagellm:num_preemptions_total") >= 1
    assert moved(before, after, "pagellm:request_success_total", finished_reason="length") == 2
    assert moved(before, after, "pagellm:generation_tokens_total") == 100
    assert moved(before, after, "pagellm:request_params_n_sum") == 2
    assert moved(before, after, "pagellm:request_max_num_generation_tokens_sum") == 50
    assert moved(before, after, "pagellm:request_prefill_time_seconds_count") == 2
    assert after[("pagellm:num_requests_waiting", ())] == 0
