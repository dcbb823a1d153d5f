"""``--generation-config`` (vLLM's): the sampling values of the model's generation_config.json are
the defaults of requests that leave them unset; ``vllm`` ignores the file, a directory reads
another one, ``--override-generation-config`` sets values over both; bad values are refused at
config time. The OpenAI endpoints' use of them is tested with the API server
(tests/entrypoints/test_api_server.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import ConfigError
from pagellm.engine.generation_defaults import resolve_default_sampling

# A Llama 3 Instruct style file: sampling values, token ids and flags that are not read.
LLAMA3_STYLE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "transformers_version": "5.0.0",
}


def _with_generation_config(directory: Path, **values: object) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(values))
    return directory


def test_the_six_sampling_keys_of_the_file_become_defaults(tmp_path: Path):
    _with_generation_config(tmp_path, **LLAMA3_STYLE, min_p=0.05, max_new_tokens=64)
    assert resolve_default_sampling("auto", None, str(tmp_path)) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "max_tokens": 64,
    }


def test_vllm_ignores_the_file_and_a_directory_reads_its_own(tmp_path: Path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    _with_generation_config(model, **LLAMA3_STYLE)
    _with_generation_config(other, temperature=0.2, repetition_penalty=1.1)
    assert resolve_default_sampling("vllm", None, str(model)) == {}
    assert resolve_default_sampling(str(other), None, str(model)) == {
        "temperature": 0.2,
        "repetition_penalty": 1.1,
    }
    assert resolve_default_sampling("auto", None, str(other / "missing")) == {}
    with pytest.raises(ConfigError, match=r"--generation-config\): no generation_config.json"):
        resolve_default_sampling(str(tmp_path / "missing"), None, str(model))


def test_overrides_set_over_the_file_and_bad_ones_are_refused(tmp_path: Path):
    _with_generation_config(tmp_path, **LLAMA3_STYLE)
    merged = resolve_default_sampling(
        "auto", {"temperature": 0.0, "max_new_tokens": 5}, str(tmp_path)
    )
    assert merged == {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "max_tokens": 5}
    with pytest.raises(ConfigError, match=r"keys \['seed'\] are not sampling defaults"):
        resolve_default_sampling("auto", {"seed": 3}, str(tmp_path))
    with pytest.raises(ConfigError, match="temperature must be >= 0, got -1"):
        resolve_default_sampling("vllm", {"temperature": -1}, str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a list, not a JSON object"):
        resolve_default_sampling("auto", None, str(tmp_path))


@pytest.fixture
def greedy_five_model(tiny_models: dict[str, str], tmp_path: Path) -> str:
    """The tiny Llama, its generation config asking for greedy decoding of 5 tokens."""
    model = Path(shutil.copytree(tiny_models["llama3"], tmp_path / "llama3"))
    _with_generation_config(model, temperature=0.0, max_new_tokens=5)
    return str(model)


ENGINE = dict(max_model_len=64, kv_cache_memory=4 << 20)


def test_llm_without_sampling_params_takes_the_models_defaults(greedy_five_model: str):
    llm = LLM(greedy_five_model, **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    [implicit] = llm.generate([[5, 6, 7]], use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    [explicit] = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    assert len(implicit.outputs[0].token_ids) <= 5
    assert implicit.outputs[0].token_ids == explicit.outputs[0].token_ids
    # Explicit parameters are taken as they are: SamplingParams' own max_tokens of 16.
    [own] = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert len(own.outputs[0].token_ids) == 16


def test_generation_config_vllm_keeps_the_apis_defaults(greedy_five_model: str):
    llm = LLM(greedy_five_model, generation_config="vllm", **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams()
