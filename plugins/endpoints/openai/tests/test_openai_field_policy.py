"""No silent drops: every request field is implemented, accepted as a no-op (and then changes
nothing in the output), or refused with a 400 naming it; unknown fields are 400s too; values
out of range are refused as vLLM refuses them. One real ``pagellm serve`` on 127.0.0.1, driven
by the official ``openai`` client (``extra_body`` for the fields its methods do not take)."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from servers import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL_NAME,
    Server,
)

PROMPT = "The capital of France is"
HELLO = [{"role": "user", "content": "hi"}]
ROUTES = ("completions", "chat")
GREEDY = {"temperature": 0, "max_tokens": 4}
INT64_MAX = 2**63 - 1

# Refused on both routes: (field, a value that asks for something, the value that asks for
# nothing or None when only null does).
REFUSED: list[tuple[str, Any, Any]] = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], None),
    ("tool_choice", "auto", "none"),
    ("functions", [{"name": "f", "parameters": {}}], None),
    ("function_call", "auto", "none"),
    ("response_format", {"type": "json_object"}, {"type": "text"}),
    ("modalities", ["text", "audio"], ["text"]),
    ("audio", {"voice": "alloy", "format": "wav"}, None),
    ("prediction", {"type": "content", "content": "Paris"}, None),
    ("reasoning_effort", "low", None),
    ("verbosity", "low", None),
    ("web_search_options", {}, None),
    ("moderation", {"model": "omni-moderation-latest"}, None),
    ("structured_outputs", {"regex": "a+"}, None),
    ("guided_json", {"type": "object"}, None),
    ("guided_regex", "a+", None),
    ("guided_choice", ["yes", "no"], None),
    ("guided_grammar", 'root ::= "a"', None),
    ("guided_decoding_backend", "xgrammar", None),
    ("guided_whitespace_pattern", " ", None),
    ("structural_tag", "{}", None),
    ("use_beam_search", True, False),
    ("length_penalty", 2.0, 1.0),
    ("early_stopping", True, False),
    ("watermarking", True, False),
    ("logits_processors", ["my_module.MyProcessor"], None),
    ("logprob_token_ids", [1, 2], None),
    ("repetition_detection", {"max_pattern_size": 4}, None),
    ("thinking_token_budget", 16, -1),
    ("include_reasoning", False, True),
    ("stream_interval", 4, 1),
    ("vllm_xargs", {"key": 1}, None),
    ("kv_transfer_params", {"do_remote_prefill": True}, None),
    ("ec_transfer_params", {"key": 1}, None),
    ("mm_processor_kwargs", {"key": 1}, None),
    ("media_io_kwargs", {"image": {}}, None),
    ("return_prompt_text", True, False),
    ("return_token_offsets", True, False),
    ("return_mm_kwargs", False, True),
    ("routed_experts_prompt_start", 1, 0),
]
REFUSED_ON = {
    "completions": [
        ("suffix", " and so on.", ""),
        ("prompt_embeds", "AAAA", None),
    ],
    "chat": [],
}
NO_OPS: list[tuple[str, Any]] = [
    ("user", "user-1"),
    ("safety_identifier", "hash-of-a-user"),
    ("metadata", {"purpose": "test"}),
    ("store", True),
    ("service_tier", "flex"),
    ("prompt_cache_key", "key-1"),
    ("prompt_cache_retention", "24h"),
    ("prompt_cache_options", {"mode": "implicit", "ttl": "30m"}),
    ("parallel_tool_calls", False),
    ("session_id", "session-1"),
]


def refused_cases() -> list[tuple[str, str, Any, Any]]:
    cases = [(route, name, value, ok) for route in ROUTES for name, value, ok in REFUSED]
    cases += [(route, *case) for route in ROUTES for case in REFUSED_ON[route]]
    return cases


def harmless_cases() -> list[tuple[str, str, Any]]:
    cases = [(route, name, value) for route in ROUTES for name, value in NO_OPS]
    cases += [
        (route, name, harmless)
        for route, name, _, harmless in refused_cases()
        if harmless is not None
    ]
    return cases


@pytest.fixture(scope="module")
def server(shared_server: Server) -> Server:
    """The session's shared server (``VLLM_PLUGINS=openai,admin``, the defaults)."""
    return shared_server


@pytest.fixture(scope="module")
def vocab_size(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def create(server: Server, route: str, **fields: Any) -> Any:
    """A completion (prompt `PROMPT`) or a chat completion (`HELLO`) asking for ``fields``: the
    ones the client's method takes as arguments, the others in ``extra_body``."""
    client = server.client()
    method: Callable[..., Any]
    if route == "completions":
        method, base = client.completions.create, {"prompt": PROMPT}
    else:
        method, base = client.chat.completions.create, {"messages": HELLO}
    known = inspect.signature(method).parameters
    kwargs = {k: v for k, v in fields.items() if k in known}
    extra = {k: v for k, v in fields.items() if k not in known}
    return method(model=MODEL_NAME, **base, **kwargs, extra_body=extra or None)


def text(response: Any) -> str:
    choice = response.choices[0]
    return choice.text if hasattr(choice, "text") else choice.message.content


def refusal(server: Server, route: str, **fields: Any) -> dict:
    """The OpenAI error body of a request the server must refuse with a 400."""
    with pytest.raises(openai.BadRequestError) as info:
        create(server, route, **fields)
    error = info.value.body
    assert isinstance(error, dict), error
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error", error
    return error


def assert_idle(server: Server) -> None:
    state = server.wait_idle()
    assert state["num_running"] == state["num_waiting"] == 0, state
    assert state["num_free_blocks"] == state["num_total_blocks"], state


@pytest.fixture(scope="module")
def baseline(server: Server) -> dict[str, str]:
    """Each route's greedy text with none of the fields under test."""
    return {route: text(create(server, route, **GREEDY)) for route in ROUTES}


# ---------------------------------------------------------------- refused and unknown fields


@pytest.mark.parametrize(("route", "name", "value", "harmless"), refused_cases())
def test_a_refused_field_asking_for_something_is_a_400_naming_it(
    server: Server, route: str, name: str, value: Any, harmless: Any
):
    error = refusal(server, route, **{name: value})
    assert error["param"] == name and error["code"] == "unsupported_parameter", error
    assert error["message"].startswith(f"{name} is not supported by this server"), error
    assert_idle(server)


@pytest.mark.parametrize(("route", "name", "value"), harmless_cases())
def test_a_no_op_field_or_a_value_asking_for_nothing_changes_nothing(
    server: Server, baseline: dict[str, str], route: str, name: str, value: Any
):
    assert text(create(server, route, **GREEDY, **{name: value})) == baseline[route]


@pytest.mark.parametrize("route", ROUTES)
def test_every_refused_field_may_be_null(server: Server, baseline: dict[str, str], route: str):
    nulls = {name: None for r, name, _, _ in refused_cases() if r == route}
    assert text(create(server, route, **GREEDY, **nulls)) == baseline[route]


@pytest.mark.parametrize("route", ROUTES)
def test_stream_options_include_obfuscation_is_refused_when_true(server: Server, route: str):
    error = refusal(server, route, stream=True, stream_options={"include_obfuscation": True})
    assert error["param"] == "stream_options.include_obfuscation", error
    assert error["code"] == "unsupported_parameter", error
    stream = create(
        server, route, stream=True, max_tokens=2, stream_options={"include_obfuscation": False}
    )
    assert list(stream)
    assert_idle(server)


@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_field_is_a_400_naming_its_path(server: Server, route: str):
    error = refusal(server, route, frobnicate=1)
    assert error["param"] == "frobnicate" and error["code"] == "unknown_parameter", error
    assert "'frobnicate'" in error["message"] and "does not support" in error["message"]
    error = refusal(server, route, stream=True, stream_options={"include_usage": True, "foo": 1})
    assert error["param"] == "stream_options.foo", error
    assert "'stream_options.foo'" in error["message"], error
    # vLLM logs a warning and goes on; a misspelt field must not silently do nothing.
    assert refusal(server, route, max_token=5)["param"] == "max_token"
    assert_idle(server)


@pytest.mark.parametrize("route", ROUTES)
def test_best_of_is_accepted_only_equal_to_n(server: Server, route: str):
    error = refusal(server, route, n=1, best_of=3)
    assert error["param"] == "best_of" and error["code"] == "unsupported_parameter", error
    assert "best_of=3 is not supported" in error["message"]
    error = refusal(server, route, n=2, best_of=1)
    assert error["param"] == "best_of" and "less than n" in error["message"], error
    response = create(server, route, n=2, best_of=2, seed=1, max_tokens=2)
    assert len(response.choices) == 2
    assert_idle(server)


def test_after_the_refusals_the_server_answers_and_every_kv_block_is_free(server: Server):
    assert server.get("/health").status_code == 200
    for route in ROUTES:
        assert text(create(server, route, **GREEDY))
    assert_idle(server)


# ---------------------------------------------------------------- OpenAI's current names


def test_max_completion_tokens_sets_the_length_and_wins_over_max_tokens(server: Server):
    client = server.client()
    fixed = {"model": MODEL_NAME, "messages": HELLO, "extra_body": {"ignore_eos": True}}
    chat = client.chat.completions.create(max_completion_tokens=5, **fixed)  # type: ignore[call-overload]
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    both = client.chat.completions.create(max_tokens=3, max_completion_tokens=7, **fixed)  # type: ignore[call-overload]
    assert both.usage.completion_tokens == 7
    old = client.chat.completions.create(max_tokens=3, **fixed)  # type: ignore[call-overload]
    assert old.usage.completion_tokens == 3


def test_top_logprobs_lists_that_many_tokens_and_zero_needs_no_logprobs(server: Server):
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_completion_tokens=3, logprobs=True, top_logprobs=4
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 4 for t in content)
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, max_completion_tokens=3, top_logprobs=0
    )
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("route", ROUTES)
def test_stop_is_a_string_or_a_list(server: Server, route: str):
    fields: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    full = text(create(server, route, **fields))
    cut = full[3:6]
    assert len(cut) == 3 and full.index(cut) == 3, full
    for stop in (cut, [cut, "\x00never"]):
        assert text(create(server, route, **fields, stop=stop)) == full[:3]


def test_developer_messages_reach_the_chat_template(server: Server):
    messages = [{"role": "developer", "content": "Answer in French."}, *HELLO]
    chat = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=2,
    )
    rendered = server.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()
    without = server.post("/tokenize", json={"model": MODEL_NAME, "messages": HELLO}).json()
    assert chat.usage.prompt_tokens == rendered["count"] > without["count"]


@pytest.mark.parametrize("route", ROUTES)
def test_null_means_the_default_for_openai_optional_fields(
    server: Server, baseline: dict[str, str], route: str
):
    fields: dict[str, Any] = {"n": None, "stream": None, "logprobs": None}
    if route == "completions":
        fields["echo"] = None
    response = create(server, route, **GREEDY, **fields)
    assert len(response.choices) == 1 and response.choices[0].logprobs is None
    assert text(response) == baseline[route]


# ---------------------------------------------------------------- values vLLM refuses


def out_of_range_cases(vocab: int) -> list[tuple[str, dict[str, Any], str]]:
    both = [
        ({"seed": INT64_MAX + 1}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": INT64_MAX, "n": 2}, "seed"),
        ({"stop_token_ids": [vocab]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {str(vocab): 1}}, "logit_bias"),
        ({"logit_bias": {"5": "high"}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": MAX_NUM_SEQS + 1}, "n"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
    ]
    cases = [(route, fields, param) for route in ROUTES for fields, param in both]
    cases += [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),  # the whole vocabulary: over 20
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
        ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ]
    return cases


@pytest.mark.parametrize("case", range(len(out_of_range_cases(1))))
def test_values_out_of_range_are_a_400_naming_the_field(server: Server, vocab_size: int, case: int):
    route, fields, param = out_of_range_cases(vocab_size)[case]
    error = refusal(server, route, **fields)
    assert error["param"] == param and param in error["message"], error
    assert_idle(server)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("bias", ["Infinity", "-Infinity", "NaN"])
def test_a_logit_bias_that_is_no_number_is_a_400(server: Server, route: str, bias: str):
    # The openai client refuses to encode these: Python's JSON reader, the server's, takes them.
    body = {"model": MODEL_NAME, "max_tokens": 2}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": HELLO}
    content = json.dumps(body)[:-1] + f', "logit_bias": {{"5": {bias}}}}}'
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    response = server.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias", response.text
    assert_idle(server)
