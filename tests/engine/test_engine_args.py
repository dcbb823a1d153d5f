"""Engine arguments: one validation that names the flag, `--help` text from the fields'
docstrings, and a resolved `EngineConfig` that is complete, pickles and defines the sliding window
once for every reader."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import pickle
import shutil
import textwrap

import pytest

from pagellm import LLM, EngineArgs
from pagellm.attention import Attention
from pagellm.config import ConfigError
from pagellm.entrypoints.cli import main

ENGINE_FLAGS = {
    f.name: "--" + f.name.replace("_", "-")
    for f in dataclasses.fields(EngineArgs)
    if f.name != "model"
}


def field_docstrings() -> dict[str, str]:
    """The string literal under each field of `EngineArgs`, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(EngineArgs)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field, doc in zip(body, body[1:], strict=False):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr):
            docs[field.target.id] = inspect.cleandoc(doc.value.value)  # type: ignore[attr-defined]
    return docs


def test_every_engine_flag_has_help_taken_from_its_field_docstring():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    helps = {a.dest: a.help for a in parser._actions if a.dest in ENGINE_FLAGS}
    assert set(helps) == set(ENGINE_FLAGS)
    docs = field_docstrings()
    for name, text in helps.items():
        assert text and text.strip(), f"{ENGINE_FLAGS[name]} has no help"
        assert text == docs[name]


@pytest.mark.parametrize("command", [["serve", "model-dir"], ["generate"]])
def test_cli_help_lists_every_engine_flag_with_its_text(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in ENGINE_FLAGS.values():
        assert flag in out
    assert "Tokens per KV cache block (default: the attention backend's)." in out
    assert "--dtype {auto,float32,float16,bfloat16,float,half,fp32,fp16,bf16}" in out


def test_closed_sets_are_choices_on_the_command_line(capsys):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "pt"])
    assert "invalid choice: 'pt'" in capsys.readouterr().err
    args = parser.parse_args(["--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert args.max_num_seqs == 4 and args.enable_prefix_caching is False


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -4}, "max_num_batched_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"dtype": "float64"}, "dtype"),
        ({"load_format": "pt"}, "load_format"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ],
)
def test_bad_engine_argument_is_a_config_error_naming_the_value_and_the_flag(
    tiny_models, kwargs, name
):
    with pytest.raises(ConfigError) as info:
        LLM(tiny_models["llama3"], **kwargs)
    message = str(info.value)
    assert f"{name}={kwargs[name]!r}" in message
    assert ENGINE_FLAGS[name] in message
    assert isinstance(info.value, ValueError)  # what callers of LLM catch


def test_every_bad_argument_is_reported_at_once(tiny_models):
    with pytest.raises(ConfigError) as info:
        EngineArgs(tiny_models["llama3"], max_num_seqs=0, dtype="fp8").create_engine_config()
    assert "--max-num-seqs" in str(info.value) and "--dtype" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"max_model_len": 4096}, "max_position_embeddings=512"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
            "chunked prefill off",
        ),
        ({"device": "tpu"}, "device='tpu'"),
    ],
)
def test_checks_that_need_the_model_or_the_platform_raise_config_errors(tiny_models, kwargs, text):
    with pytest.raises(ConfigError, match=text):
        EngineArgs(tiny_models["llama3"], **kwargs).create_engine_config()


def test_resolved_config_is_complete_and_survives_pickling(tiny_models):
    config = EngineArgs(tiny_models["llama3"], max_model_len=64).create_engine_config()
    assert isinstance(config.cache.block_size, int) and config.cache.block_size > 0
    assert config.attention_backend == "TORCH_SDPA"
    assert config.scheduler.max_model_len == config.model.max_model_len == 64
    # What the engine-core process receives (multiprocessing pickles spawn arguments).
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config
    assert copy.model.hf_config.to_dict() == config.model.hf_config.to_dict()


def with_config_changes(model_dir: str, tmp_path, **changes) -> str:
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    path = target / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return str(target)


def test_sliding_window_is_one_value_for_backend_layers_and_kv_cache(tiny_models):
    llm = LLM(tiny_models["mistral"], max_model_len=64, kv_cache_memory=4 << 20)
    engine = llm.llm_engine
    assert engine.config.model.sliding_window == 8
    core = engine.engine_core
    assert core.executor.get_kv_cache_spec().sliding_window == 8
    model = core.executor.worker.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert layers and {layer.sliding_window for layer in layers} == {8}


@pytest.mark.parametrize(
    ("changes", "window"),
    [
        ({"use_sliding_window": False}, None),
        ({"layer_types": ["full_attention", "full_attention"]}, None),
        ({"layer_types": ["sliding_attention", "sliding_attention"]}, 8),
        ({"sliding_window": None}, None),
    ],
)
def test_sliding_window_follows_the_hf_config(tiny_models, tmp_path, changes, window):
    model = with_config_changes(tiny_models["mistral"], tmp_path, **changes)
    config = EngineArgs(model, max_model_len=64).create_engine_config()
    assert config.model.sliding_window == window


def test_models_mixing_window_and_full_layers_are_refused_when_configured(tiny_models, tmp_path):
    model = with_config_changes(
        tiny_models["mistral"], tmp_path, layer_types=["sliding_attention", "full_attention"]
    )
    with pytest.raises(NotImplementedError, match="mixing sliding-window and full-attention"):
        EngineArgs(model, max_model_len=64).create_engine_config()


def test_async_scheduling_follows_the_flag_else_the_platforms_default(tiny_models, monkeypatch):
    from pagellm.platforms import platforms

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args([]).async_scheduling is None
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False

    def resolved(**kwargs) -> bool:
        args = EngineArgs(tiny_models["llama3"], max_model_len=64, **kwargs)
        return args.create_engine_config().scheduler.async_scheduling

    assert resolved() is False  # the CPU platform's default (every platform's, for now)
    assert resolved(async_scheduling=True) is True
    monkeypatch.setattr(platforms.get("cpu"), "async_scheduling_default", True)
    assert resolved() is True
    assert resolved(async_scheduling=False) is False
