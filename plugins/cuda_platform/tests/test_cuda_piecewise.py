"""Piecewise CUDA graphs on the CUDA platform: granted beside the decode graphs where those are
on, refused with the reason where the platform leaves graphs off, and their memory set aside
before the KV cache is sized. The configuration and the arithmetic run anywhere; the tests
marked ``gpu`` measure on the device."""

from __future__ import annotations

import pytest
import torch
from pagellm_cuda.memory import PIECEWISE_OVERHEAD_PER_GRAPH, piecewise_reserve
from pagellm_cuda.platform import CudaPlatform

from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.config import ConfigError, EngineConfig
from pagellm.engine import compilation
from pagellm.engine.args import EngineArgs

GiB = 2**30
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class CapableBackend(TorchSDPABackend):
    """Stands in for a GPU backend with CUDA-graph support (none is installed on this machine)."""

    name = "PIECEWISE_TEST"
    supported_device_types = ("cuda",)
    cudagraph_support = True


@pytest.fixture
def capable_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    from pagellm.attention.registry import attention_backends

    # Registered for this test only, so no later selection sees it.
    entry = (f"{__name__}:CapableBackend", None)
    monkeypatch.setitem(attention_backends._entries, CapableBackend.name, entry)
    return CapableBackend.name


def on_cuda(model: str, backend: str | None, **kwargs) -> tuple[EngineConfig, EngineArgs]:
    """A config resolved here (the CPU platform), then looked at by the CUDA platform with
    ``backend`` as the chosen one, and the user's graph mode applied after it."""
    args = EngineArgs(model=model, max_model_len=64, kv_cache_memory=4 << 20, **kwargs)
    mode = args.cudagraph_mode
    args.cudagraph_mode = "auto"  # the CPU platform would refuse it: asked again below
    config = args.create_engine_config()
    args.cudagraph_mode = mode
    # On a GPU machine the platform resolved above is CUDA's, whose "auto" already added
    # piecewise graphs: start from no graphs, as the CPU platform leaves it.
    config.compilation.cudagraph_mode = "none"
    config.compilation.piecewise_capture_sizes = []
    if backend is not None:
        config.attention_backend = backend
    CudaPlatform.check_and_update_config(config)
    compilation.apply_cudagraph_mode(config, args, CudaPlatform)
    return config, args


def test_piecewise_graphs_join_the_decode_graphs(tiny_models, capable_backend):
    config, _ = on_cuda(
        tiny_models["llama3"],
        capable_backend,
        cudagraph_mode="decode_and_piecewise",
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    comp = config.compilation
    assert comp.cudagraph_mode == "decode_and_piecewise"
    assert comp.cudagraph_capture_sizes == [1, 2, 4, 8, 16]
    assert comp.piecewise_capture_sizes == [16, 32, 64, 128, 256, 384, 512]


def test_piecewise_is_on_by_default_and_off_with_decode(tiny_models, capable_backend):
    comp = on_cuda(tiny_models["llama3"], capable_backend, max_num_batched_tokens=512)[0]
    assert comp.compilation.cudagraph_mode == "decode_and_piecewise"
    assert comp.compilation.piecewise_capture_sizes == [16, 32, 64, 128, 256, 384, 512]
    comp = on_cuda(tiny_models["llama3"], capable_backend, cudagraph_mode="decode")[0]
    assert comp.compilation.cudagraph_mode == "decode"
    assert comp.compilation.piecewise_capture_sizes == []


def test_a_backend_without_graph_support_refuses_the_mode_and_says_which(tiny_models):
    with pytest.raises(ConfigError) as info:
        on_cuda(tiny_models["llama3"], None, cudagraph_mode="decode_and_piecewise")
    message = str(info.value)
    assert "attention backend TORCH_SDPA does not support them" in message
    assert "--attention-backend" in message


def test_piecewise_reserve_scales_the_activations_to_the_largest_size():
    assert piecewise_reserve(8 * GiB, 1024, 8192, 0) == 0
    assert piecewise_reserve(8 * GiB, 1024, 8192, 290) == (
        2 * GiB + 290 * PIECEWISE_OVERHEAD_PER_GRAPH
    )
    assert piecewise_reserve(GiB, 1024, 512, 1) == 2 * GiB + PIECEWISE_OVERHEAD_PER_GRAPH


@pytest.mark.gpu
@needs_cuda
def test_piecewise_graphs_leave_the_kv_cache_less_memory(tiny_models, capable_backend):
    """The same profiling run, with the graphs' estimate (decode, then decode and piecewise)
    taken off the KV cache's share."""
    CudaPlatform.device(0)
    budget = 512
    decode, _ = on_cuda(
        tiny_models["llama3"],
        capable_backend,
        cudagraph_mode="decode",  # the default (auto) adds piecewise graphs
        max_num_batched_tokens=budget,
    )
    both, _ = on_cuda(
        tiny_models["llama3"],
        capable_backend,
        cudagraph_mode="decode_and_piecewise",
        max_num_batched_tokens=budget,
    )
    for config in (decode, both):
        config.cache.kv_cache_memory = None
        config.cache.gpu_memory_utilization = 0.5

    def peak() -> None:
        torch.empty(GiB, dtype=torch.uint8, device="cuda").fill_(1)

    kv_decode = CudaPlatform.available_kv_cache_memory(decode, 0, peak)
    kv_both = CudaPlatform.available_kv_cache_memory(both, 0, peak)
    num_graphs = len(both.compilation.piecewise_capture_sizes) * (both.model.num_layers + 1)
    expected = piecewise_reserve(GiB, budget, budget, num_graphs)
    # Driver-side memory moves a little between two runs.
    assert abs((kv_decode - kv_both) - expected) < 160 << 20


@pytest.mark.gpu
@needs_cuda
def test_device_memory_used_counts_a_new_allocation():
    CudaPlatform.device(0)
    before = CudaPlatform.device_memory_used()
    block = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    after = CudaPlatform.device_memory_used()
    assert before is not None and after is not None
    assert abs((after - before) - GiB) < 64 << 20
    del block
