"""Chat options and the routes beside the generation ones, end to end: real ``pagellm serve``
processes driven by the official ``openai`` client (vLLM's fields through ``extra_body``) and httpx.

Two servers, started together, serve a tiny random Llama whose SmolLM2 tokenizer adds a BOS token
(so that ``add_special_tokens`` has an effect to check):

- ``plain``: the tokenizer's chat template, request templates refused;
- ``templated``: ``--chat-template FILE`` (a template printing roles, names, documents and a
  custom variable) and ``--trust-request-chat-template``, behind an API key.

Renderings are checked against transformers' ``apply_chat_template`` on the same tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from servers import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    Server,
    ServerSpecs,
    module_servers,
)

API_KEY = "routes-key"
CHAT = "/v1/chat/completions"
TEMPLATE = (
    "{%- for message in messages -%}"
    "[{{ message['role'] }}{% if message['name'] is defined %} ({{ message['name'] }}){% endif %}]"
    " {{ message['content'] }}\n"
    "{% endfor -%}"
    "{%- for document in documents or [] -%}"
    "<doc {{ document['title'] }}>{{ document['text'] }}</doc>\n"
    "{% endfor -%}"
    "{%- if greeting is defined %}{{ greeting }}\n{% endif -%}"
    "{%- if add_generation_prompt %}[assistant] {% endif -%}"
)
PREFILL = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is"},
]


def server_specs(request: pytest.FixtureRequest) -> tuple[str, ServerSpecs]:
    """The served model (its tokenizer adding a BOS token to what it encodes) and the two servers,
    from session fixtures only: `module_servers` may start them ahead of this module."""
    from transformers import AutoTokenizer

    model_dir = request.getfixturevalue("model_dir")
    directory = request.getfixturevalue("tmp_path_factory").mktemp("bos_model")
    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    AutoTokenizer.from_pretrained(model_dir, add_bos_token=True).save_pretrained(directory)
    template_file = directory.parent / f"{directory.name}.jinja"
    template_file.write_text(TEMPLATE)
    endpoints = ("--endpoints", "openai,admin")
    specs: ServerSpecs = {
        "plain": ({}, endpoints),
        "templated": (
            {"PAGELLM_API_KEY": API_KEY},
            (*endpoints, "--chat-template", str(template_file), "--trust-request-chat-template"),
        ),
    }
    return str(directory), specs


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest) -> Iterator[dict[str, Server]]:
    with module_servers(request) as running:
        yield running


@pytest.fixture(scope="module")
def bos_model_dir(servers: dict[str, Server]) -> str:
    return servers["plain"].model


@pytest.fixture(scope="module")
def hf(bos_model_dir: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bos_model_dir)
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id  # what add_special_tokens adds
    return tokenizer


@pytest.fixture(scope="module")
def plain(servers: dict[str, Server]) -> Server:
    return servers["plain"]


@pytest.fixture(scope="module")
def templated(servers: dict[str, Server]) -> Server:
    return servers["templated"]


def _tokenize(server: Server, **body: Any) -> dict[str, Any]:
    response = server.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _text(server: Server, tokens: list[int]) -> str:
    return server.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def _chat(
    server: Server, messages: list[dict[str, Any]], max_tokens: int = 4, n: int = 1, **extra: Any
) -> Any:
    """A greedy chat completion (a stream with ``stream=True``); ``extra``: vLLM's fields."""
    stream = extra.pop("stream", False)
    return server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        n=n,
        stream=stream,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )


def _refused(server: Server, path: str, body: dict[str, Any], param: str) -> str:
    """The 400's message, after checking it names ``param``."""
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def _still_serving(server: Server) -> None:
    assert server.get("/health").status_code == 200
    assert server.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
    state = server.wait_idle()
    assert state["num_free_blocks"] == state["num_total_blocks"], state


# ---------------------------------------------------------------- rendering


@pytest.mark.parametrize(
    "fields, hf_kwargs",
    [
        ({}, {"add_generation_prompt": True}),
        ({"add_generation_prompt": False}, {}),
        ({"continue_final_message": True}, {"continue_final_message": True}),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            {"continue_final_message": True},
        ),
    ],
)
def test_chat_rendering_matches_transformers(plain: Server, hf: Any, fields: dict, hf_kwargs: dict):
    expected = hf.apply_chat_template(PREFILL, tokenize=True, return_dict=False, **hf_kwargs)
    body = _tokenize(plain, messages=PREFILL, **fields)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == MAX_MODEL_LEN and body["token_strs"] is None
    assert _chat(plain, PREFILL, max_tokens=1, **fields).usage.prompt_tokens == len(expected)
    if fields.get("continue_final_message"):  # the last message is left open
        assert _text(plain, body["tokens"]).endswith("assistant\nThe colour is")


def test_add_special_tokens_adds_the_tokenizers_own_to_the_rendering(plain: Server, hf: Any):
    rendered = hf.apply_chat_template(PREFILL, add_generation_prompt=True, return_dict=False)
    with_bos = _tokenize(plain, messages=PREFILL, add_special_tokens=True)["tokens"]
    assert with_bos == [hf.bos_token_id, *rendered]
    chat = _chat(plain, PREFILL, max_tokens=1, add_special_tokens=True)
    assert chat.usage.prompt_tokens == len(rendered) + 1


def test_completions_add_special_tokens_false_leaves_the_bos_out(plain: Server, hf: Any):
    client = plain.client()

    def prompt_ids(**extra: Any) -> list[int]:
        completion = client.completions.create(
            model=MODEL_NAME,
            prompt="The colour is",
            max_tokens=1,
            temperature=0,
            extra_body={"return_token_ids": True, **extra},
        )
        return completion.choices[0].prompt_token_ids  # type: ignore[attr-defined]

    assert prompt_ids() == hf.encode("The colour is")
    assert prompt_ids(add_special_tokens=False) == hf.encode("The colour is")[1:]


def test_continue_final_message_with_add_generation_prompt_is_refused(plain: Server):
    both = {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True}
    for path in ("/tokenize", CHAT):
        message = _refused(plain, path, both, "continue_final_message")
        assert "continue_final_message" in message and "add_generation_prompt" in message
    with pytest.raises(openai.BadRequestError):
        _chat(plain, PREFILL, continue_final_message=True, add_generation_prompt=True)
    _still_serving(plain)


def test_custom_roles_names_and_text_parts_reach_the_template(templated: Server, hf: Any):
    messages = [
        {"role": "narrator", "content": "Once upon a time."},
        {
            "role": "user",
            "name": "alice",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
    ]
    body = _tokenize(templated, messages=messages)
    text = "[narrator] Once upon a time.\n[user (alice)] Hi\nthere\n[assistant] "
    assert _text(templated, body["tokens"]) == text
    joined = [messages[0], {**messages[1], "content": "Hi\nthere"}]
    expected = hf.apply_chat_template(
        joined, chat_template=TEMPLATE, add_generation_prompt=True, return_dict=False
    )
    assert body["tokens"] == expected
    assert _chat(templated, messages, max_tokens=1).usage.prompt_tokens == len(expected)


def test_chat_template_kwargs_and_documents_reach_the_template(templated: Server, hf: Any):
    messages = [{"role": "user", "content": "Summarise."}]
    documents = [{"title": "T1", "text": "Cats purr."}]
    kwargs = {"greeting": "Bonjour"}
    body = _tokenize(templated, messages=messages, chat_template_kwargs=kwargs, documents=documents)
    text = "[user] Summarise.\n<doc T1>Cats purr.</doc>\nBonjour\n[assistant] "
    assert _text(templated, body["tokens"]) == text
    expected = hf.apply_chat_template(
        messages,
        chat_template=TEMPLATE,
        documents=documents,
        add_generation_prompt=True,
        return_dict=False,
        **kwargs,
    )
    assert body["tokens"] == expected
    chat = _chat(
        templated, messages, max_tokens=1, chat_template_kwargs=kwargs, documents=documents
    )
    assert chat.usage.prompt_tokens == len(expected)


def test_a_request_chat_template_renders_when_the_server_trusts_them(
    templated: Server, plain: Server
):
    messages = [{"role": "user", "content": "hello"}, {"role": "user", "content": "you"}]
    template = "{% for m in messages %}{{ m['content'] | upper }};{% endfor %}"
    body = _tokenize(templated, messages=messages, chat_template=template)
    assert _text(templated, body["tokens"]) == "HELLO;YOU;"
    chat = _chat(templated, messages, max_tokens=1, chat_template=template)
    assert chat.usage.prompt_tokens == body["count"]
    assert _refused(
        templated, CHAT, {"messages": messages, "chat_template": "{% if %}"}, "chat_template"
    )
    assert _refused(templated, CHAT, {"messages": messages, "chat_template": ""}, "chat_template")

    for path in ("/tokenize", CHAT):
        message = _refused(
            plain, path, {"messages": messages, "chat_template": template}, "chat_template"
        )
        assert "--trust-request-chat-template" in message and "not supported" in message
    with pytest.raises(openai.BadRequestError):
        _chat(plain, messages, chat_template=template)
    _still_serving(plain)
    _still_serving(templated)


def test_template_variables_that_the_renderer_sets_are_refused(plain: Server):
    for name in ("chat_template", "add_generation_prompt", "tokenize", "messages"):
        body = {"messages": PREFILL, "chat_template_kwargs": {name: True}}
        for path in ("/tokenize", CHAT):
            assert name in _refused(plain, path, body, "chat_template_kwargs")
    _still_serving(plain)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_non_text_content_parts_are_refused_naming_their_type(plain: Server, part: dict):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]
    for path in ("/tokenize", CHAT):
        message = _refused(plain, path, {"messages": messages}, "messages")
        assert repr(part["type"]) in message and "not supported" in message
    _still_serving(plain)


def test_chat_template_flag_takes_a_file_or_the_template_text(tmp_path: Path):
    from pagellm.entrypoints.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    template_file = tmp_path / "t.jinja"
    template_file.write_text(TEMPLATE)

    def template(value: str) -> str | None:
        args = ServerArgs.from_cli_args(parser.parse_args(["m", "--chat-template", value]))
        return args.chat_template

    assert template(str(template_file)) == TEMPLATE
    assert template("{{ messages[0]['content'] }}\\n—") == "{{ messages[0]['content'] }}\n—"
    with pytest.raises(SystemExit):
        template(str(tmp_path / "missing.jinja"))
    assert ServerArgs.from_cli_args(parser.parse_args(["m"])).trust_request_chat_template is False


# ---------------------------------------------------------------- echo


def test_chat_echo_starts_the_answer_with_the_last_message_of_its_role(plain: Server):
    prefill = {"continue_final_message": True}
    plain_answer = _chat(plain, PREFILL, n=2, **prefill)
    echoed = _chat(plain, PREFILL, n=2, echo=True, **prefill)
    assert [c.message.role for c in echoed.choices] == ["assistant", "assistant"]
    for before, after in zip(plain_answer.choices, echoed.choices, strict=True):
        assert after.message.content == "The colour is" + before.message.content
    assert echoed.usage == plain_answer.usage

    # A new assistant turn after a user message: the roles differ, nothing is echoed.
    asked = [PREFILL[0]]
    assert (
        _chat(plain, asked, echo=True).choices[0].message.content
        == _chat(plain, asked).choices[0].message.content
    )
    # No new turn: the answer continues the user's message, and has its role.
    continued = _chat(plain, asked, echo=True, add_generation_prompt=False).choices[0].message
    assert continued.role == "user" and continued.content.startswith("Name a colour.")


def test_streamed_chat_echo_comes_in_the_first_content_chunks(plain: Server):
    full = _chat(plain, PREFILL, n=2, echo=True, continue_final_message=True)
    stream = _chat(plain, PREFILL, n=2, echo=True, continue_final_message=True, stream=True)
    deltas: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            deltas[choice.index].append(choice.delta)
    for index, choice_deltas in deltas.items():
        assert choice_deltas[0].role == "assistant" and choice_deltas[0].content == ""
        assert choice_deltas[1].content == "The colour is"
        text = "".join(d.content or "" for d in choice_deltas)
        assert text == full.choices[index].message.content


# ---------------------------------------------------------------- tokenize and detokenize


def test_tokenize_a_text_with_vllms_fields(plain: Server, hf: Any):
    text = "Hello world"
    with_special = _tokenize(plain, prompt=text, return_token_strs=True)
    assert (
        with_special["tokens"] == hf.encode(text) and with_special["tokens"][0] == hf.bos_token_id
    )
    assert with_special["token_strs"] == hf.convert_ids_to_tokens(with_special["tokens"])
    assert with_special["count"] == len(with_special["tokens"])
    without = _tokenize(plain, prompt=text, add_special_tokens=False)
    assert without["tokens"] == with_special["tokens"][1:] and without["token_strs"] is None
    assert _text(plain, without["tokens"]) == text
    chat_strs = _tokenize(plain, messages=PREFILL, return_token_strs=True)
    assert chat_strs["token_strs"] == hf.convert_ids_to_tokens(chat_strs["tokens"])
    assert _tokenize(plain, prompt="")["tokens"] == [hf.bos_token_id]

    assert "not both" in _refused(
        plain, "/tokenize", {"prompt": text, "messages": PREFILL}, "prompt"
    )
    assert _refused(plain, "/tokenize", {"prompt": 5}, "prompt")
    assert _refused(plain, "/tokenize", {"messages": []}, "messages")
    assert _refused(plain, "/detokenize", {"tokens": [10**9]}, "tokens")
    _still_serving(plain)


# ---------------------------------------------------------------- other routes


def test_invocations_routes_a_chat_or_a_completion_body_by_its_shape(plain: Server):
    chat_body = {"messages": PREFILL, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    chat = plain.post("/invocations", json=chat_body).json()
    assert chat["object"] == "chat.completion"
    direct_chat = plain.post(CHAT, json=chat_body).json()
    assert chat["choices"][0]["message"] == direct_chat["choices"][0]["message"]

    completion_body = {"prompt": "Once", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    completion = plain.post("/invocations", json=completion_body).json()
    assert completion["object"] == "text_completion"
    direct = plain.post("/v1/completions", json=completion_body).json()
    assert completion["choices"][0]["text"] == direct["choices"][0]["text"]

    with httpx.stream(
        "POST", f"{plain.url}/invocations", json={**chat_body, "stream": True}, timeout=60
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][len("data: ") :])["object"] == "chat.completion.chunk"

    assert _refused(plain, "/invocations", {"max_tokens": 3}, "messages")
    assert _refused(plain, "/invocations", {"prompt": "a", "messages": PREFILL}, "prompt")
    assert _refused(
        plain, "/invocations", {"messages": PREFILL, "temperature": "hot"}, "temperature"
    )
    bad_json = plain.post(
        "/invocations", content=b'{"prompt": ', headers={"Content-Type": "application/json"}
    )
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    _still_serving(plain)


def test_health_and_ping_are_open_and_the_other_routes_need_the_key(templated: Server):
    for path in ("/health", "/health/"):
        response = httpx.get(f"{templated.url}{path}")
        assert response.status_code == 200 and response.json() == {"status": "ok"}, path
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{templated.url}/ping").status_code == 200
    for method, path in (("GET", "/load"), ("POST", "/invocations"), ("POST", "/tokenize")):
        assert httpx.request(method, f"{templated.url}{path}", json={}).status_code == 401
    assert templated.get("/load").json() == {"server_load": 0}


def test_models_list_vllms_card_fields(plain: Server, bos_model_dir: str):
    [card] = plain.get("/v1/models").json()["data"]
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["root"] == bos_model_dir and card["parent"] is None
    assert card["max_model_len"] == MAX_MODEL_LEN
    [permission] = card["permission"]
    assert permission["id"].startswith("modelperm-")
    assert {k: v for k, v in permission.items() if k not in ("id", "created")} == {
        "object": "model_permission",
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    [listed] = plain.client().models.list().data
    assert listed.id == MODEL_NAME


def test_load_counts_generation_requests_in_flight(plain: Server):
    assert plain.get("/load").json() == {"server_load": 0}
    body = {"prompt": "A long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{plain.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert plain.get("/load").json() == {"server_load": 1}
        assert plain.post("/tokenize", json={"prompt": "x"}).status_code == 200  # not counted
        assert plain.get("/load").json() == {"server_load": 1}
        for _ in lines:
            pass
    deadline = time.monotonic() + 10
    while plain.get("/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plain.get("/load").json() == {"server_load": 0}


def test_the_compatibility_tables_routes_are_served_as_it_says(plain: Server):
    """docs/serving.md's route table: each ✓ route answers (any status but 404/405, e.g. 400 for
    an empty body), each other route is a 404."""
    from test_openai_support_table import routes

    checked = routes()
    assert len(checked) > 20
    for method, path, served in checked:
        response = httpx.request(method, f"{plain.url}{path}", json={}, timeout=30)
        if served:
            assert response.status_code not in (404, 405), (method, path, response.text)
        else:
            assert response.status_code == 404, (method, path, response.status_code)
    _still_serving(plain)
