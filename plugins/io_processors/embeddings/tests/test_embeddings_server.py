"""``/v1/embeddings`` through a real ``pagellm serve`` of the packaged all-MiniLM-L6-v2 on
127.0.0.1 (its engine core in its own process), with the official ``openai`` client: parity with
sentence-transformers, the input shapes, base64, bad inputs, and the routes a pooling model does
not get."""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator

import numpy as np
import pytest
from transformers import AutoTokenizer

from servers import MODEL_NAME, Server, module_servers


def server_specs(request: pytest.FixtureRequest):
    endpoints = ("--endpoints", "openai,embeddings,admin", "--kv-cache-memory", str(64 << 20))
    return request.getfixturevalue("minilm_path"), {"minilm": ({}, endpoints)}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    with module_servers(request) as servers:
        yield servers["minilm"]


@pytest.fixture(scope="module")
def tokenizer(minilm_path: str):
    return AutoTokenizer.from_pretrained(minilm_path)


def _cosine(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_openai_client_embeddings_match_sentence_transformers(
    server: Server, minilm_reference: dict[str, list[float]], tokenizer
):
    client = server.client()
    sentences = list(minilm_reference)
    batch = client.embeddings.create(model=MODEL_NAME, input=sentences)  # base64 on the wire
    assert [d.index for d in batch.data] == list(range(len(sentences)))
    for data, sentence in zip(batch.data, sentences, strict=True):
        assert _cosine(data.embedding, minilm_reference[sentence]) >= 0.999
    tokens = sum(len(tokenizer(s)["input_ids"]) for s in sentences)
    assert (batch.usage.prompt_tokens, batch.usage.total_tokens) == (tokens, tokens)
    assert batch.model == MODEL_NAME
    single = client.embeddings.create(model=MODEL_NAME, input=sentences[2], encoding_format="float")
    assert len(single.data) == 1 and len(single.data[0].embedding) == 384
    assert np.allclose(single.data[0].embedding, batch.data[2].embedding, atol=1e-5)


def test_token_id_inputs_embed_as_their_text_does(server: Server, tokenizer):
    client = server.client()
    texts = ["A man is eating food.", "Hi"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    by_text = client.embeddings.create(model=MODEL_NAME, input=texts)
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids)
    one = client.embeddings.create(model=MODEL_NAME, input=ids[0])  # one list of ids: one input
    assert len(one.data) == 1
    assert np.allclose(one.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))


def test_base64_is_the_float_vectors_little_endian_bytes(server: Server):
    body = {"model": MODEL_NAME, "input": ["A man is eating food."]}
    floats = server.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    encoded = server.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == floats["data"][0]["embedding"]
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


def test_truncate_prompt_tokens_cuts_a_long_input_instead_of_refusing_it(server: Server):
    client = server.client()
    text = "word " * 600
    cut = client.embeddings.create(
        model=MODEL_NAME, input=text, extra_body={"truncate_prompt_tokens": 20}
    )
    assert cut.usage.prompt_tokens == 20


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": ""}, "input", "input[0] is an empty string"),
        ({"input": []}, "input", "input is an empty list"),
        ({"input": [[101, 102], "text"]}, "input", "input[1] must be a list of token ids"),
        ({"input": {"text": "x"}}, "input", "not dict"),
        ({"input": "word " * 600}, "input", "602 tokens long, more than max_model_len=512"),
        ({"input": [[101, 99999999]]}, "input", "outside the vocabulary"),
        ({"input": "x", "dimensions": 64}, "dimensions", "Matryoshka"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "positive"),
        ({"input": "x", "truncate_prompt_tokens": 9999}, "truncate_prompt_tokens", "more than"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "x", "temperature": 0.5}, "temperature", "Unknown parameter"),
        ({"input": ["x"] * 257}, "input", "at most 256"),
    ],
)
def test_bad_inputs_get_a_400_naming_the_field(server: Server, body, param, message):
    response = server.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_an_unknown_model_gets_404(server: Server):
    response = server.post("/v1/embeddings", json={"input": "x", "model": "gpt-4"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found", error


def test_the_server_stays_healthy_and_frees_every_block_after_bad_inputs(server: Server):
    mixed = {"model": MODEL_NAME, "input": ["fine", "word " * 600, "also fine"]}
    assert server.post("/v1/embeddings", json=mixed).status_code == 400
    assert server.get("/health").status_code == 200
    state = server.wait_idle()
    assert state["num_free_blocks"] == state["num_total_blocks"], state
    ok = server.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "still fine"})
    assert ok.status_code == 200, ok.text


def test_a_batch_of_many_inputs_runs_in_one_request(server: Server):
    """More inputs than the engine runs at once (--max-num-seqs 64): the rest wait their turn,
    and every vector comes back at its index."""
    inputs = [f"Sentence number {i} is about {'cats' if i % 2 else 'dogs'}." for i in range(200)]
    client = server.client()
    batch = client.embeddings.create(model=MODEL_NAME, input=inputs)
    assert [d.index for d in batch.data] == list(range(200))
    for i in (0, 77, 199):
        alone = client.embeddings.create(model=MODEL_NAME, input=inputs[i])
        assert np.allclose(alone.data[0].embedding, batch.data[i].embedding, atol=1e-5)


def test_a_pooling_model_gets_no_generation_routes(server: Server):
    for path, body in (
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi"}),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}),
    ):
        response = server.post(path, json=body)
        assert response.status_code == 404, response.text
        message = response.json()["error"]["message"]
        assert "'openai'" in message and "['embed']" in message, message
    models = server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert "Endpoint plugin 'openai' skipped: required_tasks ['generate']" in server.log()


def _metric(server: Server, name: str, labels: str = "") -> float:
    text = server.get("/metrics").text
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


def test_embeddings_count_in_the_prompt_token_and_request_metrics(server: Server):
    """Each input is a finished request (reason stop) whose prompt tokens count; no generation
    tokens."""
    success = ("pagellm:request_success_total", 'finished_reason="stop"')
    before = [_metric(server, "pagellm:prompt_tokens_total"), _metric(server, *success)]
    generated = _metric(server, "pagellm:generation_tokens_total")
    batch = server.client().embeddings.create(model=MODEL_NAME, input=["one", "two", "three"])
    deadline = time.monotonic() + 10  # the stats reach the loggers just after the response
    while _metric(server, *success) < before[1] + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "pagellm:prompt_tokens_total") - before[0] == batch.usage.prompt_tokens
    assert _metric(server, *success) - before[1] == 3
    assert _metric(server, "pagellm:generation_tokens_total") == generated
