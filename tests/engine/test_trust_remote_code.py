"""``--trust-remote-code`` (vLLM's): a model directory's own configuration code (config.json's
``auto_map``) runs only when trusted; untrusted, the engine refuses it naming the flag. The
model is still pagellm's own implementation of the config's architecture."""

from __future__ import annotations

import json
import shutil

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.args import EngineArgs

REMOTE_CONFIG = '''
from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    """A config class transformers does not know: only this directory's code defines it."""

    model_type = "pagellm_remote_llama"
'''

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


@pytest.fixture(scope="module")
def remote_code_model(tiny_models, tmp_path_factory) -> str:
    """The tiny Llama's weights and tokenizer under a config only its own code can read."""
    root = tmp_path_factory.mktemp("remote_code") / "remote-llama"
    shutil.copytree(tiny_models["llama3"], root)
    config = json.loads((root / "config.json").read_text())
    config["model_type"] = "pagellm_remote_llama"
    config["auto_map"] = {"AutoConfig": "configuration_remote.RemoteLlamaConfig"}
    (root / "config.json").write_text(json.dumps(config))
    (root / "configuration_remote.py").write_text(REMOTE_CONFIG)
    return str(root)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_untrusted_code_is_refused_naming_the_flag(remote_code_model):
    with pytest.raises(ValueError, match="--trust-remote-code") as caught:
        EngineArgs(model=remote_code_model).create_engine_config()
    assert "auto_map" in str(caught.value)


def test_the_flag_is_parsed_from_the_command_line():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args([]).trust_remote_code is False
    assert parser.parse_args(["--trust-remote-code"]).trust_remote_code is True


def test_trusted_code_loads_and_generates_as_the_plain_model(remote_code_model, tiny_models):
    plain = LLM(tiny_models["llama3"], max_model_len=64, kv_cache_memory=8 << 20)
    expected = _tokens(plain)
    del plain
    llm = LLM(remote_code_model, max_model_len=64, kv_cache_memory=8 << 20, trust_remote_code=True)
    config = llm.llm_engine.config.model
    assert type(config.hf_config).__name__ == "RemoteLlamaConfig" and config.trust_remote_code
    assert llm.get_tokenizer() is not None
    assert _tokens(llm) == expected


def test_trusted_code_reaches_an_engine_core_process(remote_code_model, tiny_models):
    # The config object, an instance of the directory's own class, crosses the spawn boundary.
    llm = LLM(
        remote_code_model,
        max_model_len=64,
        kv_cache_memory=8 << 20,
        trust_remote_code=True,
        multiprocess_engine=True,
    )
    try:
        in_process = LLM(
            remote_code_model, max_model_len=64, kv_cache_memory=8 << 20, trust_remote_code=True
        )
        assert _tokens(llm) == _tokens(in_process)
    finally:
        llm.llm_engine.shutdown()
