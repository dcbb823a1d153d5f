"""The ROCm platform on a real engine config: decode graphs, KV-cache sizing, what it refuses
(an fp8 KV cache where the GPU does not compute in float8_e4m3fn, fp8 GEMMs where it has no fp8),
and the fp8 format pagellm-fp8 takes from it (float8_e4m3fnuz on gfx94x).

No AMD GPU exists where these run: the GPU's architecture comes from a stand-in ``amdsmi`` and a
faked ``torch.version.hip`` (`pagellm_rocm.fake_hardware`'s); the configs, the platform's rules and
pagellm-fp8's choices are the real code.
"""

from __future__ import annotations

import sys

import pytest
import torch
from pagellm_cuda.platform import CudaPlatform
from pagellm_fp8.config import Fp8Config, Fp8PerChannelConfig
from pagellm_rocm import detection
from pagellm_rocm.fake_hardware import HIP_VERSION, stand_in_amdsmi
from pagellm_rocm.platform import RocmPlatform

import pagellm.platforms
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.config import ConfigError, EngineConfig
from pagellm.engine.args import EngineArgs


def fake_gpus(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """A ROCm build of torch on a machine with one AMD GPU of ``arch``."""
    monkeypatch.setattr(torch.version, "hip", HIP_VERSION)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setitem(sys.modules, "amdsmi", stand_in_amdsmi([arch]))
    for var in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    detection.physical_gpus.cache_clear()
    monkeypatch.setattr(pagellm.platforms, "_current", ("rocm", RocmPlatform))


@pytest.fixture(autouse=True)
def forget_gpus():
    yield
    detection.physical_gpus.cache_clear()


class HipGraphCapableBackend(TorchSDPABackend):
    """Stands in for TRITON_ATTN (which needs a GPU to be selected) with CUDA-graph support."""

    name = "HIPGRAPH_TEST"
    supported_device_types = ("cuda",)
    cudagraph_support = True


def engine_config(model: str, **kwargs) -> EngineConfig:
    return EngineArgs(
        model=model, max_model_len=64, kv_cache_memory=4 << 20, **kwargs
    ).create_engine_config()


def test_decode_graphs_are_captured_through_the_cuda_graph_api(monkeypatch, tiny_models, caplog):
    from pagellm.attention.registry import attention_backends

    entry = (f"{__name__}:HipGraphCapableBackend", None)
    monkeypatch.setitem(attention_backends._entries, HipGraphCapableBackend.name, entry)
    fake_gpus(monkeypatch, "gfx942")
    config = engine_config(tiny_models["llama3"], max_num_seqs=20)
    config.attention_backend = HipGraphCapableBackend.name
    RocmPlatform.check_and_update_config(config)
    assert config.compilation.cudagraph_mode == "decode"
    assert config.compilation.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 20]
    # Recorded and replayed by the CUDA platform's code: torch.cuda.CUDAGraph is a HIP graph.
    for method in ("graph_pool", "capture_graph", "available_kv_cache_memory", "copy_to_host"):
        assert getattr(RocmPlatform, method).__func__ is getattr(CudaPlatform, method).__func__


@pytest.mark.parametrize(
    ("arch", "refused"),
    [("gfx942", "has float8_e4m3fnuz"), ("gfx1100", "has no fp8"), ("gfx950", None)],
)
def test_fp8_kv_cache_only_where_the_gpu_computes_in_e4m3fn(
    monkeypatch, tiny_models, arch, refused
):
    fake_gpus(monkeypatch, arch)
    config = engine_config(tiny_models["llama3"])
    config.cache.cache_dtype = "fp8_e4m3"
    if refused is None:
        RocmPlatform.check_and_update_config(config)
        return
    with pytest.raises(ConfigError) as err:
        RocmPlatform.check_and_update_config(config)
    assert refused in str(err.value) and "--kv-cache-dtype auto" in str(err.value)
    assert f"this {arch}" in str(err.value)


def test_explicit_kv_cache_memory_skips_profiling(tiny_models):
    config = engine_config(tiny_models["llama3"])

    def profile_run() -> None:
        raise AssertionError("profiling must not run when kv_cache_memory is set")

    assert RocmPlatform.available_kv_cache_memory(config, 1 << 20, profile_run) == 4 << 20


@pytest.mark.parametrize(
    ("arch", "capability", "fp8"),
    [
        ("gfx942", (9, 4), torch.float8_e4m3fnuz),
        ("gfx90a", (9, 0), None),
        ("gfx950", (9, 5), torch.float8_e4m3fn),
    ],
)
def test_fp8_gemms_take_the_platforms_fp8_format(monkeypatch, arch, capability, fp8):
    """pagellm-fp8 asks the current platform's `fp8_dtype`: its layers compute in float8_e4m3fnuz
    on CDNA3 and float8_e4m3fn on CDNA4 (through ``torch._scaled_mm`` and its Triton kernels,
    never run on AMD); GPUs without fp8 are refused with the reason."""
    fake_gpus(monkeypatch, arch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for method in (Fp8Config, Fp8PerChannelConfig):
        refusal = method.platform_refusal("cuda", torch.bfloat16)
        if fp8 is None:
            assert refusal is not None and "has no fp8 matrix instructions" in refusal
            continue
        assert refusal is None
        linear = method.from_config({}).get_linear_method("model.layers.0.mlp.down_proj")
        assert linear.scheme.fp8_dtype == fp8  # type: ignore[attr-defined]
