"""The IO processor contract (`pagellm.io_processors`): which processor a model runs with
(``--io-processor``, else config.json's ``io_processor_plugin``), the error naming the installed
ones, the four stages around a real engine, the async defaults and the HTTP 400 of bad input."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagellm import LLM, SamplingParams
from pagellm.config import ConfigError
from pagellm.engine.args import EngineArgs
from pagellm.entrypoints.http_errors import install_error_handlers
from pagellm.io_processors import IOProcessor, IOProcessorInputError, io_processors

DUMMY_FRONTEND = Path(__file__).parents[1] / "plugins" / "dummy_frontend"
UPPER = "pagellm_dummy_frontend.processors:UpperTextProcessor"


class TokenIdsProcessor(IOProcessor[list[int], Any]):
    """Input only: a list of token ids is one prompt; the outputs keep the base's defaults."""

    def parse_request(self, request: Any) -> list[int]:
        return list(request)

    def pre_process(self, data: list[int]) -> list[Any]:
        return [data]


@pytest.fixture
def upper_registered(monkeypatch) -> str:
    """The dummy front-end plugin's processor, importable without installing the package (its
    entry point is covered by tests/plugins/test_plugins.py), registered as ``test_upper``."""
    monkeypatch.syspath_prepend(str(DUMMY_FRONTEND))
    io_processors.register("test_upper", UPPER)
    return "test_upper"


def _with_config_field(source: str, target: Path, **fields: Any) -> str:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def test_a_missing_io_processor_is_refused_listing_the_installed_ones(
    tiny_models, tmp_path, upper_registered
):
    with pytest.raises(ConfigError) as flag:
        EngineArgs(tiny_models["llama3"], io_processor="nope").create_engine_config()
    message = str(flag.value)
    assert "'nope'" in message and "--io-processor" in message
    assert "installed: " in message and "test_upper" in message
    model = _with_config_field(tiny_models["llama3"], tmp_path / "m", io_processor_plugin="gone")
    with pytest.raises(ConfigError, match="'gone' .*config.json's io_processor_plugin"):
        EngineArgs(model).create_engine_config()


def test_the_flag_overrides_the_model_config_and_no_name_means_none(
    tiny_models, tmp_path, upper_registered
):
    io_processors.register("test_upper_too", UPPER)
    model = _with_config_field(tiny_models["llama3"], tmp_path / "m", io_processor_plugin="gone")
    config = EngineArgs(model, io_processor="test_upper_too").create_engine_config()
    assert config.model.io_processor == "test_upper_too"
    assert EngineArgs(tiny_models["llama3"]).create_engine_config().model.io_processor is None


def test_the_front_end_builds_the_config_named_processor_and_its_stages_run_around_the_engine(
    tiny_models, tmp_path, upper_registered
):
    model = _with_config_field(
        tiny_models["llama3"], tmp_path / "m", io_processor_plugin=upper_registered
    )
    llm = LLM(model, max_model_len=64, kv_cache_memory=4 << 20)
    processor = llm.llm_engine.io_processor
    assert type(processor).__name__ == "UpperTextProcessor"
    assert processor.config is llm.llm_engine.config and processor.tokenizer is llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    data = processor.parse_request({"texts": ["a b c", "b c"]})
    outputs = llm.generate(processor.pre_process(data), params, use_tqdm=False)
    response = processor.output_to_response(processor.post_process(outputs, data))
    upper = llm.generate(["A B C", "B C"], params, use_tqdm=False)
    lower = llm.generate(["a b c", "b c"], params, use_tqdm=False)
    assert response == {"completions": [o.outputs[0].text for o in upper]}
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in upper]
    assert [o.prompt_token_ids for o in outputs] != [o.prompt_token_ids for o in lower]
    with pytest.raises(IOProcessorInputError, match="texts must be") as bad:
        processor.parse_request({"texts": [""]})
    assert bad.value.param == "texts"


def test_async_stages_default_to_the_sync_ones_and_outputs_default_to_completions(smollm2_llm):
    processor = TokenIdsProcessor(smollm2_llm.llm_engine.config, None)

    async def stages() -> tuple[Any, Sequence[Any]]:
        data = await processor.parse_request_async((5, 6, 7))
        return data, await processor.pre_process_async(data)

    data, prompts = asyncio.run(stages())
    assert data == [5, 6, 7] and prompts == [[5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    result = asyncio.run(processor.post_process_async(outputs, data))
    assert result == outputs
    [entry] = processor.output_to_response(result)["outputs"]
    assert entry["prompt_token_ids"] == [5, 6, 7]
    [completion] = entry["completions"]
    assert completion["token_ids"] == list(outputs[0].outputs[0].token_ids)
    assert completion["text"] == outputs[0].outputs[0].text
    assert completion["finish_reason"] == "length"


def test_an_io_processor_input_error_is_an_http_400_naming_its_param():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/parse")
    async def parse() -> None:
        raise IOProcessorInputError("image 0 is not a PNG, JPEG, GIF or WebP.", "messages")

    response = TestClient(app).post("/parse")
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "image 0 is not a PNG, JPEG, GIF or WebP.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }
