"""``--cudagraph-mode`` and ``--piecewise-capture-sizes``: the names taken, the defaults, and
the requests refused with a message that says why and what to do (with --enforce-eager, for a
pooling model, on a platform that records no graphs). A CPU platform that claims to record
graphs stands in for a GPU one where the mode must be granted; the CUDA platform's own cases
(a backend without graph support) are in plugins/cuda_platform/tests."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch

import pagellm.platforms
from pagellm import EngineArgs
from pagellm.config import ConfigError, EngineConfig
from pagellm.engine.compilation import DEFAULT_PIECEWISE_CAPTURE_SIZES, piecewise_capture_sizes
from pagellm.platforms.cpu import CpuPlatform


class GraphPlatform(CpuPlatform):
    """Turns decode graphs on unless told not to, as the CUDA platform does."""

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        if not config.compilation.enforce_eager:
            config.compilation.cudagraph_mode = "decode"
            config.compilation.cudagraph_capture_sizes = [1, 2, 4]

    @classmethod
    def capture_graph(
        cls, forward: Callable[[], torch.Tensor], pool: object
    ) -> tuple[Callable[[], None], torch.Tensor]:
        raise AssertionError("configuration only: nothing is captured")


@pytest.fixture
def graph_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagellm.platforms, "_current", ("cpu", GraphPlatform))


def config(model: str, **kwargs) -> EngineConfig:
    return EngineArgs(model, max_model_len=64, **kwargs).create_engine_config()


def test_the_flags_take_the_mode_names_and_a_list_of_sizes(capsys):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args([])
    assert args.cudagraph_mode == "auto" and args.piecewise_capture_sizes is None
    args = parser.parse_args(
        ["--cudagraph-mode", "decode_and_piecewise", "--piecewise-capture-sizes", "32", "128"]
    )
    engine_args = EngineArgs.from_cli_args(argparse.Namespace(model="m", **vars(args)))
    assert engine_args.cudagraph_mode == "decode_and_piecewise"
    assert engine_args.piecewise_capture_sizes == [32, 128]
    with pytest.raises(SystemExit):
        parser.parse_args(["--cudagraph-mode", "full"])
    assert "invalid choice: 'full'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"cudagraph_mode": "piecewise"}, "cudagraph_mode='piecewise' (--cudagraph-mode)"),
        ({"cudagraph_mode": "decode_and_piecewise", "piecewise_capture_sizes": [0]}, "0"),
        ({"enforce_eager": True, "cudagraph_mode": "decode_and_piecewise"}, "--enforce-eager"),
        ({"enforce_eager": True, "cudagraph_mode": "decode"}, "drop one of them"),
        ({"cudagraph_mode": "none", "piecewise_capture_sizes": [64]}, "and it is 'none'"),
        ({"cudagraph_mode": "decode", "piecewise_capture_sizes": [64]}, "and it is 'decode'"),
        ({"enforce_eager": True, "piecewise_capture_sizes": [64]}, "--enforce-eager) is set"),
    ],
)
def test_contradictory_or_unknown_requests_are_refused(tiny_models, graph_platform, kwargs, text):
    with pytest.raises(ConfigError) as info:
        config(tiny_models["llama3"], **kwargs)
    assert text in str(info.value)


@pytest.mark.parametrize("mode", ["decode", "decode_and_piecewise"])
def test_a_platform_that_records_no_graphs_refuses_graph_modes(tiny_models, mode):
    with pytest.raises(ConfigError) as info:
        config(tiny_models["llama3"], cudagraph_mode=mode)
    message = str(info.value)
    assert f"cudagraph_mode={mode!r} (--cudagraph-mode) needs CUDA graphs" in message
    assert "platform cpu records no graphs" in message
    assert "--cudagraph-mode auto or none" in message


def test_auto_and_none_leave_the_cpu_eager(tiny_models, caplog):
    for mode in ("auto", "none"):
        comp = config(tiny_models["llama3"], cudagraph_mode=mode).compilation
        assert comp.cudagraph_mode == "none" and comp.piecewise_capture_sizes == []
    with caplog.at_level("INFO", logger="pagellm"):
        comp = config(tiny_models["llama3"], piecewise_capture_sizes=[32]).compilation
    assert comp.cudagraph_mode == "none" and comp.piecewise_capture_sizes == []
    assert "--piecewise-capture-sizes) unused: platform cpu left CUDA graphs off" in caplog.text


def test_piecewise_joins_the_decode_graphs_by_default_and_decode_keeps_them_alone(
    tiny_models, graph_platform
):
    budget = 8192
    defaults = [s for s in DEFAULT_PIECEWISE_CAPTURE_SIZES if s <= budget]
    for mode in ("auto", "decode_and_piecewise"):
        comp = config(
            tiny_models["llama3"], cudagraph_mode=mode, max_num_batched_tokens=budget
        ).compilation
        assert comp.cudagraph_mode == "decode_and_piecewise"
        assert comp.cudagraph_capture_sizes == [1, 2, 4]  # the platform's decode graphs stay
        assert comp.piecewise_capture_sizes == defaults and defaults[-1] == budget
    comp = config(tiny_models["llama3"], cudagraph_mode="decode").compilation
    assert comp.cudagraph_mode == "decode" and comp.piecewise_capture_sizes == []
    comp = config(
        tiny_models["llama3"],
        cudagraph_mode="decode_and_piecewise",
        piecewise_capture_sizes=[256, 32, 32],
        max_num_batched_tokens=256,
    ).compilation
    assert comp.piecewise_capture_sizes == [32, 256]
    comp = config(tiny_models["llama3"], piecewise_capture_sizes=[64]).compilation  # auto
    assert comp.cudagraph_mode == "decode_and_piecewise" and comp.piecewise_capture_sizes == [64]


def test_none_turns_graphs_off_like_enforce_eager(tiny_models, graph_platform):
    comp = config(tiny_models["llama3"], cudagraph_mode="none").compilation
    assert comp.enforce_eager and comp.cudagraph_mode == "none"
    assert comp.cudagraph_capture_sizes == [] and comp.piecewise_capture_sizes == []


def test_sizes_above_the_token_budget_or_none_at_all_are_refused(tiny_models, graph_platform):
    with pytest.raises(ConfigError, match=r"\[512\] .* exceed max_num_batched_tokens=256"):
        config(
            tiny_models["llama3"],
            cudagraph_mode="decode_and_piecewise",
            piecewise_capture_sizes=[64, 512],
            max_num_batched_tokens=256,
        )
    with pytest.raises(ConfigError, match="names no size"):
        config(
            tiny_models["llama3"], cudagraph_mode="decode_and_piecewise", piecewise_capture_sizes=[]
        )


def test_a_pooling_model_refuses_graph_modes(minilm_path, graph_platform):
    with pytest.raises(ConfigError, match="a pooling model's steps always run eagerly"):
        config(minilm_path, cudagraph_mode="decode_and_piecewise")
    assert config(minilm_path).compilation.cudagraph_mode == "none"


def test_default_sizes_stop_at_the_token_budget_which_is_captured_itself():
    assert piecewise_capture_sizes(None, 16384) == list(DEFAULT_PIECEWISE_CAPTURE_SIZES)
    assert piecewise_capture_sizes(None, 8192)[-4:] == [3072, 4096, 6144, 8192]
    assert piecewise_capture_sizes(None, 5000)[-3:] == [3072, 4096, 5000]
    # Above the largest default size, larger steps run eagerly: no graph of their size.
    assert piecewise_capture_sizes(None, 65536) == list(DEFAULT_PIECEWISE_CAPTURE_SIZES)
    assert piecewise_capture_sizes(None, 600) == [16, 32, 64, 128, 256, 384, 512, 600]
    assert piecewise_capture_sizes(None, 64) == [16, 32, 64]
    assert piecewise_capture_sizes(None, 10) == [10]
