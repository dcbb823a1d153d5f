"""No request can hurt the server: real ``pagellm serve`` processes on 127.0.0.1, attacked as an
adversarial client would (reproductions of the crashes found, a fuzz of the request schemas,
disconnect storms, slow clients, SIGTERM under load, engine faults and deaths).

Servers (tiny random Llama with SmolLM2's vocabulary, started together):

- ``robust``: the fault-injection test plugin (``tests/fault_injection``) is loaded, so a prompt
  holding the token of " electromagnetic" makes its engine steps raise once it has generated a
  token (a stream has begun), and one holding
  " photosynthesis" makes its first step last `SLOW_STEP_S`; small limits on sequences per
  request, waiting requests and header/body times; no FastAPI docs;
- ``doomed``: every step that runs a poisoned request raises; its engine is made to die of it;
- ``stopper``: stopped with SIGTERM while it streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from editable_installs import editable_installs
from servers import (
    MODEL_NAME,
    Server,
    started_servers,
)

FAULT_PACKAGE = Path(__file__).parents[1] / "fault_injection"
POISON = 14744  # " electromagnetic"
SLOW = 19173  # " photosynthesis"
SLOW_STEP_S = 7.0  # more than the 5 s the health probe used to wait for a step
MAX_NUM_SEQS = 8
MAX_WAITING = 8
MAX_SEQUENCES_PER_REQUEST = 16
HEADER_TIMEOUT_S = 1.0
# Shorter than the streams of the SIGTERM test take (4 x 480 tokens of the tiny model took about
# 3 s on a 2-core machine with nothing else running), so that they are cut, not finished.
SHUTDOWN_TIMEOUT_S = 1.0
INT64_MAX = 2**63 - 1
FAULT_ENV = {
    "VLLM_PLUGINS": "openai,admin,fault_injection",
    "PAGELLM_FAULT_TOKEN": str(POISON),
    "PAGELLM_FAULT_AFTER": "1",  # a poisoned request fails once its first token is out
    "PAGELLM_SLOW_TOKEN": str(SLOW),
    "PAGELLM_SLOW_STEP_S": str(SLOW_STEP_S),
}
LIMITS = (
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-waiting-requests",
    str(MAX_WAITING),
    "--max-sequences-per-request",
    str(MAX_SEQUENCES_PER_REQUEST),
    "--header-timeout",
    str(HEADER_TIMEOUT_S),
    "--body-timeout",
    "1",
)


@pytest.fixture(scope="module")
def fault_package() -> Iterator[None]:
    with editable_installs([FAULT_PACKAGE]):
        yield


@pytest.fixture(scope="module")
def servers(
    first_party_endpoints: None,
    fault_package: None,
    model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("robustness_logs")
    specs: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
        "robust": (FAULT_ENV, (*LIMITS, "--disable-fastapi-docs")),
        "doomed": ({**FAULT_ENV, "PAGELLM_FAULT_AFTER": "0"}, ()),
        "stopper": (
            {"VLLM_PLUGINS": "openai,admin"},
            ("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)),
        ),
    }
    with started_servers(model_dir, logs, specs) as running:
        yield running


@pytest.fixture(scope="module")
def robust(servers: dict[str, Server]) -> Server:
    return servers["robust"]


def completion(**fields: object) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields: object) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **fields,
    }


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_healthy_and_idle(server: Server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    state = server.wait_idle()
    assert state["num_running"] == state["num_waiting"] == 0, state
    assert state["num_free_blocks"] == state["num_total_blocks"], state


def gauges(server: Server) -> dict[str, float]:
    text = server.get("/metrics").text
    values = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        match = re.search(rf"^pagellm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        assert match, text
        values[name] = float(match.group(1))
    return values


def sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


# ---------------------------------------------------------------- the reproductions


@pytest.mark.parametrize("top_k", [100_000, 49_153, INT64_MAX])
def test_top_k_beyond_the_vocabulary_samples_and_the_engine_lives(robust: Server, top_k: int):
    for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
        response = robust.post(path, json={**body, "top_k": top_k, "temperature": 1.0})
        assert response.status_code == 200, response.text
    assert_healthy_and_idle(robust)


def test_top_k_beyond_int64_is_refused_naming_it(robust: Server):
    assert_error(robust.post("/v1/completions", json=completion(top_k=2**63)), 400, "top_k")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": INT64_MAX, "n": 2}, "seed"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"n": 2**64}, "n"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"min_tokens": 2**64}, "min_tokens"),
        ({"prompt": [2**64]}, "prompt"),
    ],
)
def test_out_of_range_integers_get_400_naming_the_field(robust: Server, fields: dict, param: str):
    assert_error(robust.post("/v1/completions", json=completion(**fields)), 400, param)


def test_detokenize_of_an_out_of_range_token_gets_400(robust: Server):
    assert_error(robust.post("/detokenize", json={"tokens": [2**64]}), 400, "tokens")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", completion(prompt="a\ud800b"), "prompt"),
        ("/v1/completions", completion(prompt=["ok", "\udfff"]), "prompt"),
        ("/v1/completions", completion(stop=["\ud800"]), "stop"),
        ("/v1/completions", completion(model="\ud800"), "model"),
        ("/tokenize", {"prompt": "x\ud800"}, "prompt"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "\ud800"}]), None),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "name": "\udc00"}]), None),
    ],
)
def test_lone_surrogates_get_400(robust: Server, path: str, body: dict, param: str | None):
    # json.dumps escapes a lone surrogate as \\ud800: valid JSON that no UTF-8 text encodes.
    content = json.dumps(body).encode()
    error = assert_error(
        robust.post(path, content=content, headers={"Content-Type": "application/json"}), 400
    )
    assert "surrogate" in error["message"]
    assert error["param"] == (param or "messages")


def test_prompts_times_n_over_the_limit_gets_400_naming_the_limit(robust: Server):
    body = completion(prompt=[[1, 2, 3]] * 1000, n=4)
    started = time.monotonic()
    error = assert_error(robust.post("/v1/completions", json=body), 400, "prompt")
    assert (
        error["code"] == "too_many_sequences" and "--max-sequences-per-request" in error["message"]
    )
    assert time.monotonic() - started < 5  # refused before any of it reaches the engine
    within = robust.post("/v1/completions", json=completion(prompt=[[1, 2, 3]] * 4, n=2))
    assert within.status_code == 200 and len(within.json()["choices"]) == 8


def test_waiting_requests_beyond_the_bound_get_503_with_retry_after(robust: Server):
    body = completion(max_tokens=64, ignore_eos=True)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=robust.url, timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(3 * MAX_NUM_SEQS))
            )

    responses = asyncio.run(run())
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == MAX_NUM_SEQS + MAX_WAITING, statuses
    refused = [r for r in responses if r.status_code != 200]
    assert refused, statuses
    for response in refused:
        error = assert_error(response, 503)
        assert error["code"] == "server_overloaded"
        assert response.headers["Retry-After"] == "1"
    assert_healthy_and_idle(robust)


def test_token_id_prompt_ending_inside_a_character_does_not_repeat_its_text(robust: Server):
    # "Hello" then the first byte of "é"; the bias makes the output's first token its second byte.
    body = completion(prompt=[19556, 142], temperature=0, logit_bias={"119": 100})
    text = robust.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text.startswith("é") and "Hello" not in text, text


def test_each_streamed_choice_ends_exactly_once_under_load(robust: Server):
    async def stream(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            events = [line[6:] async for line in response.aiter_lines() if line[:6] == "data: "]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    async def run() -> list[list[dict]]:
        async with httpx.AsyncClient(base_url=robust.url, timeout=120) as client:
            jobs = []
            for i in range(3):
                jobs.append(stream(client, "/v1/chat/completions", chat(n=3, max_tokens=8 + i)))
                jobs.append(stream(client, "/v1/completions", completion(n=2, max_tokens=8 + i)))
            return await asyncio.gather(*jobs)

    for chunks in asyncio.run(run()):
        finals: dict[int, int] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                if choice["finish_reason"] is not None:
                    finals[choice["index"]] = finals.get(choice["index"], 0) + 1
        assert finals and set(finals.values()) == {1}, finals


def _start_stream(server: Server, body: dict) -> socket.socket:
    """A streaming request over a raw socket, read until its first event arrives."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    return sock


def test_gauges_return_to_idle_when_clients_disconnect(robust: Server):
    body = completion(max_tokens=400, ignore_eos=True, stream=True)
    sockets = [_start_stream(robust, body) for _ in range(4)]
    assert gauges(robust)["num_requests_running"] > 0
    for sock in sockets:
        sock.close()
    deadline = time.monotonic() + 10  # no other request: only the aborts can move the gauges
    while gauges(robust)["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gauges(robust) == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }


def test_slow_clients_are_closed_after_the_header_timeout(robust: Server):
    sockets = []
    for i in range(150):
        sock = socket.create_connection(("127.0.0.1", robust.port))
        if i % 2:  # half send part of a request line, the others nothing at all
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(HEADER_TIMEOUT_S + 10)
        sockets.append(sock)
    try:
        for sock in sockets:
            assert sock.recv(1024) == b""  # closed by the server
    finally:
        for sock in sockets:
            sock.close()
    assert httpx.get(f"{robust.url}/health", timeout=5).status_code == 200


def test_a_body_that_trickles_gets_408(robust: Server):
    with socket.create_connection(("127.0.0.1", robust.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        sock.settimeout(10)
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 408"), head


def test_internal_errors_name_the_request_id_not_the_exception(robust: Server):
    poisoned = completion(prompt=[1, POISON, 2])
    with httpx.Client(base_url=robust.url, timeout=60) as client:
        response = client.post("/v1/completions", json=poisoned, headers={"X-Request-Id": "r-42"})
        error = assert_error(response, 500)
        assert "r-42" in error["message"] and "Injected" not in error["message"]
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat(
                messages=[{"role": "user", "content": ("photo electromagnetic waves")}], stream=True
            ),
            headers={"X-Request-Id": "r-43"},
        ) as streamed:
            events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "r-43" in error["message"] and "Injected" not in error["message"]
    assert "r-42" in robust.log() and "InjectedFault" in robust.log()


def test_a_failing_request_fails_alone_and_its_neighbours_complete(robust: Server):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=robust.url, timeout=120) as client:
            bodies = [
                completion(prompt=[5, 6, i], max_tokens=16, ignore_eos=True) for i in range(6)
            ]
            bodies.insert(3, completion(prompt=[5, POISON, 7], max_tokens=16, ignore_eos=True))
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 3 + [500] + [200] * 3
    for response in responses[:3] + responses[4:]:
        assert response.json()["usage"]["completion_tokens"] == 16
    assert_healthy_and_idle(robust)


def test_health_stays_200_during_a_long_step(robust: Server):
    done = threading.Event()

    def slow_request() -> None:
        robust.post("/v1/completions", json=completion(prompt=[1, SLOW, 2]), timeout=60)
        done.set()

    thread = threading.Thread(target=slow_request)
    thread.start()
    time.sleep(0.5)  # its step has begun
    try:
        for _ in range(3):
            started = time.monotonic()
            health = httpx.get(f"{robust.url}/health", timeout=SLOW_STEP_S)
            assert health.status_code == 200, health.text
            assert not done.is_set()  # answered while the step still ran
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    finally:
        thread.join(60)
    assert done.is_set()


def test_docs_are_off_with_disable_fastapi_docs(robust: Server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert robust.get(path).status_code == 404


# ---------------------------------------------------------------- storms and the fuzz


def test_disconnect_storm_leaves_no_request_and_no_block_behind(robust: Server):
    def leave_mid_stream(i: int) -> None:
        body = completion(prompt=[7, 8, i], max_tokens=200, ignore_eos=True, stream=True)
        with httpx.Client(base_url=robust.url, timeout=60) as client:
            try:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    for n, _ in enumerate(response.iter_lines()):
                        if n >= i % 5:
                            break
            except httpx.HTTPError:
                pass

    def leave_before_the_answer(i: int) -> None:
        body = completion(prompt=[9, i], max_tokens=200, ignore_eos=True)
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{robust.url}/v1/completions", json=body, timeout=0.2 + 0.05 * i)

    threads = [threading.Thread(target=leave_mid_stream, args=(i,)) for i in range(40)]
    threads += [threading.Thread(target=leave_before_the_answer, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert_healthy_and_idle(robust)
    assert robust.post("/v1/completions", json=completion()).status_code == 200


def _any_json() -> st.SearchStrategy:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=6), children, max_size=3)
        ),
        max_leaves=6,
    )


def _small_or_odd_int() -> st.SearchStrategy:
    return st.one_of(
        st.integers(-3, 8),
        st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 49_152, 100_000]),
    )


TOKEN = st.integers(0, 49_151).filter(lambda t: t not in (POISON, SLOW))
TEXT = st.text(
    alphabet=st.characters(codec="utf-8") | st.sampled_from(["\ud800", "\udfff", "é", "\u2028"]),
    max_size=24,
)
COMMON_FIELDS = {
    "n": _small_or_odd_int(),
    "temperature": st.one_of(st.floats(-1, 3), st.just(0.0), st.sampled_from(["1", None])),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.none()),
    "top_k": _small_or_odd_int(),
    "min_p": st.floats(-0.5, 1.5),
    "seed": _small_or_odd_int(),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "logit_bias": st.dictionaries(
        st.one_of(TOKEN.map(str), st.text(max_size=4)), st.floats(-200, 200), max_size=3
    ),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": st.lists(_small_or_odd_int(), max_size=3),
    "min_tokens": _small_or_odd_int(),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"include_usage": st.booleans()}, optional={"continuous_usage_stats": st.booleans()}
        ),
    ),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "allowed_token_ids": st.lists(_small_or_odd_int(), max_size=3),
    "bad_words": st.lists(TEXT, max_size=2),
    "prompt_logprobs": _small_or_odd_int(),
    "return_token_ids": st.booleans(),
    "return_tokens_as_token_ids": st.one_of(st.none(), st.booleans()),
    "truncate_prompt_tokens": _small_or_odd_int(),
    "truncation_side": st.sampled_from(["left", "right", "middle"]),
    "request_id": TEXT,
    "model": st.one_of(st.just(MODEL_NAME), TEXT),
}
PROMPT = st.one_of(
    TEXT,
    st.lists(TEXT, max_size=3),
    st.lists(TOKEN, max_size=8),
    st.lists(st.lists(TOKEN, max_size=6), max_size=3),
    st.lists(_small_or_odd_int(), max_size=4),
    _any_json(),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"])},
    optional={
        "content": st.one_of(
            TEXT,
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
            _any_json(),
        ),
        "name": TEXT,
    },
)
COMPLETION_BODY = st.fixed_dictionaries(
    {"prompt": PROMPT, "max_tokens": st.one_of(st.integers(1, 4), _small_or_odd_int())},
    optional={
        **COMMON_FIELDS,
        "echo": st.booleans(),
        "logprobs": _small_or_odd_int(),
        "suffix": TEXT,
    },
)
CHAT_BODY = st.fixed_dictionaries(
    {
        "messages": st.lists(MESSAGE, max_size=3),
        "max_tokens": st.one_of(st.integers(1, 4), _small_or_odd_int()),
    },
    optional={
        **COMMON_FIELDS,
        "logprobs": st.booleans(),
        "top_logprobs": _small_or_odd_int(),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "echo": st.booleans(),
        "add_special_tokens": st.booleans(),
        "chat_template_kwargs": _any_json(),
        "documents": _any_json(),
    },
)
TOKENIZE_BODY = st.fixed_dictionaries(
    {},
    optional={
        "prompt": TEXT,
        "messages": st.lists(MESSAGE, max_size=2),
        "add_special_tokens": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "model": st.one_of(st.just(MODEL_NAME), TEXT),
    },
)
DETOKENIZE_BODY = st.fixed_dictionaries(
    {"tokens": st.one_of(st.lists(_small_or_odd_int(), max_size=5), st.lists(TOKEN, max_size=5))},
    optional={"model": st.one_of(st.just(MODEL_NAME), TEXT)},
)
REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), COMPLETION_BODY),
    st.tuples(st.just("/v1/chat/completions"), CHAT_BODY),
    st.tuples(st.just("/tokenize"), TOKENIZE_BODY),
    st.tuples(st.just("/detokenize"), DETOKENIZE_BODY),
    st.tuples(st.just("/invocations"), st.one_of(COMPLETION_BODY, CHAT_BODY)),
    # Unknown fields are refused before anything else: a variant of their own, so that the
    # other bodies reach the deeper checks.
    st.tuples(
        st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
        st.fixed_dictionaries({"prompt": PROMPT, "unknown_field": _any_json()}),
    ),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), _any_json()),
)


def _check_response(response: httpx.Response) -> None:
    status = response.status_code
    assert 200 <= status < 300 or 400 <= status < 500, (status, response.text)
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]", response.text
        for event in events[:-1]:
            assert "error" not in json.loads(event[6:]), event
    else:
        response.json()


def test_fuzzed_requests_get_2xx_or_a_4xx_and_leave_the_server_idle(robust: Server):
    client = httpx.Client(base_url=robust.url, timeout=60)

    @settings(
        max_examples=int(os.environ.get("PAGELLM_FUZZ_EXAMPLES", "300")),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(REQUESTS)
    def fuzz(request: tuple[str, object]) -> None:
        path, body = request
        content = json.dumps(body).encode()
        response = client.post(path, content=content, headers={"Content-Type": "application/json"})
        _check_response(response)

    try:
        fuzz()
    finally:
        client.close()
    assert_healthy_and_idle(robust)
    assert gauges(robust) == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }


# ---------------------------------------------------------------- shutdown and death


def test_sigterm_ends_every_long_stream_with_an_error_event_and_done_within_the_timeout(
    servers: dict[str, Server],
):
    server = servers["stopper"]
    body = completion(max_tokens=480, ignore_eos=True, stream=True)
    results: list[list[str]] = []
    started = threading.Barrier(5)

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            started.wait()
            results.append([first, *lines])

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for thread in threads:
        thread.start()
    started.wait()
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    elapsed = time.monotonic() - signalled
    for thread in threads:
        thread.join(30)
    assert elapsed < SHUTDOWN_TIMEOUT_S + 1.5, elapsed  # interpreter teardown on top of it
    assert len(results) == 4
    for lines in results:
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"


def test_an_engine_dying_of_an_exception_fails_requests_and_is_reaped(
    servers: dict[str, Server],
):
    """Steps that fail one after the other (here every request is poisoned) mean a broken
    engine: it raises, reports its exception and exits; the front end answers 5xx, health says
    503, and the dead process is reaped (no zombie under the server)."""
    server = servers["doomed"]
    engine_pid = server.engine_pid()
    body = completion(prompt=[3, POISON], max_tokens=4)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(40))
            )

    statuses = {r.status_code for r in asyncio.run(run())}
    assert statuses <= {500, 503} and 503 in statuses, statuses
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    deadline = time.monotonic() + 5
    while Path(f"/proc/{engine_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{engine_pid}").exists(), Path(f"/proc/{engine_pid}/status").read_text()
    assert "steps failed in a row" in server.log()
