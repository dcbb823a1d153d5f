"""pagellm-fp8 on the CPU: every method's reference path against float math, the engine's greedy
parity with the float model (teacher-forced top-1 agreement and logprob gap), checkpoints written
by compressed-tensors and in the Fp8Config format, detection without a flag, and refusals."""

from __future__ import annotations

import importlib.metadata
import logging
import re

import pytest
import torch
from fp8_checkpoints import compressed_tensors_checkpoint, fp8_config_checkpoint, tiny_llama
from pagellm_fp8.checkpoint_formats import parse_checkpoint
from pagellm_fp8.gemm import gemm_refusal, reference_gemm
from pagellm_fp8.quant_ops import quantize_weight
from pagellm_fp8.scheme import Fp8Scheme

from pagellm import LLM, SamplingParams
from pagellm.config import ConfigError
from pagellm.layers.linear import Linear
from pagellm.quantization.registry import quantization_methods

logger = logging.getLogger(__name__)

METHODS = ["fp8", "fp8_per_tensor", "fp8_per_channel", "fp8_per_block"]
SCHEMES = {
    "tensor": Fp8Scheme("tensor", "tensor"),
    "channel": Fp8Scheme("channel", "token"),
    "block": Fp8Scheme("block", "group"),
}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 300, 12], [700, 3, 18, 19, 20, 21]]
GEN_TOKENS = 24
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory=8 << 20, seed=0)


@pytest.fixture(scope="module")
def float_model(tmp_path_factory, smollm2_tokenizer_dir):
    return tiny_llama(tmp_path_factory.mktemp("fp8") / "float", smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def dense_reference(float_model):
    """The float model's greedy continuations, and its logprob of each (teacher-forced)."""
    llm = LLM(str(float_model), **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs, strict=True)]
    return sequences, _teacher_forced(llm, sequences)


def _teacher_forced(llm: LLM, sequences: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Per sequence and generated position: (rank of the sequence's token, its logprob)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(sequences, params, use_tqdm=False)
    result = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        seq = out.prompt_token_ids
        rows = []
        for pos in range(len(prompt), len(seq)):
            entry = out.prompt_logprobs[pos][seq[pos]]
            rows.append((entry.rank, entry.logprob))
        result.append(rows)
    return result


def _agreement(llm: LLM, dense_reference) -> tuple[float, float]:
    sequences, dense = dense_reference
    quant = _teacher_forced(llm, sequences)
    pairs = [
        (q, d) for qs, ds in zip(quant, dense, strict=True) for q, d in zip(qs, ds, strict=True)
    ]
    top1 = sum(q[0] == 1 for q, _ in pairs) / len(pairs)
    gap = max(abs(q[1] - d[1]) for q, d in pairs)
    return top1, gap


def _linears(llm: LLM) -> list[Linear]:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_reference_gemm_is_the_float_product_within_fp8_error(granularity):
    torch.manual_seed(0)
    x, w = torch.randn(7, 256), torch.randn(384, 256) * 0.05
    q, scale = quantize_weight(w, SCHEMES[granularity].weights)
    assert q.dtype == torch.float8_e4m3fn
    expected_scale_shape = {"tensor": (1,), "channel": (384, 1), "block": (3, 2)}[granularity]
    assert tuple(scale.shape) == expected_scale_shape
    out = reference_gemm(SCHEMES[granularity])(x, q, scale, None)
    exact = x @ w.t()
    rel = (out - exact).norm() / exact.norm()
    assert 0 < rel < 0.06, rel  # e4m3 keeps 3 mantissa bits: a few percent, never exact


def test_block_scales_quantize_each_block_on_its_own():
    w = torch.ones(256, 256)
    w[:128, :128] *= 100.0  # one loud block must not cost the others their precision
    q, scale = quantize_weight(w, "block")
    assert torch.allclose(scale, torch.tensor([[100.0, 1.0], [1.0, 1.0]]) / 448)
    assert torch.equal(q.float(), torch.full((256, 256), 448.0))


@pytest.mark.parametrize("method", METHODS)
def test_online_quantization_keeps_greedy_parity_with_the_float_model(
    method, float_model, dense_reference
):
    llm = LLM(str(float_model), quantization=method, **ENGINE)
    linears = _linears(llm)
    assert {lin.weight.dtype for lin in linears} == {torch.float8_e4m3fn}
    assert {lin.linear_method.gemm_path for lin in linears} == {"reference"}
    weight_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)
    assert weight_bytes == sum(lin.weight.numel() for lin in linears)  # 1 byte a weight
    top1, gap = _agreement(llm, dense_reference)
    logger.warning("online %s: top-1 agreement %.3f, max logprob gap %.4f", method, top1, gap)
    assert top1 >= 0.95, (method, top1, gap)


@pytest.mark.parametrize(
    ("preset", "detected"),
    [("FP8", "fp8_per_tensor"), ("FP8_DYNAMIC", "fp8_per_channel"), ("FP8_BLOCK", "fp8_per_block")],
)
def test_compressed_tensors_checkpoints_load_without_a_flag_and_match(
    preset, detected, float_model, dense_reference, tmp_path
):
    from safetensors import safe_open

    path = compressed_tensors_checkpoint(float_model, tmp_path / preset, preset)
    llm = LLM(str(path), **ENGINE)
    assert llm.llm_engine.config.quantization == detected
    # The checkpoint's own float8 bytes are what the layer holds (no requantization).
    qkv = _linears(llm)[0]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        q_proj = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(qkv.weight[: q_proj.shape[0]].view(torch.uint8), q_proj.view(torch.uint8))
    top1, gap = _agreement(llm, dense_reference)
    logger.warning("compressed-tensors %s: top-1 %.3f, max logprob gap %.4f", preset, top1, gap)
    assert top1 >= 0.95, (preset, top1, gap)


@pytest.mark.parametrize(("block", "detected"), [(False, "fp8"), (True, "fp8_per_block")])
def test_fp8_config_checkpoints_load_without_a_flag_and_match(
    block, detected, float_model, dense_reference, tmp_path
):
    path = fp8_config_checkpoint(float_model, tmp_path / "fp8cfg", block)
    llm = LLM(str(path), **ENGINE)
    assert llm.llm_engine.config.quantization == detected
    first = _linears(llm)[0]
    assert (first.input_scale is not None) == (not block)  # static activations: calibrated scale
    top1, gap = _agreement(llm, dense_reference)
    logger.warning("Fp8Config block=%s: top-1 %.3f, max logprob gap %.4f", block, top1, gap)
    assert top1 >= 0.95, (block, top1, gap)


def test_a_flag_that_contradicts_the_checkpoint_is_refused(float_model, tmp_path):
    path = fp8_config_checkpoint(float_model, tmp_path / "fp8cfg", block=True)
    with pytest.raises(
        ConfigError, match="quantization='fp8_per_channel' conflicts with the checkpoint"
    ):
        LLM(str(path), quantization="fp8_per_channel", **ENGINE)


def test_bad_fp8_checkpoint_configs_are_refused_with_the_reason(float_model, tmp_path):
    import json

    path = fp8_config_checkpoint(float_model, tmp_path / "fp8cfg", block=True)
    config = json.loads((path / "config.json").read_text())
    cases = {
        "weight_block_size [64, 64] is not supported": {"weight_block_size": [64, 64]},
        "activation_scheme 'per_head' is not supported": {"activation_scheme": "per_head"},
    }
    for message, change in cases.items():
        (path / "config.json").write_text(
            json.dumps(
                {**config, "quantization_config": {**config["quantization_config"], **change}}
            )
        )
        with pytest.raises(ConfigError, match=re.escape(message)):
            LLM(str(path), **ENGINE)
    int8 = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}},
    }
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": int8}))
    with pytest.raises(ConfigError, match="which no installed quantization method reads"):
        LLM(str(path), **ENGINE)


def test_checkpoint_scheme_errors_name_what_was_found():
    ct = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "g": {
                "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor"},
            }
        },
    }
    with pytest.raises(ValueError, match="channel weight scales and static tensor activation"):
        parse_checkpoint(ct)
    ct["config_groups"]["g"]["input_activations"] = None
    with pytest.raises(ValueError, match="without input activations is not supported"):
        parse_checkpoint(ct)


def test_a_block_that_does_not_divide_the_weight_is_refused_at_load(tiny_models):
    with pytest.raises(ValueError, match=r"fp8 block size \[128, 128\] does not divide the weight"):
        LLM(
            tiny_models["llama3"],
            quantization="fp8_per_block",
            max_model_len=64,
            kv_cache_memory=4 << 20,
        )


def test_platforms_without_fp8_gemms_are_refused_with_the_reason():
    assert gemm_refusal("block", "cpu", torch.float32) is None
    assert gemm_refusal("tensor", "cuda", torch.bfloat16, (9, 0)) is None
    assert gemm_refusal("channel", "cuda", torch.float16, (8, 9)) is None
    ampere = gemm_refusal("tensor", "cuda", torch.bfloat16, (8, 0))
    assert ampere is not None and "compute capability 8.9 or newer" in ampere and "8.0" in ampere
    fp32 = gemm_refusal("channel", "cuda", torch.float32, (9, 0))
    assert fp32 is not None and "pass --dtype bfloat16" in fp32
    tpu = gemm_refusal("tensor", "tpu", torch.bfloat16)
    assert tpu is not None and "device type 'tpu'" in tpu


def test_layers_scaled_mm_cannot_take_are_refused_with_their_shape():
    from pagellm_fp8.gemm import shape_refusal

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    per_channel = Fp8Scheme("channel", "token")
    assert shape_refusal(per_channel, cuda, 4096, 4096) is None
    assert shape_refusal(per_channel, cuda, 4104, 1000) == (
        "torch._scaled_mm needs both weight dimensions to be multiples of 16; this layer has "
        "out_features 4104, in_features 1000"
    )
    assert shape_refusal(per_channel, cpu, 4104, 1000) is None  # the reference path
    assert shape_refusal(Fp8Scheme("block", "group"), cuda, 4104, 1024) is None


def test_block_method_on_cuda_without_the_triton_kernel_says_so(monkeypatch):
    """The kernels module is made unimportable here (the CPU machine may have Triton)."""
    import sys

    monkeypatch.setitem(sys.modules, "pagellm_fp8.kernels.block_gemm", None)
    reason = gemm_refusal("block", "cuda", torch.bfloat16, (9, 0))
    assert reason is not None and "pagellm_fp8.kernels.block_gemm" in reason


def test_the_package_registers_its_four_methods():
    (entry,) = [
        e
        for e in importlib.metadata.entry_points(group="pagellm.quantization_methods")
        if e.dist is not None and e.dist.name == "pagellm-fp8"
    ]
    assert entry.value == "pagellm_fp8.plugin"
    for name in METHODS:
        assert quantization_methods.get(name).name == name


def _logprobs(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt's greedy continuation and the top-5 logprobs of every prompt and generated
    position: the whole model's outputs, to compare bit for bit."""
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    results = []
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        positions = list(out.prompt_logprobs[1:]) + list(out.outputs[0].logprobs)
        values = [{t: lp.logprob for t, lp in pos.items()} for pos in positions]
        results.append((list(out.outputs[0].token_ids), values))
    return results


@pytest.mark.parametrize("checkpoint", [*METHODS, "fp8_config_static_scales"])
def test_norms_and_activations_that_quantize_the_next_input_change_no_output(
    checkpoint, float_model, tmp_path, monkeypatch
):
    """Fused input quantization (the default; ``PAGELLM_FP8_FUSED_INPUT_QUANT=0`` is off): each norm and SiLU-and-multiply hands its linear
    layer a `QuantizedActivation` (here through the torch quantizer the reference path offers,
    on CUDA through the fused kernels): the same bits as the layer quantizing its input."""
    from pagellm_fp8.input_quant import FUSED_INPUT_QUANT_ENV, TorchInputQuantizer
    from pagellm_fp8.linear_method import Fp8LinearMethod

    from pagellm.layers.activation import SiluAndMul
    from pagellm.layers.layernorm import RMSNorm

    if checkpoint == "fp8_config_static_scales":
        model, engine = fp8_config_checkpoint(float_model, tmp_path / "fp8cfg", False), ENGINE
    else:
        model, engine = float_model, {**ENGINE, "quantization": checkpoint}
    monkeypatch.setenv(FUSED_INPUT_QUANT_ENV, "0")
    unfused = _logprobs(LLM(str(model), **engine))

    monkeypatch.setenv(FUSED_INPUT_QUANT_ENV, "1")
    calls = []
    apply_quantized = Fp8LinearMethod.apply_quantized

    def counted(self, layer, x):
        calls.append(self.prefix)
        return apply_quantized(self, layer, x)

    monkeypatch.setattr(Fp8LinearMethod, "apply_quantized", counted)
    llm = LLM(str(model), **engine)
    runner_model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    producers = [m for m in runner_model.modules() if isinstance(m, RMSNorm | SiluAndMul)]
    bound = [p for p in producers if p.input_quantizer is not None]
    layers = len(runner_model.model.layers)
    assert len(bound) == 3 * layers  # two norms and the activation a layer; not the final norm
    assert all(isinstance(p.input_quantizer, TorchInputQuantizer) for p in bound)
    if checkpoint == "fp8_config_static_scales":
        assert all(p.input_quantizer.input_scale is not None for p in bound)

    fused = _logprobs(llm)
    assert {name.rsplit(".", 1)[-1] for name in calls} == {"qkv_proj", "gate_up_proj", "down_proj"}
    assert fused == unfused


def test_fast_accumulation_and_fused_input_are_on_unless_set_to_0(monkeypatch):
    from pagellm_fp8.gemm import FAST_ACCUM_ENV, env_switch
    from pagellm_fp8.input_quant import FUSED_INPUT_QUANT_ENV, fused_input_quant_enabled

    for name in (FAST_ACCUM_ENV, FUSED_INPUT_QUANT_ENV):
        monkeypatch.delenv(name, raising=False)
        assert env_switch(name)
        monkeypatch.setenv(name, "0")
        assert not env_switch(name)
        monkeypatch.setenv(name, "yes")
        with pytest.raises(ValueError, match=f"{name}='yes'"):
            env_switch(name)
        monkeypatch.delenv(name)
    assert fused_input_quant_enabled()
