"""The pooling runner end to end, offline: the packaged all-MiniLM-L6-v2 (BertModel, non-causal
attention, mean pooling, normalized) through `LLM.embed`, checked against sentence-transformers
on the same sentences."""

from __future__ import annotations

import numpy as np
import pytest

from pagellm import LLM
from pagellm.pooling_params import PoolingParams


@pytest.fixture(scope="module")
def embedder(minilm_path: str) -> LLM:
    return LLM(minilm_path, kv_cache_memory=64 << 20)


def _cosines(outputs, reference: dict[str, list[float]]) -> list[float]:
    ours = np.array([o.outputs.embedding for o in outputs])
    theirs = np.array(list(reference.values()))
    norms = np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
    return list((ours * theirs).sum(axis=1) / norms)


def test_embeddings_match_sentence_transformers_in_one_batch(
    embedder: LLM, minilm_reference: dict[str, list[float]]
):
    outputs = embedder.embed(list(minilm_reference), use_tqdm=False)
    assert [o.prompt for o in outputs] == list(minilm_reference)
    assert min(_cosines(outputs, minilm_reference)) >= 0.999
    for output in outputs:
        assert output.finished and output.finish_reason == "stop"
        assert output.outputs.hidden_size == 384
        assert abs(np.linalg.norm(output.outputs.embedding) - 1.0) < 1e-5  # Normalize module


def test_a_sentence_embeds_the_same_alone_as_in_a_batch(
    embedder: LLM, minilm_reference: dict[str, list[float]]
):
    sentences = list(minilm_reference)
    batch = embedder.embed(sentences, use_tqdm=False)
    alone = embedder.embed(sentences[1], use_tqdm=False)[0]
    assert np.allclose(alone.outputs.embedding, batch[1].outputs.embedding, atol=1e-5)
    ids = embedder.get_tokenizer().encode(sentences[1])
    by_ids = embedder.embed({"prompt_token_ids": ids}, use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == ids
    assert np.allclose(by_ids.outputs.embedding, alone.outputs.embedding, atol=1e-6)


def test_normalize_false_returns_the_mean_pooled_vector(embedder: LLM):
    sentence = "A man is eating food."
    raw = embedder.embed(sentence, PoolingParams(normalize=False), use_tqdm=False)[0]
    unit = embedder.embed(sentence, use_tqdm=False)[0]
    norm = np.linalg.norm(raw.outputs.embedding)
    assert norm > 1.5  # MiniLM's mean-pooled states are far from unit length
    assert np.allclose(np.array(raw.outputs.embedding) / norm, unit.outputs.embedding, atol=1e-6)


def test_long_prompts_are_refused_unless_truncation_is_asked(embedder: LLM):
    text = "word " * 600  # 602 tokens with [CLS] and [SEP]; max_model_len is 512
    with pytest.raises(ValueError, match="602 tokens long, more than max_model_len=512"):
        embedder.embed([text, "short"], use_tqdm=False)
    cut = embedder.embed(text, truncate_prompt_tokens=16, use_tqdm=False)[0]
    tokenizer = embedder.get_tokenizer()
    assert cut.prompt_token_ids == tokenizer(text, truncation=True, max_length=16)["input_ids"]
    assert cut.prompt_token_ids[0] == tokenizer.cls_token_id  # BERT truncates on the right
    assert cut.prompt_token_ids[-1] == tokenizer.sep_token_id
    whole = embedder.embed(text, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(whole.prompt_token_ids) == 512  # -1: max_model_len, the full context
    ids = list(range(1000, 1600))
    assert (
        embedder.embed([ids], truncate_prompt_tokens=8, use_tqdm=False)[0].prompt_token_ids
        == ids[-8:]
    )


def test_a_pooling_model_refuses_to_generate_and_dimensions(embedder: LLM):
    with pytest.raises(ValueError, match="pooling runner .*generates no text.*LLM.embed"):
        embedder.generate("Hello")
    with pytest.raises(ValueError, match="pooling runner"):
        embedder.chat([{"role": "user", "content": "Hello"}])
    with pytest.raises(ValueError, match="Matryoshka") as refused:
        embedder.embed("Hello", PoolingParams(dimensions=64), use_tqdm=False)
    assert refused.value.param == "dimensions"  # type: ignore[attr-defined]
    assert not embedder.llm_engine.has_unfinished_requests()


def test_asynchronous_scheduling_embeds_each_prompt_once(
    minilm_path: str, minilm_reference: dict[str, list[float]]
):
    """With one step in flight, a pooling request (scheduled whole, its result not back yet)
    must not be scheduled again; every request ends once, with its vector. (The engine-core
    process boundary is crossed by the server tests of pagellm-io-embeddings.)"""
    llm = LLM(minilm_path, kv_cache_memory=64 << 20, runner="pooling", async_scheduling=True)
    core = llm.llm_engine.engine_core
    outputs = llm.embed(list(minilm_reference) * 2, use_tqdm=False)
    assert min(_cosines(outputs[: len(minilm_reference)], minilm_reference)) >= 0.999
    assert (
        core.make_scheduler_stats().num_free_blocks
        == core.kv_cache_manager.block_pool.num_blocks - 1
    )
