"""The ``embeddings`` IO processor offline: chosen by ``io_processor="embeddings"``, its stages
around `LLM.embed`, and the shapes it refuses; it refuses a generative model."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest
from pagellm_io_embeddings.processor import EmbeddingsProcessor

from pagellm import LLM
from pagellm.config import ConfigError
from pagellm.engine.args import EngineArgs
from pagellm.io_processors import IOProcessorInputError, build_io_processor


@pytest.fixture(scope="module")
def llm(minilm_path: str) -> LLM:
    return LLM(minilm_path, io_processor="embeddings", kv_cache_memory=32 << 20)


def test_the_stages_around_llm_embed_make_openai_embeddings(llm: LLM):
    io = llm.llm_engine.io_processor
    assert isinstance(io, EmbeddingsProcessor)
    data = io.parse_request(
        {"input": ["A man is eating food.", "Hi"], "encoding_format": "base64", "model": "m"}
    )
    outputs = llm.embed(io.pre_process(data), data.params, use_tqdm=False)
    response = io.output_to_response(io.post_process(outputs, data))
    assert [d["index"] for d in response["data"]] == [0, 1]
    first = np.frombuffer(base64.b64decode(response["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(first, outputs[0].outputs.embedding)
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    assert response["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert response["model"] == "m"


@pytest.mark.parametrize(
    ("request_body", "param", "message"),
    [
        ({"input": [5, True]}, "input", "input[0] must be a string or a list"),
        ({"input": [[1], []]}, "input", "input[1] is an empty list of token ids"),
        ({"input": ["a", ""]}, "input", "input[1] is an empty string"),
        ({"input": 3}, "input", "not int"),
        ({}, "input", "Field required"),
        ({"input": "a", "dimensions": 8}, "dimensions", "Matryoshka"),
        ({"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "-1 or"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(llm: LLM, request_body, param, message):
    with pytest.raises(IOProcessorInputError, match=re.escape(message)) as refused:
        llm.llm_engine.io_processor.parse_request(request_body)
    assert refused.value.param == param


def test_a_generative_model_cannot_take_the_embeddings_processor(tiny_models):
    config = EngineArgs(tiny_models["llama3"], io_processor="embeddings").create_engine_config()
    with pytest.raises(ValueError, match="needs a model served by the pooling runner"):
        build_io_processor(config, None)
    with pytest.raises(ConfigError, match="'nope'.*installed: .*embeddings"):
        EngineArgs(tiny_models["llama3"], io_processor="nope").create_engine_config()
