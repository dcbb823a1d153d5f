"""`pagellm bench serve` against a real `pagellm serve` process on 127.0.0.1 with the openai
endpoint package (``plugins/endpoints/openai``), both run as the command line runs them.

The server serves the packaged SmolLM2 rather than a tiny random model: the chat endpoint's
prompts are text, and a chat template's tokens fall outside a tiny model's 1024-token vocabulary.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "bench-secret"


@pytest.fixture(scope="module")
def openai_endpoint() -> Iterator[None]:
    """The openai endpoint package, ``pip install -e``'d for this module unless it is installed
    already (and then uninstalled afterwards)."""
    try:
        importlib.metadata.distribution("pagellm-openai")
    except importlib.metadata.PackageNotFoundError:
        missing = True
    else:
        missing = False
    pip = [sys.executable, "-m", "pip", "-q"]
    if missing:
        package = str(ROOT / "plugins" / "endpoints" / "openai")
        subprocess.run(
            [*pip, "install", "--no-deps", "--no-build-isolation", "-e", package], check=True
        )
    yield
    if missing:
        subprocess.run([*pip, "uninstall", "-y", "pagellm-openai"], check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(openai_endpoint, smollm2_path, tmp_path_factory) -> Iterator[str]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PAGELLM_API_KEY")}
    # The server's log goes to a file: a pipe nobody reads would fill up and stall it.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagellm.entrypoints.cli",
                "serve",
                smollm2_path,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--endpoints",
                "openai",
                "--api-key",
                API_KEY,
                "--max-model-len",
                "128",
                "--kv-cache-memory",
                str(64 << 20),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"pagellm serve exited with {proc.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"pagellm serve was not healthy in 180 s:\n{log_path.read_text()}")
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench(base_url: str, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagellm.entrypoints.cli",
            "bench",
            "serve",
            "--base-url",
            base_url,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        result = None
    return proc, result


def check_latencies(result: dict) -> None:
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        stats = result[key]
        assert set(stats) == {"mean", "p50", "p90", "p99"}, key
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)
    assert result["ttft_ms"]["p99"] <= result["e2e_latency_ms"]["p99"]


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics samples as {(name, labels without model_name): value}."""
    response = httpx.get(base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
    return samples


def test_completions_at_a_request_rate_report_every_token_and_latency_percentiles(
    server, smollm2_path
):
    before = scrape(server)
    proc, result = bench(
        server,
        "--api-key",
        API_KEY,
        "--num-prompts",
        "12",
        "--input-len-range",
        "8",
        "24",
        "--output-len-range",
        "4",
        "12",
        "--request-rate",
        "40",
        "--seed",
        "1",
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert result is not None
    from pagellm.benchmarks.datasets import random_requests

    # The lengths only depend on the seed and the ranges, not on the vocabulary.
    expected = random_requests(12, (8, 24), (4, 12), 1000, 1)
    assert (result["completed"], result["failed"], result["errors"]) == (12, 0, [])
    # The model name came from /v1/models, and the server counted exactly the tokens sent.
    assert result["workload"]["model"] == smollm2_path
    assert result["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
    assert result["total_output_tokens"] == sum(r.output_len for r in expected)
    assert result["output_tokens_per_s"] == pytest.approx(
        result["total_output_tokens"] / result["duration_s"], rel=0.01
    )
    assert result["requests_per_s"] > 0
    check_latencies(result)
    # The server's own metrics saw the same requests and tokens.
    after = scrape(server)

    def grew(name: str, *labels: tuple[str, str]) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("pagellm:prompt_tokens_total") == result["total_input_tokens"]
    assert grew("pagellm:generation_tokens_total") == result["total_output_tokens"]
    assert grew("pagellm:request_success_total", ("finished_reason", "length")) == 12
    assert grew("pagellm:time_to_first_token_seconds_count") == 12
    assert grew("pagellm:e2e_request_latency_seconds_count") == 12
    assert grew("pagellm:request_generation_tokens_sum") == result["total_output_tokens"]
    assert after[("pagellm:num_requests_running", ())] == 0


def test_chat_at_a_concurrency_limit_completes_every_request(server, tmp_path):
    out = tmp_path / "bench.json"
    proc, result = bench(
        server,
        "--api-key",
        API_KEY,
        "--endpoint",
        "/v1/chat/completions",
        "--num-prompts",
        "6",
        "--input-len",
        "16",
        "--output-len",
        "6",
        "--max-concurrency",
        "2",
        "--output-json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert result == json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_output_tokens"] == 36
    assert result["total_input_tokens"] > 6 * 16  # the chat template's tokens come on top
    check_latencies(result)


def test_failed_requests_are_counted_and_reported(server, smollm2_path):
    proc, result = bench(
        server,
        "--api-key",
        API_KEY,
        "--model",
        "no-such-model",
        "--tokenizer",
        smollm2_path,
        "--num-prompts",
        "3",
    )
    assert proc.returncode == 1
    assert result is not None
    assert (result["completed"], result["failed"]) == (0, 3)
    assert len(result["errors"]) == 1 and result["errors"][0].startswith("HTTP 4")
    assert result["ttft_ms"]["p50"] is None


def test_wrong_api_key_stops_before_the_benchmark_with_a_clear_error(server):
    proc, result = bench(server, "--api-key", "wrong", "--num-prompts", "2")
    assert proc.returncode == 2 and result is None
    assert "/v1/models returned HTTP 401" in proc.stderr and "--api-key" in proc.stderr
