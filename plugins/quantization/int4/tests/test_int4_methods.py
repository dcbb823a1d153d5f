"""pagellm-int4 on the CPU: checkpoints written by our round-to-nearest writer in each format,
loaded without a flag, greedy-decode exactly as the dense float32 model of the same dequantized
weights (unpacked by the tests' own reader of each format); bad configs refused with the reason."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from int4_checkpoints import (
    awq_unpack,
    compressed_tensors_unpack,
    dense_checkpoint,
    gptq_unpack,
    tiny_llama,
)
from pagellm_int4.gemm import FUSED_MAX_M, gemm_refusal
from pagellm_int4.rtn import write_checkpoint
from pagellm_int4.scheme import Int4Scheme

from pagellm import LLM, SamplingParams
from pagellm.config import ConfigError
from pagellm.layers.linear import Linear
from pagellm.model_loader.weight_memory import weight_bytes_by_method
from pagellm.quantization.registry import quantization_methods

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 300, 12], [700, 3, 18, 19, 20, 21]]
GEN_TOKENS = 16
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory=8 << 20, seed=0)


@pytest.fixture(scope="module")
def float_model(tmp_path_factory, smollm2_tokenizer_dir):
    return tiny_llama(tmp_path_factory.mktemp("int4") / "float", smollm2_tokenizer_dir)


def _unpacker(scheme: Int4Scheme):
    if scheme.format == "gptq":
        return lambda t: gptq_unpack(t, scheme.gptq_v1)
    if scheme.format == "awq":
        return lambda t: awq_unpack(t, scheme.group_size)
    return compressed_tensors_unpack(scheme)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _linears(llm: LLM) -> list[Linear]:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Linear)]


SCHEMES = {
    "gptq_sym_g128_v1": (Int4Scheme("gptq", 128), "gptq"),
    "gptq_asym_g32_desc_act_v2": (
        Int4Scheme("gptq", 32, sym=False, desc_act=True, gptq_v1=False),
        "gptq",
    ),
    "gptq_asym_g64_v1": (Int4Scheme("gptq", 64, sym=False), "gptq"),
    "awq_asym_g128": (Int4Scheme("awq", 128, sym=False), "awq"),
    "ct_sym_g128": (Int4Scheme("compressed-tensors", 128), "compressed_tensors_w4a16"),
    "ct_asym_channel": (
        Int4Scheme("compressed-tensors", -1, sym=False),
        "compressed_tensors_w4a16",
    ),
}


@pytest.mark.parametrize("case", list(SCHEMES))
def test_rtn_checkpoint_loads_without_a_flag_and_decodes_as_its_dense_weights(
    case, float_model, tmp_path
):
    scheme, method = SCHEMES[case]
    quantized = write_checkpoint(float_model, tmp_path / "int4", scheme)
    dense = dense_checkpoint(float_model, quantized, tmp_path / "dense", _unpacker(scheme))
    llm = LLM(str(quantized), **ENGINE)
    assert llm.llm_engine.config.quantization == method
    linears = _linears(llm)
    assert {lin.linear_method.gemm_path for lin in linears} == {"reference"}
    assert {lin.qweight.dtype for lin in linears} == {torch.int32}
    assert all((lin.perm is not None) == scheme.desc_act for lin in linears)
    got = _greedy(llm)
    expected = _greedy(LLM(str(dense), **ENGINE))
    if scheme.desc_act:
        # Permuted inputs sum in another order: float32 rounding may differ, tokens rarely.
        same = sum(
            a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)
        )
        assert same / (len(PROMPTS) * GEN_TOKENS) >= 0.99, (got, expected)
    else:
        assert got == expected


def test_int4_weights_take_an_eighth_of_float32_and_the_start_up_line_says_so(
    float_model, tmp_path, caplog
):
    path = write_checkpoint(float_model, tmp_path / "gptq", Int4Scheme("gptq", 128))
    with caplog.at_level(logging.INFO, logger="pagellm.worker.worker"):
        llm = LLM(str(path), **ENGINE)
    linears = _linears(llm)
    elements = sum(lin.qweight.numel() * 8 for lin in linears)
    stored = sum(p.numel() * p.element_size() for lin in linears for p in lin.parameters())
    # 4 bits a weight, plus a float32 scale and a uint8 zero per output and group of 128.
    assert stored == elements // 2 + elements // 128 * 5
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    by_method = weight_bytes_by_method(model, "gptq")
    assert by_method["gptq"] == (stored, 8)  # qkv, o, gate_up, down in 2 layers
    assert by_method["dense"][1] == 0
    assert any(
        "Weights: " in r.getMessage() and "gptq 0.00 GiB in 8 linear layers" in r.getMessage()
        for r in caplog.records
    )


def _with_config(path: Path, change: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **change}
    (path / "config.json").write_text(json.dumps(config))


def test_bad_int4_configs_are_refused_with_the_reason(float_model, tmp_path):
    path = write_checkpoint(float_model, tmp_path / "gptq", Int4Scheme("gptq", 128))
    cases = {
        "GPTQ with 8 bits is not supported": {"bits": 8},
        "GPTQ checkpoint_format 'marlin' is not supported": {
            "bits": 4,
            "checkpoint_format": "marlin",
        },
    }
    for message, change in cases.items():
        _with_config(path, change)
        with pytest.raises(ConfigError, match=re.escape(message)):
            LLM(str(path), **ENGINE)
    _with_config(path, {"bits": 4, "checkpoint_format": "gptq", "group_size": 96})
    with pytest.raises(ValueError, match="group_size 96 does not divide the layer's 256 input"):
        LLM(str(path), **ENGINE)
    awq = write_checkpoint(float_model, tmp_path / "awq", Int4Scheme("awq", 128, sym=False))
    _with_config(awq, {"version": "gemv"})
    with pytest.raises(ConfigError, match="AWQ version 'gemv' is not supported"):
        LLM(str(awq), **ENGINE)
    ct = write_checkpoint(float_model, tmp_path / "ct", Int4Scheme("compressed-tensors", 128))
    config = json.loads((ct / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"]["num_bits"] = 8
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="pack-quantized with 8 bits is not supported"):
        LLM(str(ct), **ENGINE)


def test_the_cli_quantizes_random_weights_of_a_configs_shapes(float_model, tmp_path):
    from pagellm_int4.rtn import main

    shapes_only = tmp_path / "config_only"
    shapes_only.mkdir()
    (shapes_only / "config.json").write_text((float_model / "config.json").read_text())
    main([str(shapes_only), str(tmp_path / "awq"), "--format", "awq", "--asym", "--random-weights"])
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert config["quantization_config"]["version"] == "gemm"
    llm = LLM(str(tmp_path / "awq"), skip_tokenizer_init=True, **ENGINE)
    assert llm.llm_engine.config.quantization == "awq"
    assert len(_greedy(llm)[0]) == GEN_TOKENS


def test_checkpoint_scheme_errors_name_what_was_found():
    from pagellm_int4.checkpoint_formats import parse_checkpoint
    from pagellm_int4.rtn import quantization_config

    ct = quantization_config(Int4Scheme("compressed-tensors", 128))
    cases = [
        ({**ct, "quantization_status": "frozen"}, "quantization_status 'frozen' is not supported"),
        ({**ct, "format": "int-quantized", "config_groups": {}}, "not an int4 checkpoint format"),
        ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
        ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "quantized lm_head"),
        ({"quant_method": "awq", "w_bit": 3}, "AWQ with 3 bits is not supported"),
    ]
    group = ct["config_groups"]["group_0"]
    with_acts = {**group, "input_activations": {"num_bits": 8, "type": "int"}}
    cases.append(({**ct, "config_groups": {"g": with_acts}}, "quantize activations"))
    for config, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_checkpoint(config)
    assert parse_checkpoint(quantization_config(Int4Scheme("gptq", -1, desc_act=True))) == (
        Int4Scheme("gptq", -1, desc_act=True)
    )


def test_a_float_model_is_not_quantized_at_load(float_model):
    with pytest.raises(ConfigError, match="does not quantize a float model at load"):
        LLM(str(float_model), quantization="gptq", **ENGINE)


def test_platforms_without_int4_gemms_are_refused_with_the_reason(monkeypatch):
    import sys

    assert gemm_refusal("cpu", torch.float32) is None
    fp32 = gemm_refusal("cuda", torch.float32)
    assert fp32 is not None and "pass --dtype bfloat16" in fp32
    tpu = gemm_refusal("tpu", torch.bfloat16)
    assert tpu is not None and "device type 'tpu'" in tpu
    monkeypatch.setitem(sys.modules, "pagellm_int4.kernels.w4a16", None)
    monkeypatch.setenv("PAGELLM_INT4_KERNELS", "triton")  # nor the CUDA kernels
    no_triton = gemm_refusal("cuda", torch.bfloat16)
    assert no_triton is not None and "install pagellm-int4[triton]" in no_triton
    assert FUSED_MAX_M >= 16  # decode batches take the fused kernel


def test_the_package_registers_its_three_methods():
    (entry,) = [
        e
        for e in importlib.metadata.entry_points(group="pagellm.quantization_methods")
        if e.dist is not None and e.dist.name == "pagellm-int4"
    ]
    assert entry.value == "pagellm_int4.plugin"
    for name in ("gptq", "awq", "compressed_tensors_w4a16"):
        assert quantization_methods.get(name).name == name
