"""vLLM's sampling and output extensions of the OpenAI routes, end to end: real ``pagellm serve``
processes on 127.0.0.1 (a tiny random Llama with SmolLM2's vocabulary), the official ``openai``
client (``extra_body`` for vLLM's fields) and httpx for what the client cannot send.

Two servers:

- ``plain``: the defaults: the session's `shared_server`;
- ``details``: ``--enable-prompt-tokens-details``, ``--return-tokens-as-token-ids``, and SmolLM2's
  tokenizer with a WordPiece decoder (``--tokenizer``), which puts a space between tokens, special
  ones included, as BERT-style tokenizers do: there ``spaces_between_special_tokens`` shows (with
  SmolLM2's byte-level decoder it changes nothing, in vLLM as here).

After each refusal the server still answers and holds no KV block.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

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

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
PROMPT = "The quick brown fox jumps over the lazy dog while"
IM_START, IM_END = 1, 2  # SmolLM2's special tokens; <|im_end|> is its EOS
GREEDY = {"model": MODEL_NAME, "temperature": 0}


def server_specs(request: pytest.FixtureRequest) -> tuple[str, ServerSpecs]:
    """The ``details`` server, from session fixtures only: `module_servers` may start it ahead of
    this module."""
    model_dir = request.getfixturevalue("model_dir")
    wordpiece_tokenizer = request.getfixturevalue("tmp_path_factory").mktemp("wordpiece_tokenizer")
    for path in Path(model_dir).iterdir():  # all but the weights
        if path.suffix != ".safetensors":
            shutil.copy(path, wordpiece_tokenizer)
    spec = json.loads((wordpiece_tokenizer / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": False}
    (wordpiece_tokenizer / "tokenizer.json").write_text(json.dumps(spec))
    env = {"VLLM_PLUGINS": "openai,admin"}
    args = (
        "--enable-prompt-tokens-details",
        "--return-tokens-as-token-ids",
        "--tokenizer",
        str(wordpiece_tokenizer),
    )
    return model_dir, {"details": (env, args)}


@pytest.fixture(scope="module")
def details(request: pytest.FixtureRequest) -> Iterator[Server]:
    with module_servers(request) as running:
        yield running["details"]


@pytest.fixture(scope="module")
def plain(shared_server: Server) -> Server:
    return shared_server


def tokenize(server: Server, **body: object) -> list[int]:
    response = server.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def detokenize(server: Server, tokens: list[int]) -> str:
    return server.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def assert_refused(server: Server, path: str, body: dict, param: str) -> str:
    """A 400 naming ``param``; the server then answers and holds no KV block. The message."""
    response = server.post(path, json={"model": MODEL_NAME, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert server.post(COMPLETIONS, json={"prompt": "ok", "max_tokens": 1}).status_code == 200
    state = server.wait_idle()
    assert state["num_free_blocks"] == state["num_total_blocks"], state
    return error["message"]


def sse_chunks(server: Server, path: str, body: dict, headers: dict | None = None) -> list[dict]:
    """The JSON chunks of a streamed request, in order (``[DONE]`` checked and left out)."""
    with httpx.stream(
        "POST",
        f"{server.url}{path}",
        json={"model": MODEL_NAME, **body, "stream": True},
        headers=headers,
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def streamed_token_ids(chunks: list[dict]) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    return ids


def chat_text(chunks: list[dict]) -> str:
    return "".join(ch["delta"]["content"] or "" for c in chunks for ch in c["choices"])


# ---------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_come_on_the_completion_choice_and_at_the_top_of_a_chat(plain: Server):
    client = plain.client()
    ids = tokenize(plain, prompt=PROMPT)
    out = client.completions.create(
        prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2}, **GREEDY
    )
    [choice] = out.choices
    positions = choice.prompt_logprobs
    assert len(positions) == len(ids) == out.usage.prompt_tokens and positions[0] is None
    for token, position in zip(ids[1:], positions[1:], strict=True):
        assert next(iter(position)) == str(token)  # the prompt's own token first
        assert 2 <= len(position) <= 3 and all(lp["logprob"] <= 0 for lp in position.values())
        assert {1, 2} <= {lp["rank"] for lp in position.values()}
    unasked = client.completions.create(prompt=PROMPT, max_tokens=2, **GREEDY).choices[0]
    assert unasked.prompt_logprobs is None

    # Echo's logprobs of the prompt are the same numbers.
    echoed = client.completions.create(
        prompt=PROMPT, max_tokens=2, logprobs=2, echo=True, **GREEDY
    ).choices[0]
    assert echoed.logprobs.token_logprobs[1 : len(ids)] == [
        position[str(token)]["logprob"]
        for token, position in zip(ids[1:], positions[1:], strict=True)
    ]

    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    first, *rest = sse_chunks(plain, COMPLETIONS, body)
    assert first["choices"][0]["prompt_logprobs"] == positions
    assert all("prompt_logprobs" not in c["choices"][0] for c in rest)

    chat = client.chat.completions.create(
        messages=HELLO, max_tokens=2, extra_body={"prompt_logprobs": 1}, **GREEDY
    )
    chat_positions = chat.prompt_logprobs
    assert len(chat_positions) == chat.usage.prompt_tokens and chat_positions[0] is None
    assert (
        client.chat.completions.create(messages=HELLO, max_tokens=1, **GREEDY).prompt_logprobs
        is None
    )
    body = {"messages": HELLO, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    roles, first_delta, *_ = sse_chunks(plain, CHAT, body)
    assert "prompt_logprobs" not in roles and first_delta["prompt_logprobs"] == chat_positions


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_of_minus_one_or_beyond_the_limit_get_400(plain: Server, value: int):
    message = assert_refused(
        plain, COMPLETIONS, {"prompt": "hi", "prompt_logprobs": value}, "prompt_logprobs"
    )
    assert "20" in message
    assert_refused(plain, CHAT, {"messages": HELLO, "prompt_logprobs": value}, "prompt_logprobs")
    with pytest.raises(openai.BadRequestError):
        plain.client().completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": value}
        )


# ---------------------------------------------------------------- token ids


def test_return_token_ids_gives_the_prompt_and_choice_token_ids_streamed_or_not(plain: Server):
    client = plain.client()
    extra = {"return_token_ids": True, "ignore_eos": True}
    out = client.completions.create(prompt=PROMPT, max_tokens=5, extra_body=extra, **GREEDY)
    [choice] = out.choices
    assert choice.prompt_token_ids == tokenize(plain, prompt=PROMPT)
    assert len(choice.token_ids) == 5 and detokenize(plain, choice.token_ids) == choice.text
    unasked = client.completions.create(prompt=PROMPT, max_tokens=1, **GREEDY).choices[0]
    assert unasked.token_ids is None and unasked.prompt_token_ids is None

    chunks = sse_chunks(
        plain, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, **extra}
    )
    assert streamed_token_ids(chunks) == {0: choice.token_ids}
    with_prompt = [c for c in chunks if "prompt_token_ids" in c["choices"][0]]
    assert with_prompt == chunks[:1]
    assert with_prompt[0]["choices"][0]["prompt_token_ids"] == choice.prompt_token_ids

    chat = client.chat.completions.create(messages=HELLO, max_tokens=5, extra_body=extra, **GREEDY)
    assert chat.prompt_token_ids == tokenize(plain, messages=HELLO)
    [reply] = chat.choices
    assert detokenize(plain, reply.token_ids) == reply.message.content
    chunks = sse_chunks(
        plain, CHAT, {"messages": HELLO, "max_tokens": 5, "temperature": 0, **extra}
    )
    assert [c.get("prompt_token_ids") for c in chunks[:2]] == [chat.prompt_token_ids, None]
    assert streamed_token_ids(chunks) == {0: reply.token_ids}


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(plain: Server, details: Server):
    client = plain.client()
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    [choice] = client.completions.create(
        prompt=PROMPT, max_tokens=3, logprobs=2, echo=True, extra_body=extra, **GREEDY
    ).choices
    ids = choice.prompt_token_ids + choice.token_ids
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert choice.text.startswith(PROMPT)  # the text stays text
    for token, top in zip(ids[1:], lp.top_logprobs[1:], strict=True):
        assert next(iter(top)) == f"token_id:{token}"  # each position's own token first

    body = {
        "messages": HELLO,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        **extra,
    }
    chunks = sse_chunks(plain, CHAT, body)
    token_ids = streamed_token_ids(chunks)[0]
    content = [
        t
        for c in chunks
        for ch in c["choices"]
        if ch["logprobs"]
        for t in ch["logprobs"]["content"]
    ]
    assert [t["token"] for t in content] == [f"token_id:{t}" for t in token_ids]
    assert all(top["token"].startswith("token_id:") for t in content for top in t["top_logprobs"])
    assert content[0]["bytes"] == list(detokenize(plain, token_ids[:1]).encode())

    assert_refused(
        plain,
        CHAT,
        {"messages": HELLO, "return_tokens_as_token_ids": True},
        "return_tokens_as_token_ids",
    )

    # The server's --return-tokens-as-token-ids is the default a request may turn off.
    kwargs = dict(prompt=PROMPT, max_tokens=2, logprobs=0, **GREEDY)
    served = details.client()
    assert served.completions.create(**kwargs).choices[0].logprobs.tokens[0].startswith("token_id:")
    off = served.completions.create(extra_body={"return_tokens_as_token_ids": False}, **kwargs)
    assert not off.choices[0].logprobs.tokens[0].startswith("token_id:")


# ---------------------------------------------------------------- prompt truncation


def test_truncate_prompt_tokens_keeps_the_last_or_the_first_tokens(plain: Server):
    client = plain.client()
    ids = tokenize(plain, prompt=PROMPT)
    extra = {"truncate_prompt_tokens": 4, "return_token_ids": True, "ignore_eos": True}
    cut = client.completions.create(
        prompt=PROMPT, max_tokens=4, echo=True, extra_body=extra, **GREEDY
    )
    [choice] = cut.choices
    assert cut.usage.prompt_tokens == 4 and choice.prompt_token_ids == ids[-4:]
    assert choice.text.startswith(detokenize(plain, ids[-4:]))
    alone = client.completions.create(
        prompt=ids[-4:],
        max_tokens=4,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **GREEDY,
    )
    assert choice.token_ids == alone.choices[0].token_ids
    right = client.completions.create(
        prompt=PROMPT, max_tokens=1, extra_body={**extra, "truncation_side": "right"}, **GREEDY
    )
    assert right.choices[0].prompt_token_ids == ids[:4]

    # -1: as many as the context leaves room for beside max_tokens.
    long = "word " * (MAX_MODEL_LEN + 20)
    fitted = client.completions.create(
        prompt=long, max_tokens=4, extra_body={"truncate_prompt_tokens": -1}, **GREEDY
    )
    assert fitted.usage.prompt_tokens == MAX_MODEL_LEN - 4

    chat = client.chat.completions.create(messages=HELLO, max_tokens=2, extra_body=extra, **GREEDY)
    assert chat.prompt_token_ids == tokenize(plain, messages=HELLO)[-4:]
    body = {
        "messages": HELLO,
        "max_tokens": 2,
        "truncate_prompt_tokens": 4,
        "stream_options": {"include_usage": True},
    }
    assert sse_chunks(plain, CHAT, body)[-1]["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": MAX_MODEL_LEN - 1}, "truncate_prompt_tokens"),  # no room for 2
        ({"truncate_prompt_tokens": 5, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"truncation_side": "right"}, "truncation_side"),
        ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
    ],
)
def test_bad_truncation_gets_400_naming_it(plain: Server, body: dict, param: str):
    assert_refused(plain, COMPLETIONS, {"prompt": PROMPT, **body}, param)
    assert_refused(plain, CHAT, {"messages": HELLO, **body}, param)


# ---------------------------------------------------------------- sampling constraints


def one_token_word(server: Server, token_ids: list[int]) -> tuple[str, int]:
    """A word among ``token_ids`` that is one token (``"word"`` or ``" word"``), and the token."""
    for token in token_ids:
        text = detokenize(server, [token])
        word = text.strip()
        if word.isalpha() and tokenize(server, prompt=text, add_special_tokens=False) == [token]:
            return word, token
    raise AssertionError(f"no one-token word among {token_ids}")


def test_allowed_token_ids_and_bad_words_hold_streamed_or_not(plain: Server):
    client = plain.client()
    allowed = [
        tokenize(plain, prompt=w, add_special_tokens=False)[0]
        for w in (" red", " green", " blue", " pink")
    ]
    extra = {"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True}
    sampled = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.5,
        seed=1,
        n=2,
        extra_body=extra,
    )
    for choice in sampled.choices:
        assert len(choice.token_ids) == 12 and set(choice.token_ids) <= set(allowed)
    body = {"messages": HELLO, "max_tokens": 12, "temperature": 1.5, "seed": 2, **extra}
    [streamed] = streamed_token_ids(sse_chunks(plain, CHAT, body)).values()
    assert len(streamed) == 12 and set(streamed) <= set(allowed)

    # A word of the greedy answer, banned, is gone from it.
    plain_extra = {"return_token_ids": True, "ignore_eos": True}
    [greedy] = client.completions.create(
        prompt=PROMPT, max_tokens=8, extra_body=plain_extra, **GREEDY
    ).choices
    word, token = one_token_word(plain, greedy.token_ids)
    [clean] = client.completions.create(
        prompt=PROMPT, max_tokens=8, extra_body={**plain_extra, "bad_words": [word]}, **GREEDY
    ).choices
    assert token not in clean.token_ids
    body = {"messages": HELLO, "max_tokens": 8, "temperature": 0, **plain_extra}
    [chat_greedy] = streamed_token_ids(sse_chunks(plain, CHAT, body)).values()
    word, token = one_token_word(plain, chat_greedy)
    [chat_clean] = streamed_token_ids(
        sse_chunks(plain, CHAT, {**body, "bad_words": [word]})
    ).values()
    assert token not in chat_clean

    assert_refused(
        plain, COMPLETIONS, {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"
    )
    assert_refused(
        plain, CHAT, {"messages": HELLO, "allowed_token_ids": [10**7]}, "allowed_token_ids"
    )


def test_min_tokens_ignore_eos_and_skip_special_tokens_change_the_output(plain: Server):
    client = plain.client()
    forced_eos = {"logit_bias": {str(IM_END): 100}, "max_tokens": 6, **GREEDY}
    stops = client.completions.create(prompt=PROMPT, **forced_eos)
    assert (stops.usage.completion_tokens, stops.choices[0].finish_reason) == (1, "stop")
    held = client.chat.completions.create(
        messages=HELLO, extra_body={"min_tokens": 3, "return_token_ids": True}, **forced_eos
    )
    [reply] = held.choices
    assert reply.token_ids[-1] == IM_END and IM_END not in reply.token_ids[:3]
    assert len(reply.token_ids) == 4 and reply.finish_reason == "stop"
    ignored = client.completions.create(
        prompt=PROMPT, extra_body={"ignore_eos": True, "skip_special_tokens": False}, **forced_eos
    )
    assert (ignored.usage.completion_tokens, ignored.choices[0].finish_reason) == (6, "length")
    assert ignored.choices[0].text == "<|im_end|>" * 6

    forced_start = {"logit_bias": {str(IM_START): 100}, "max_tokens": 3, **GREEDY}
    skipped = client.chat.completions.create(messages=HELLO, **forced_start)
    assert skipped.choices[0].message.content == "" and skipped.usage.completion_tokens == 3
    body = {"messages": HELLO, "skip_special_tokens": False, **forced_start}
    chunks = sse_chunks(plain, CHAT, body)
    assert chat_text(chunks) == "<|im_start|>" * 3


def test_include_stop_str_in_output_keeps_the_stop_string(plain: Server):
    client = plain.client()
    kwargs = dict(prompt=PROMPT, max_tokens=16, extra_body={"ignore_eos": True}, **GREEDY)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    kept = text[: text.index(stop)] + stop
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop}
    included = {**body, "include_stop_str_in_output": True}
    assert plain.post(COMPLETIONS, json=included).json()["choices"][0]["text"] == kept
    chunks = sse_chunks(plain, COMPLETIONS, included)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == kept
    assert plain.post(COMPLETIONS, json=body).json()["choices"][0]["text"] == kept[: -len(stop)]


def test_spaces_between_special_tokens_join_or_separate_special_tokens(details: Server):
    """Only special tokens are allowed; the WordPiece decoder separates each from the next."""
    names = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
    extra = {
        "allowed_token_ids": [IM_START, IM_END],
        "skip_special_tokens": False,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    kwargs = dict(model=MODEL_NAME, prompt="Hi", max_tokens=6, temperature=1.0, seed=3)
    client = details.client()
    [spaced] = client.completions.create(extra_body=extra, **kwargs).choices
    [joined] = client.completions.create(
        extra_body={**extra, "spaces_between_special_tokens": False}, **kwargs
    ).choices
    tokens = [names[t] for t in spaced.token_ids]
    assert joined.token_ids == spaced.token_ids
    assert spaced.text == "".join(" " + name for name in tokens)
    assert joined.text == " " + "".join(tokens)
    body = {"messages": HELLO, "max_tokens": 6, "temperature": 1.0, "seed": 3, **extra}
    chunks = sse_chunks(details, CHAT, {**body, "spaces_between_special_tokens": False})
    [ids] = streamed_token_ids(chunks).values()
    assert chat_text(chunks) == " " + "".join(names[t] for t in ids)


# ---------------------------------------------------------------- request ids


def test_request_id_names_the_response_and_the_header_wins(plain: Server):
    client = plain.client()
    extra = {"request_id": "from-the-body"}
    out = client.completions.create(prompt="hi", max_tokens=1, extra_body=extra, **GREEDY)
    assert out.id == "cmpl-from-the-body"
    chat = client.chat.completions.create(messages=HELLO, max_tokens=1, extra_body=extra, **GREEDY)
    assert chat.id == "chatcmpl-from-the-body"
    both = client.completions.create(
        prompt="hi", max_tokens=1, extra_body=extra, extra_headers={"X-Request-Id": "hdr"}, **GREEDY
    )
    assert both.id == "cmpl-hdr"
    chunks = sse_chunks(plain, CHAT, {"messages": HELLO, "max_tokens": 2, **extra})
    assert {c["id"] for c in chunks} == {"chatcmpl-from-the-body"}


def test_concurrent_requests_sharing_an_id_are_each_served_their_own_output(plain: Server):
    prompts = ["Once upon a time", "In a galaxy far away", "The recipe needs", "def main():"]
    kwargs = dict(max_tokens=24, **GREEDY)
    client = plain.client()
    expected = [
        client.completions.create(prompt=p, extra_body={"ignore_eos": True}, **kwargs)
        .choices[0]
        .text
        for p in prompts
    ]

    async def one(client: openai.AsyncOpenAI, prompt: str, same: dict) -> tuple[str, str]:
        stream = await client.completions.create(prompt=prompt, stream=True, **same, **kwargs)
        ids, text = set(), ""
        async for chunk in stream:
            ids.add(chunk.id)
            text += "".join(c.text for c in chunk.choices)
        [id_] = ids
        return id_, text

    async def run_all() -> list[tuple[str, str]]:
        client = plain.async_client()
        body = {"extra_body": {"ignore_eos": True, "request_id": "shared"}}
        header = {"extra_body": {"ignore_eos": True}, "extra_headers": {"X-Request-Id": "shared"}}
        try:
            return await asyncio.gather(
                *(one(client, p, body if i % 2 else header) for i, p in enumerate(prompts))
            )
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert [text for _, text in results] == expected
    assert {id_ for id_, _ in results} == {"cmpl-shared"}
    state = plain.wait_idle()
    assert state["num_free_blocks"] == state["num_total_blocks"], state


# ---------------------------------------------------------------- usage


def test_continuous_usage_stats_put_each_choice_usage_on_every_chunk(plain: Server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {
        "prompt": ["One two three", "Four"],
        "n": 2,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": options,
    }
    chunks = sse_chunks(plain, COMPLETIONS, body)
    lengths = [len(tokenize(plain, prompt=p)) for p in body["prompt"]]
    *choice_chunks, last = chunks
    so_far: dict[int, int] = {}
    for chunk in choice_chunks:
        [choice] = chunk["choices"]
        index = choice["index"]
        so_far[index] = so_far.get(index, 0) + len(choice["token_ids"])
        prompt_tokens = lengths[index // 2]
        assert chunk["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": so_far[index],
            "total_tokens": prompt_tokens + so_far[index],
        }
    assert so_far == {0: 4, 1: 4, 2: 4, 3: 4}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16
    assert last["usage"]["prompt_tokens"] == sum(lengths)

    chat = sse_chunks(plain, CHAT, {"messages": HELLO, "max_tokens": 3, "stream_options": options})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["usage"]["completion_tokens"] for c in chat[1:-1]][-1] == 3
    assert chat[0]["usage"]["completion_tokens"] == 0 and all(c["usage"] for c in chat)

    without = {"continuous_usage_stats": True}
    assert_refused(
        plain,
        CHAT,
        {"messages": HELLO, "stream": True, "stream_options": without},
        "stream_options",
    )


def test_prompt_tokens_details_count_the_prefix_cache_hits(plain: Server, details: Server):
    client = details.client()
    prompt = "A long prompt the prefix cache keeps " * 8
    kwargs = dict(prompt=prompt, max_tokens=1, **GREEDY)

    def cached(**more: object) -> int:
        out = client.completions.create(**kwargs, **more)
        return out.usage.prompt_tokens_details.cached_tokens

    first = cached(extra_body={"cache_salt": "details-1"})
    again = cached(extra_body={"cache_salt": "details-1"})
    prompt_tokens = len(tokenize(details, prompt=prompt))
    assert first == 0 and 0 < again < prompt_tokens and again % 16 == 0

    messages = [{"role": "user", "content": prompt}]
    chat_kwargs = dict(messages=messages, max_tokens=1, **GREEDY)
    chats = [
        client.chat.completions.create(extra_body={"cache_salt": salt}, **chat_kwargs)
        for salt in ("chat-a", "chat-a", "chat-b")
    ]
    hits = [c.usage.prompt_tokens_details.cached_tokens for c in chats]
    assert hits[0] == hits[2] == 0 < hits[1]  # a new salt shares no block
    body = {
        "messages": messages,
        "max_tokens": 1,
        "cache_salt": "chat-a",
        "stream_options": {"include_usage": True},
    }
    assert sse_chunks(details, CHAT, body)[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": hits[1]
    }

    plain_out = plain.client().completions.create(**kwargs)
    assert plain_out.usage.prompt_tokens_details is None
