"""pagellm-fp8 on a platform that computes in float8_e4m3fnuz (AMD CDNA3, gfx94x), on the CPU.

No such GPU exists here: the platform is the CPU platform reporting float8_e4m3fnuz as its
`Platform.fp8_dtype` (what `RocmPlatform` answers on gfx942), so the layers hold and compute in
fnuz through the reference path (dequantize, float32 matmul). What runs is the real code: online
quantization straight to fnuz (largest value 240), fp8 checkpoints (written by
compressed-tensors and in the Fp8Config format) converted at load with their scales doubled, and
activations quantized to fnuz. The fused Triton quantization kernels cannot store fnuz in
Triton's interpreter, so their fnuz rounding is checked on float32 outputs here, and they are
compiled for gfx942 in pagellm-rocm's tests (test_amd_kernels.py).
"""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import compressed_tensors_checkpoint, fp8_config_checkpoint, tiny_llama
from pagellm_fp8.gemm import gemm_refusal, reference_gemm
from pagellm_fp8.quant_ops import quantize_weight
from pagellm_fp8.scheme import Fp8Scheme
from safetensors.torch import load_file, save_file

import pagellm.platforms
from pagellm import LLM, SamplingParams
from pagellm.layers.linear import Linear
from pagellm.platforms.cpu import CpuPlatform
from pagellm.quantization.fp8_formats import Fp8ConversionError

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 300, 12], [700, 3, 18, 19, 20, 21]]
GEN_TOKENS = 16
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory=8 << 20, seed=0)


class FnuzCpuPlatform(CpuPlatform):
    """The CPU platform, answering float8_e4m3fnuz as the format its fp8 kernels compute in."""

    @classmethod
    def fp8_dtype(cls) -> torch.dtype | None:
        return FNUZ


@pytest.fixture
def fnuz_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagellm.platforms, "_current", ("cpu", FnuzCpuPlatform))


@pytest.fixture(scope="module")
def float_model(tmp_path_factory, smollm2_tokenizer_dir):
    return tiny_llama(tmp_path_factory.mktemp("fnuz") / "float", smollm2_tokenizer_dir)


def _linears(llm: LLM) -> dict[str, Linear]:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _run(path: str, **engine: object) -> tuple[dict[str, Linear], list[list[int]], list[list]]:
    """The layers, greedy tokens and, per generated token, its top-2 logprobs."""
    llm = LLM(path, **ENGINE, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    logprobs = [[sorted(lp.values(), key=lambda e: e.rank) for lp in o.logprobs] for o in outs]
    return _linears(llm), [list(o.token_ids) for o in outs], logprobs


def _both(path: str, monkeypatch: pytest.MonkeyPatch, **engine: object):
    """The run on a float8_e4m3fn platform (the CPU's), then the one on the fnuz platform."""
    fn = _run(path, **engine)
    monkeypatch.setattr(pagellm.platforms, "_current", ("cpu", FnuzCpuPlatform))
    return fn, _run(path, **engine)


def _greedy_agreement(fn_tokens: list[list[int]], fnuz_tokens: list[list[int]], fnuz_lp) -> None:
    """The same greedy tokens, up to the first place where fnuz's top two are a near tie."""
    for p, (a, b) in enumerate(zip(fn_tokens, fnuz_tokens, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            top = fnuz_lp[p][i]
            if top[0].logprob - top[1].logprob < 0.05:
                break
            assert x == y, (p, i, a, b)


# ---------------------------------------------------------------------- reference path


def test_gpus_computing_in_fnuz_are_let_through_and_other_formats_refused():
    assert gemm_refusal("channel", "cuda", torch.bfloat16, (9, 4), platform_fp8=FNUZ) is None
    e5m2 = gemm_refusal("tensor", "cuda", torch.bfloat16, (9, 4), platform_fp8=torch.float8_e5m2)
    assert e5m2 is not None and "computes fp8 in float8_e5m2" in e5m2


@pytest.mark.parametrize(
    "scheme",
    [Fp8Scheme("tensor", "tensor"), Fp8Scheme("channel", "token"), Fp8Scheme("block", "group")],
)
def test_reference_gemm_in_fnuz_is_the_float_product_within_fp8_error(scheme):
    torch.manual_seed(0)
    x, w = torch.randn(7, 256), torch.randn(384, 256) * 0.05
    q, scale = quantize_weight(w, scheme.weights, FNUZ)
    assert q.dtype == FNUZ and q.float().abs().max() == 240.0  # fnuz's largest value
    fnuz = Fp8Scheme(scheme.weights, scheme.activations, fp8_dtype=FNUZ)
    out = reference_gemm(fnuz)(x, q, scale, None)
    exact = x @ w.t()
    rel = (out - exact).norm() / exact.norm()
    assert 0 < rel < 0.06, rel


# ---------------------------------------------------------------------- online quantization


@pytest.mark.parametrize("method", ["fp8", "fp8_per_channel", "fp8_per_block"])
def test_online_quantization_writes_fnuz_and_keeps_greedy_parity(method, float_model, monkeypatch):
    (fn_layers, fn_tokens, _), (layers, tokens, logprobs) = _both(
        str(float_model), monkeypatch, quantization=method
    )
    for name, layer in layers.items():
        weight, scale = layer.weight, layer.weight_scale
        assert weight.dtype == FNUZ, name
        assert weight.float().abs().max() == 240.0  # the largest |w| of a scale's group is 240
        assert not torch.isnan(weight.float()).any()
        # The same amax over 240 instead of 448.
        ratio = scale / fn_layers[name].weight_scale
        assert torch.allclose(ratio, torch.full_like(ratio, 448 / 240)), name
    _greedy_agreement(fn_tokens, tokens, logprobs)


# ---------------------------------------------------------------------- checkpoints


def _assert_converted(fn_layers: dict[str, Linear], layers: dict[str, Linear]) -> None:
    """Every layer holds the fn load's bits (0x80, -0, as 0) in fnuz with doubled scales, so the
    weights it stands for are the very same."""
    for name, layer in layers.items():
        fn = fn_layers[name]
        assert (fn.weight.dtype, layer.weight.dtype) == (FN, FNUZ), name
        before, after = fn.weight.view(torch.uint8), layer.weight.view(torch.uint8)
        assert torch.equal(torch.where(before == 0x80, 0, before), after), name
        assert torch.equal(layer.weight_scale, fn.weight_scale * 2), name
        if fn.input_scale is not None:
            assert torch.equal(layer.input_scale, fn.input_scale * 2), name
        scale = fn.weight_scale
        if scale.dim() == 2 and scale.shape[1] > 1:  # blocks
            scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        assert torch.equal(layer.weight.float() * (scale * 2), fn.weight.float() * scale), (
            name
        )  # exact: no rounding anywhere


@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_compressed_tensors_checkpoints_convert_exactly(preset, float_model, tmp_path, monkeypatch):
    path = compressed_tensors_checkpoint(float_model, tmp_path / preset, preset)
    (fn_layers, fn_tokens, fn_lp), (layers, tokens, logprobs) = _both(str(path), monkeypatch)
    # The min-max scales put each weight group's largest value at e4m3fn's 448 (bits 0x7E):
    # fnuz reads those bits as 224, times the doubled scale.
    assert max(float(m.weight.float().abs().max()) for m in fn_layers.values()) == 448.0
    _assert_converted(fn_layers, layers)
    _greedy_agreement(fn_tokens, tokens, logprobs)
    if preset == "FP8":
        # Static activation scales, doubled: activations land on the same bits too, but for
        # the few beyond the calibrated range, which e4m3fn saturates at 448 x scale and fnuz
        # at 240 x 2 x scale (14 and 8 of 940,032 values here).
        assert tokens == fn_tokens
        for a, b in zip(fn_lp, logprobs, strict=True):
            for x, y in zip(a, b, strict=True):
                assert abs(x[0].logprob - y[0].logprob) < 5e-3


@pytest.mark.parametrize("block", [False, True])
def test_fp8_config_checkpoints_convert_exactly(block, float_model, tmp_path, monkeypatch):
    path = fp8_config_checkpoint(float_model, tmp_path / "fp8cfg", block)
    (fn_layers, fn_tokens, _), (layers, tokens, logprobs) = _both(str(path), monkeypatch)
    _assert_converted(fn_layers, layers)
    _greedy_agreement(fn_tokens, tokens, logprobs)


def test_a_checkpoint_holding_nan_bit_patterns_is_refused(float_model, tmp_path, fnuz_platform):
    """e4m3fn's NaN bits (0x7F, 0xFF) would read as +-240 in fnuz: refused, not converted."""
    path = fp8_config_checkpoint(float_model, tmp_path / "fp8cfg", block=False)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    bits = tensors[name].view(torch.uint8).clone()
    bits[0, :3] = torch.tensor([0x7F, 0xFF, 0x7F], dtype=torch.uint8)
    tensors[name] = bits.view(FN)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(Fp8ConversionError, match=r"3 NaN value\(s\).*re-quantize it"):
        LLM(str(path), **ENGINE)
