"""The API server end to end: real ``pagellm serve`` processes on 127.0.0.1 serving a tiny random
Llama with SmolLM2's tokenizer, driven by the official ``openai`` client and httpx.

The endpoint packages (``plugins/endpoints/openai``, ``plugins/endpoints/admin``, and the test
package ``tests/plugins/dummy_endpoint``) are ``pip install -e``'d for this module when they are not
installed already, and uninstalled afterwards. Four servers, started together, cover the plugin
allowlists and the scheduling policies:

- ``main``: ``VLLM_PLUGINS=openai,admin,dummy_endpoint,embed_endpoint`` and an API key: most tests;
- ``openai_only``: ``VLLM_PLUGINS=openai``, ``--disable-log-stats``; its engine process is killed
  at the end;
- ``default``: VLLM_PLUGINS unset, ``--endpoints openai``, sampling defaults set by
  ``--override-generation-config``, ``--disable-uvicorn-access-log``, ``--uvicorn-log-level
  warning``; stopped with SIGTERM at the end;
- ``one_at_a_time``: ``--scheduling-policy priority --max-num-seqs 1 --enable-log-requests``,
  over HTTPS (a self-signed certificate) under ``--root-path /llm``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from servers import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL_NAME,
    Server,
    self_signed_certificate,
    started_servers,
)

API_KEY = "test-key"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]
UI_ORIGIN = "https://ui.example"
ROOT_PATH = "/llm"
LONG_TEXT = "word " * (MAX_MODEL_LEN + 10)
# The ``default`` server's generation config defaults (``--override-generation-config``).
GENERATION_DEFAULTS = {"temperature": 0.5, "top_k": 5, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def servers(
    endpoint_packages: None,
    model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("server_logs")
    key, cert = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    specs: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
        "main": (
            {
                "VLLM_PLUGINS": "openai,admin,dummy_endpoint,embed_endpoint",
                "PAGELLM_API_KEY": API_KEY,
            },
            (),
        ),
        "openai_only": (
            {"VLLM_PLUGINS": "openai"},
            (
                "--disable-log-stats",
                "--allowed-origins",
                json.dumps([UI_ORIGIN]),
                "--allowed-methods",
                '["GET", "POST"]',
                "--allow-credentials",
            ),
        ),
        "default": (
            {},
            (
                "--endpoints",
                "openai",
                "--enable-log-requests",
                "--override-generation-config",
                json.dumps(GENERATION_DEFAULTS),
                "--disable-uvicorn-access-log",
                "--uvicorn-log-level",
                "warning",
            ),
        ),
        "one_at_a_time": (
            {"VLLM_PLUGINS": "openai"},
            (
                "--scheduling-policy",
                "priority",
                "--max-num-seqs",
                "1",
                "--enable-log-requests",
                "--ssl-keyfile",
                key,
                "--ssl-certfile",
                cert,
                "--root-path",
                ROOT_PATH,
            ),
        ),
    }
    with started_servers(model_dir, logs, specs) as running:
        yield running


@pytest.fixture(scope="module")
def main(servers: dict[str, Server]) -> Server:
    return servers["main"]


# ---------------------------------------------------------------- generation


def test_completions_and_chat_answer_with_usage(main: Server):
    client = main.client()
    completion = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    prompt_len = len(
        main.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    )
    assert completion.object == "text_completion"
    [choice] = completion.choices
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert completion.usage.prompt_tokens == prompt_len
    assert completion.usage.total_tokens == prompt_len + completion.usage.completion_tokens

    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello!"}],
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and chat.usage.completion_tokens == 6
    templated = main.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello!"}]})
    assert chat.usage.prompt_tokens == templated.json()["count"]


def test_models_lists_the_served_name(main: Server):
    [card] = main.client().models.list().data
    assert card.id == MODEL_NAME


def test_tokenize_and_detokenize_round_trip(main: Server):
    tokens = main.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False})
    body = tokens.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    text = main.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def _stream_completion(client: openai.OpenAI, **kwargs: object) -> tuple[dict[int, str], object]:
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    return texts, usage


def _stream_chat(client: openai.OpenAI, **kwargs: object) -> tuple[dict[int, str], object]:
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        usage = chunk.usage or usage
    return texts, usage


def test_streamed_text_equals_non_streamed_text_for_the_same_seed(main: Server):
    client = main.client()
    kwargs = dict(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=7, n=3
    )
    full = client.completions.create(**kwargs)  # type: ignore[call-overload]
    texts, usage = _stream_completion(client, stream_options={"include_usage": True}, **kwargs)
    assert len(full.choices) == 3
    assert texts == {c.index: c.text for c in full.choices}
    assert len(set(texts.values())) > 1  # the n samples differ
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens

    chat_kwargs = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12,
        temperature=0.9,
        seed=11,
        n=2,
    )
    full_chat = client.chat.completions.create(**chat_kwargs)  # type: ignore[call-overload]
    texts, usage = _stream_chat(client, stream_options={"include_usage": True}, **chat_kwargs)
    assert texts == {c.index: c.message.content for c in full_chat.choices}
    assert usage is not None and usage.total_tokens == full_chat.usage.total_tokens


def test_several_prompts_give_n_choices_each_streamed_or_not(main: Server):
    client = main.client()
    kwargs = dict(
        model=MODEL_NAME,
        prompt=["The sky is", "Roses are"],
        max_tokens=6,
        temperature=1.0,
        seed=5,
        n=2,
    )
    full = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    texts, usage = _stream_completion(client, stream_options={"include_usage": True}, **kwargs)
    assert texts == {c.index: c.text for c in full.choices}
    assert usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[attr-defined]
    counts = [main.post("/tokenize", json={"prompt": p}).json()["count"] for p in kwargs["prompt"]]
    assert full.usage.prompt_tokens == sum(counts)
    by_ids = client.completions.create(**{**kwargs, "prompt": [[504, 2365], [6354]]})  # type: ignore[call-overload]
    assert len(by_ids.choices) == 4 and by_ids.usage.prompt_tokens == 3


def test_chat_content_parts_are_joined_text(main: Server):
    client = main.client()
    kwargs = dict(model=MODEL_NAME, max_tokens=5, temperature=0)
    parts = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}], **kwargs
    )  # type: ignore[call-overload]
    plain = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello!"}], **kwargs
    )  # type: ignore[call-overload]
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_completion_logprobs_and_echo(main: Server):
    client = main.client()
    prompt = "Hello there"
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=True
    )
    [choice] = out.choices
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    num_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(
        lp.tokens[num_prompt:],
        lp.token_logprobs[num_prompt:],
        lp.top_logprobs[num_prompt:],
        strict=True,
    ):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert (
            top[token] == logprob == max(top.values())
        )  # greedy: the sampled token is the top one


def test_chat_logprobs_list_the_top_tokens(main: Server):
    out = main.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert bytes(token.bytes).decode() == token.token


def test_stop_string_ends_the_text_before_it(main: Server):
    client = main.client()
    kwargs = dict(
        model=MODEL_NAME,
        prompt="One two three",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    expected = text[: text.index(stop)]
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]  # type: ignore[call-overload]
    assert (stopped.text, stopped.finish_reason) == (expected, "stop")
    streamed, _ = _stream_completion(client, stop=stop, **kwargs)
    assert streamed == {0: expected}
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HELLO,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    reply = chat.choices[0].message.content
    stop = reply[len(reply) // 2 : len(reply) // 2 + 3]
    stopped_chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HELLO,
        max_tokens=24,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert stopped_chat.choices[0].message.content == reply[: reply.index(stop)]
    assert stopped_chat.choices[0].finish_reason == "stop"


def test_penalties_logit_bias_and_seed_are_applied(main: Server):
    client = main.client()
    kwargs = dict(model=MODEL_NAME, prompt="Hello", max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs)  # type: ignore[call-overload]
    favourite = main.post(
        "/tokenize", json={"prompt": " banana", "add_special_tokens": False}
    ).json()["tokens"][0]
    biased = client.completions.create(logit_bias={str(favourite): 100}, **kwargs)  # type: ignore[call-overload]
    assert biased.choices[0].text == " banana" * 6
    penalised = client.completions.create(
        presence_penalty=2.0, frequency_penalty=2.0, logit_bias={str(favourite): 8}, **kwargs
    )  # type: ignore[call-overload]
    assert penalised.choices[0].text != biased.choices[0].text
    assert plain.choices[0].text != biased.choices[0].text
    sampled = [
        client.completions.create(**{**kwargs, "temperature": 1.0, "seed": 3}).choices[0].text  # type: ignore[call-overload]
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_64_concurrent_streams_complete_and_free_every_kv_block(main: Server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, int]:
        max_tokens = 8 + i % 9
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"Request number {i} says",
            max_tokens=max_tokens,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks, usage = 0, None
        async for chunk in stream:
            chunks += bool(chunk.choices)
            usage = chunk.usage or usage
        assert usage is not None
        return max_tokens, usage.completion_tokens, chunks

    async def run_all() -> list[tuple[int, int, int]]:
        client = main.async_client()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert all(expected == generated for expected, generated, _ in results), results
    assert all(0 < chunks <= expected for expected, _, chunks in results), results
    state = main.wait_idle()
    assert state["num_free_blocks"] == state["num_total_blocks"], state
    assert (state["num_running"], state["num_waiting"]) == (0, 0)


def _abort_count(server: Server) -> float:
    """Requests ended by an abort, from /metrics. The front end hands an abort's stats to the
    loggers with the next engine step's, so one short request goes first."""
    server.post(COMPLETIONS, json={"prompt": "flush", "max_tokens": 1})
    metrics = server.get("/metrics").text
    match = re.search(
        r'pagellm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', metrics
    )
    return float(match.group(1)) if match else 0.0


def test_client_disconnecting_mid_stream_aborts_and_frees_its_blocks(main: Server):
    before = _abort_count(main)
    body = {
        "model": MODEL_NAME,
        "prompt": "A very long story begins",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{main.url}/v1/completions", json=body, headers=main.headers(), timeout=60
    ) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: {")
            if events == 3:
                break
    state = main.wait_idle()
    assert state["num_free_blocks"] == state["num_total_blocks"], state
    assert _abort_count(main) == before + 1


def test_client_leaving_before_a_non_streamed_answer_aborts_its_request(main: Server):
    before = _abort_count(main)
    body = {
        "model": MODEL_NAME,
        "prompt": "Another long story",
        "max_tokens": 480,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        main.post(COMPLETIONS, json=body, timeout=0.3)
    state = main.wait_idle()
    assert state["num_free_blocks"] == state["num_total_blocks"], state
    assert _abort_count(main) == before + 1


def _prefix_cache_hits(server: Server) -> float:
    metrics = server.get("/metrics").text
    match = re.search(r"^pagellm:prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    assert match, metrics
    return float(match.group(1))


def test_cache_salt_keeps_prefix_cache_hits_apart(main: Server):
    """The engine's stats of a request's step reach /metrics before its answer does."""
    hits = []
    for salt in ("alice", "bob", "alice"):
        before = _prefix_cache_hits(main)
        body = {"model": MODEL_NAME, "prompt": "salted " * 60, "max_tokens": 1, "cache_salt": salt}
        assert main.post(COMPLETIONS, json=body).status_code == 200
        hits.append(_prefix_cache_hits(main) - before)
    assert hits[0] == hits[1] == 0 < hits[2]


def test_priority_decides_which_waiting_request_runs_first(servers: dict[str, Server]):
    """The engine process is stopped while three requests reach it: when it goes on, the first
    (of the highest priority) runs, and the other two wait for it, one sequence at a time."""
    server = servers["one_at_a_time"]
    engine_pid = server.engine_pid()
    finished: list[str] = []

    def run(name: str, priority: int, max_tokens: int) -> None:
        body = {"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "priority": priority}
        if server.post(COMPLETIONS, json=body).status_code == 200:
            finished.append(name)

    requests = [("first", -10, 480), ("low", 5, 16), ("high", -1, 16)]
    threads = [threading.Thread(target=run, args=request) for request in requests]
    added = server.log().count("Added request")
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        for thread in threads:
            thread.start()
            added += 1  # it reaches the engine's queue (the front end logs it) before the next
            deadline = time.monotonic() + 60
            while server.log().count("Added request") < added:
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.05)
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    for thread in threads:
        thread.join(60)
    assert finished == ["first", "high", "low"]
    assert re.search(r"Added request \S+: 1 prompt tokens, priority -10, ", server.log())


def test_one_access_log_line_per_request_unless_disabled(servers: dict[str, Server]):
    """``main`` logs as vLLM by default; ``default`` runs with no access log and uvicorn's log at
    warning level (no start-up lines either)."""
    main, quiet = servers["main"], servers["default"]
    for server in (main, quiet):
        assert server.get("/v1/models").status_code == 200
    line = r'INFO uvicorn\.access: 127\.0\.0\.1:\d+ - "GET /v1/models HTTP/1\.1" 200'
    assert re.search(line, main.log()), main.log()[-2000:]
    assert "INFO uvicorn.error: Application startup complete" in main.log()
    assert "uvicorn.access" not in quiet.log() and "INFO uvicorn.error" not in quiet.log()


def test_https_and_root_path(servers: dict[str, Server]):
    server = servers["one_at_a_time"]
    assert server.url.startswith("https://")
    # The certificate is checked (the client trusts only it); plain HTTP gets no answer.
    assert server.get("/health").status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/health", timeout=5)  # the system's CAs do not know it
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5)
    # A proxy strips --root-path: the routes stay where they are, /health stays open, and the
    # in-flight count (/load) still counts generation routes.
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    answers: list[int] = []
    thread = threading.Thread(
        target=lambda: answers.append(server.post(COMPLETIONS, json=body).status_code)
    )
    thread.start()
    deadline = time.monotonic() + 30
    while server.get("/load").json()["server_load"] != 1:
        assert time.monotonic() < deadline and thread.is_alive(), "the request was not counted"
        time.sleep(0.01)
    thread.join(60)
    assert answers == [200] and server.get("/load").json() == {"server_load": 0}
    # Links the server makes carry the prefix.
    assert server.get("/openapi.json").json()["servers"] == [{"url": ROOT_PATH}]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ssl-keyfile", "KEY"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-keyfile", "KEY", "--ssl-certfile", "/no/such.pem"], "--ssl-certfile /no/such.pem"),
        (["--ssl-cert-reqs", "2"], "need HTTPS"),
        (
            ["--ssl-keyfile", "KEY", "--ssl-certfile", "CERT", "--ssl-cert-reqs", "2"],
            "--ssl-ca-certs",
        ),
    ],
)
def test_tls_flags_that_do_not_fit_are_refused_naming_the_flag(
    flags: list[str], message: str, tmp_path: Path
):
    from pagellm.entrypoints.server_args import ServerArgs

    key, cert = self_signed_certificate(tmp_path)
    argv = [key if f == "KEY" else cert if f == "CERT" else f for f in flags]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerArgs.from_cli_args(parser.parse_args(["model", *argv])).check_tls()


def test_the_serve_command_checks_tls_before_it_looks_for_the_model(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(tmp_path / "none")]
        + ["--ssl-certfile", str(tmp_path / "missing.pem")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--ssl-keyfile and --ssl-certfile go together" in proc.stderr


# ---------------------------------------------------------------- bad requests


BAD_REQUESTS = {
    "invalid JSON": (COMPLETIONS, b'{"prompt": "hi",'),
    "body not an object": (COMPLETIONS, b'["hi"]'),
    "missing messages": (CHAT, {"model": MODEL_NAME}),
    "empty messages": (CHAT, {"messages": []}),
    "messages not a list": (CHAT, {"messages": "hi"}),
    "role not a string": (CHAT, {"messages": [{"role": 5, "content": "hi"}]}),
    "image content part": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    ),
    "max_tokens a string": (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}),
    "temperature a string": (CHAT, {"messages": HELLO, "temperature": "hot"}),
    "prompt a number": (COMPLETIONS, {"prompt": 5}),
    "max_tokens beyond the context": (COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}),
    "max_completion_tokens beyond the context": (
        CHAT,
        {"messages": HELLO, "max_completion_tokens": MAX_MODEL_LEN},
    ),
    "prompt longer than max_model_len": (COMPLETIONS, {"prompt": LONG_TEXT}),
    "prompt token ids longer than max_model_len": (
        COMPLETIONS,
        {"prompt": [100] * (MAX_MODEL_LEN + 1)},
    ),
    "chat longer than max_model_len": (
        CHAT,
        {"messages": [{"role": "user", "content": LONG_TEXT}]},
    ),
    "negative temperature": (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}),
    "NaN temperature": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}'),
    "logit_bias id beyond the vocabulary": (
        COMPLETIONS,
        {"prompt": "hi", "logit_bias": {"10000000": 5}},
    ),
    "logit_bias negative id": (CHAT, {"messages": HELLO, "logit_bias": {"-1": 5}}),
    "logit_bias key not a number": (CHAT, {"messages": HELLO, "logit_bias": {"abc": 5}}),
    "n of 0": (COMPLETIONS, {"prompt": "hi", "n": 0}),
    "n above max_num_seqs": (CHAT, {"messages": HELLO, "n": MAX_NUM_SEQS + 1}),
    "prompt token id beyond the vocabulary": (COMPLETIONS, {"prompt": [10**7]}),
    "top_logprobs without logprobs": (CHAT, {"messages": HELLO, "top_logprobs": 2}),
    "logprobs above the limit": (COMPLETIONS, {"prompt": "hi", "logprobs": 50}),
    "stream_options without stream": (
        COMPLETIONS,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
    ),
    "oversized body": (COMPLETIONS, {"prompt": "x" * (2 << 20)}),
    "empty prompt": (COMPLETIONS, {"prompt": ""}),
    "empty stop string": (COMPLETIONS, {"prompt": "hi", "stop": ""}),
    "empty stop string in a list": (CHAT, {"messages": HELLO, "stop": ["x", ""]}),
    "empty bad word": (COMPLETIONS, {"prompt": "hi", "bad_words": ["x", ""]}),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_400_with_an_openai_error(main: Server, case: str):
    path, body = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = main.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"model": "gpt-17", "messages": HELLO}),
        (COMPLETIONS, {"model": "gpt-17", "prompt": "hi"}),
    ],
)
def test_an_unknown_model_gets_404_as_from_openai_and_vllm(main: Server, path: str, body: dict):
    response = main.post(path, json=body)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found", error
    assert "'gpt-17' does not exist" in error["message"] and MODEL_NAME in error["message"]


def test_bad_requests_name_the_parameter(main: Server):
    def param(path: str, body: dict) -> str | None:
        return main.post(path, json=body).json()["error"]["param"]

    assert param(CHAT, {"model": MODEL_NAME}) == "messages"
    assert param(CHAT, {"messages": HELLO, "n": MAX_NUM_SEQS + 1}) == "n"
    assert param(CHAT, {"model": "nope", "messages": HELLO}) == "model"
    assert param(COMPLETIONS, {"prompt": "hi", "max_tokens": 10_000}) == "max_tokens"
    assert param(COMPLETIONS, {"prompt": "hi", "logit_bias": {"10000000": 1}}) == "logit_bias"
    # The main server schedules first come, first served: a priority would be ignored.
    assert param(COMPLETIONS, {"prompt": "hi", "priority": 3}) == "priority"
    assert param(CHAT, {"messages": HELLO, "stream": True, "priority": -1}) == "priority"


def test_the_openai_client_raises_bad_request_and_the_server_keeps_serving(main: Server):
    client = main.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=HELLO, temperature=-1)  # type: ignore[arg-type]
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", stream=True, max_tokens=10_000)
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
    assert main.get("/health").status_code == 200


# ---------------------------------------------------------------- API key, request ids


def test_api_key_is_required_on_every_route_but_health(main: Server):
    from pagellm.entrypoints.request_guard import OPEN_PATHS

    schema = main.get("/openapi.json")
    assert schema.status_code == 200
    routes = [
        (method.upper(), path)
        for path, item in schema.json()["paths"].items()
        for method in item
        if path not in OPEN_PATHS
    ]
    paths = {path for _, path in routes}
    assert {"/v1/completions", "/invocations", "/load", "/v1/admin/state", "/metrics"} <= paths
    assert "/v1/dummy/ping" in paths
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.request(method, f"{main.url}{path}", headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    for path in OPEN_PATHS:  # /health, /health/ and /ping (SageMaker's)
        assert httpx.get(f"{main.url}{path}").status_code == 200, path
    assert main.get("/v1/dummy/ping").json() == {"pong": "dummy", "model": MODEL_NAME}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{main.url}/v1", api_key="wrong").models.list()


def _preflight(server: Server, origin: str, method: str = "POST") -> httpx.Response:
    return httpx.options(
        f"{server.url}{COMPLETIONS}",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_cors_by_default_lets_any_origin_call_with_its_key(main: Server):
    # vLLM's defaults: any origin, method and header; the preflight needs no API key.
    preflight = _preflight(main, "https://anywhere.example")
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    origin = {"Origin": "https://anywhere.example"}
    allowed = main.get("/v1/models", headers=origin)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"
    # A 401 carries the header too, so that the page can read why it was refused.
    refused = httpx.get(f"{main.url}/v1/models", headers=origin)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    # No Origin, no CORS headers.
    assert "access-control-allow-origin" not in main.get("/v1/models").headers


def test_cors_flags_limit_origins_and_methods(servers: dict[str, Server]):
    server = servers["openai_only"]
    preflight = _preflight(server, UI_ORIGIN)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == UI_ORIGIN
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert _preflight(server, "https://elsewhere.example").status_code == 400
    assert _preflight(server, UI_ORIGIN, method="DELETE").status_code == 400
    answer = httpx.post(
        f"{server.url}{COMPLETIONS}",
        headers={"Origin": UI_ORIGIN},
        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1},
    )
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == UI_ORIGIN
    other = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://elsewhere.example"})
    assert other.status_code == 200  # the browser, not the server, withholds it from the page
    assert "access-control-allow-origin" not in other.headers


def test_request_id_is_echoed_or_made(main: Server):
    echoed = main.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"X-Request-Id": "abc-123"},
    )
    assert echoed.headers["x-request-id"] == "abc-123"
    assert echoed.json()["id"] == "cmpl-abc-123"
    made = {main.get("/version").headers["x-request-id"] for _ in range(2)}
    assert len(made) == 2 and all(made)
    assert httpx.get(f"{main.url}/health").headers["x-request-id"]


def test_fastapi_docs_are_served_by_default(main: Server):
    assert main.get("/openapi.json").status_code == 200
    assert main.get("/docs").status_code == 200


def test_version_and_metrics(main: Server):
    import pagellm

    assert main.get("/version").json() == {"version": pagellm.__version__}
    metrics = main.get("/metrics")
    assert metrics.status_code == 200 and "pagellm:generation_tokens_total" in metrics.text


# ---------------------------------------------------------------- endpoint plugins


def test_vllm_plugins_naming_openai_and_admin_serves_both(main: Server):
    assert main.get("/v1/models").status_code == 200
    assert main.get("/v1/admin/state").status_code == 200
    reset = main.post("/v1/admin/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json() == {"reset": True}


def test_plugin_whose_required_tasks_do_not_match_is_skipped_with_a_log_line(main: Server):
    log = main.log()
    assert re.search(
        r"Endpoint plugin 'embed_endpoint' skipped: required_tasks \['embed'\] do not meet", log
    ), log
    assert main.post("/v1/dummy/embed").status_code == 404
    assert "Serving endpoint plugin 'dummy_endpoint'" in log


def test_vllm_plugins_openai_serves_no_admin_routes(servers: dict[str, Server]):
    server = servers["openai_only"]
    assert server.get("/v1/models").status_code == 200
    assert server.get("/v1/admin/state").status_code == 404
    assert server.post("/v1/admin/reset_prefix_cache").status_code == 404
    assert server.get("/v1/dummy/ping").status_code == 404


def test_disable_log_stats_drops_the_periodic_line_not_the_metrics(
    servers: dict[str, Server], main: Server
):
    quiet = servers["openai_only"]
    for server in (main, quiet):
        body = {"prompt": "Hi", "max_tokens": 4}
        assert server.post(COMPLETIONS, json=body).status_code == 200
    time.sleep(6)  # past the 5 s interval of the periodic line
    assert "Prompt throughput:" in main.log()
    assert "Prompt throughput:" not in quiet.log()
    metrics = quiet.get("/metrics").text
    assert re.search(r"^pagellm:generation_tokens_total\{[^}]*\} [1-9]", metrics, re.M)


def test_without_vllm_plugins_only_the_endpoints_option_is_served(servers: dict[str, Server]):
    server = servers["default"]
    assert server.get("/v1/models").status_code == 200
    assert server.get("/v1/admin/state").status_code == 404
    assert server.get("/v1/dummy/ping").status_code == 404
    assert "Endpoint plugin 'admin' skipped: endpoint plugins are off unless named" in server.log()


def _last_engine_params(server: Server) -> str:
    """The sampling parameters of the request the server sent to its engine last
    (``--enable-log-requests``)."""
    return [line for line in server.log().splitlines() if "Added request" in line][-1]


def test_generation_config_defaults_fill_only_what_a_request_leaves_unset(
    servers: dict[str, Server],
):
    server = servers["default"]
    unset = server.post(COMPLETIONS, json={"prompt": "Hi", "ignore_eos": True})
    assert unset.status_code == 200, unset.text
    assert unset.json()["usage"]["completion_tokens"] == 3  # max_new_tokens caps the 16
    logged = _last_engine_params(server)
    assert "temperature=0.5, top_p=1.0, top_k=5," in logged and "max_tokens=3," in logged
    chat = server.post(CHAT, json={"messages": HELLO, "ignore_eos": True})
    assert chat.json()["usage"]["completion_tokens"] == 3  # the context's room, capped too
    body = {"prompt": "Hi", "ignore_eos": True, "temperature": 1.0, "top_k": 0, "max_tokens": 6}
    explicit = server.post(COMPLETIONS, json=body)
    assert explicit.json()["usage"]["completion_tokens"] == 6  # what the request asks, uncapped
    logged = _last_engine_params(server)
    assert "temperature=1.0, top_p=1.0, top_k=0," in logged and "max_tokens=6," in logged


def test_plugins_of_api_1_0_get_the_engine_client_and_later_ones_the_server_context():
    """The engine client is a stand-in: attaching only hands it on."""
    from fastapi import FastAPI

    from pagellm.entrypoints.api_server import attach_endpoint_plugin
    from pagellm.entrypoints.server_args import ServerArgs
    from pagellm.entrypoints.server_context import ServerContext
    from pagellm.plugins import EndpointPlugin

    engine_client = object()
    ctx = ServerContext(
        engine_client=engine_client,  # type: ignore[arg-type]
        served_model_names=[MODEL_NAME],
        model_path="/models/tiny",
        platform_name="cpu",
        stat_loggers=[],
        args=ServerArgs(model="/models/tiny"),
    )
    received = {}
    for version in ("1.0", "1.1"):
        plugin = EndpointPlugin(attach=lambda app, arg, v=version: received.setdefault(v, arg))
        plugin.api_version = version  # as the loader sets it from the plugin module's declaration
        attach_endpoint_plugin(FastAPI(), plugin, ctx)
    assert received == {"1.0": engine_client, "1.1": ctx}


def test_server_args_are_typed_from_the_command_line():
    from pagellm.entrypoints.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["m", "--port", "9", "--endpoints", "openai, admin", "--shutdown-timeout", "2.5"]
    args = ServerArgs.from_cli_args(parser.parse_args([*argv, "--disable-fastapi-docs"]))
    expected = ServerArgs(model="m", port=9, endpoints=["openai", "admin"], shutdown_timeout=2.5)
    assert args == dataclasses.replace(expected, disable_fastapi_docs=True)
    assert args.served_model_names == ["m"]
    default = ServerArgs.from_cli_args(parser.parse_args(["m"])).endpoints
    assert default == ("openai", "embeddings")  # each attaches only to a model of its tasks


# ---------------------------------------------------------------- failures and shutdown


def test_unknown_stat_logger_stops_serve_with_a_clear_error(model_dir: str):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagellm.entrypoints.cli",
            "serve",
            model_dir,
            "--stat-loggers",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "pagellm: error: Stat logger 'nope' is not installed" in proc.stderr


def test_killing_the_engine_fails_inflight_requests_with_5xx_and_health_503(
    servers: dict[str, Server],
):
    server = servers["openai_only"]
    body = {"model": MODEL_NAME, "prompt": "Go on", "max_tokens": 500, "ignore_eos": True}
    results: list[int | BaseException] = []

    def non_streaming() -> None:
        try:
            results.append(server.post("/v1/completions", json=body, timeout=5.0).status_code)
        except BaseException as exc:
            results.append(exc)

    stream_error: list[BaseException] = []
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=5.0, max_retries=0)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Go on",
        max_tokens=480,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    iterator = iter(stream)
    next(iterator)  # the engine is generating
    threads = [threading.Thread(target=non_streaming) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)  # let their requests reach the server
    engine_pid = server.engine_pid()
    killed_at = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)
    try:
        for _ in iterator:
            pass
    except openai.APIError as exc:
        stream_error.append(exc)
    for thread in threads:
        thread.join(10)
    assert stream_error, "the stream ended without an error"
    assert results and all(isinstance(r, int) and r >= 500 for r in results), results
    assert time.monotonic() - killed_at < 5  # every client had its 5xx within 5 s
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503
    assert health.json()["error"]["type"] == "server_error"
    # The dead engine is reaped by the server (its parent): no zombie is left.
    deadline = time.monotonic() + 5
    while Path(f"/proc/{engine_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{engine_pid}").exists()
    after = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert after.status_code == 503, after.text


def _open_unread_stream(server: Server, path: str, body: dict) -> socket.socket:
    """Send a streaming request over a socket with a tiny receive buffer and read only the status
    line and headers: the server soon cannot write more (flow control), so the response cannot
    end while nobody reads it."""
    payload = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def test_sigterm_lets_requests_finish_aborts_the_rest_after_the_timeout_and_stops_the_engine(
    servers: dict[str, Server],
):
    """``default`` runs with the default --shutdown-timeout of 5 s. The short request finishes
    within it; the long one cannot (its client reads nothing), so it is aborted when the timeout
    ends; then the engine process is stopped."""
    server = servers["default"]
    engine_pid = server.engine_pid()
    long_body = {
        "model": MODEL_NAME,
        "messages": HELLO,
        "max_tokens": 480,
        "n": 8,
        "logprobs": True,
        "top_logprobs": 20,
        "ignore_eos": True,
        "stream": True,
    }
    long_stream = _open_unread_stream(server, CHAT, long_body)  # its engine requests now run
    short_body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}{COMPLETIONS}", json={**short_body, "stream": True}, timeout=60
    ) as short:
        server.proc.send_signal(signal.SIGTERM)
        lines = list(short.iter_lines())
    assert sum(line.startswith("data: {") for line in lines) == 4
    assert "data: [DONE]" in lines
    assert server.proc.wait(60) in (0, -signal.SIGTERM)
    received = b""
    while data := long_stream.recv(1 << 16):
        received += data
    long_stream.close()
    # Aborted, not finished: either cut off mid-stream (its events outgrew the socket buffers),
    # or, when fewer events were made before the timeout (a loaded machine), told so in an error
    # event; never its 8 x 480 tokens to their end.
    assert received.count(b"data: {") > 0
    assert b"data: [DONE]" not in received or b'"code":"server_shutting_down"' in received
    assert received.count(b'"finish_reason":"length"') < 8
    assert "Shutting the engine down" in server.log()
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(engine_pid, 0)
            time.sleep(0.1)
