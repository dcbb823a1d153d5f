"""pagellm-gguf's reader and registration on the CPU: names and q/k un-permutation against
transformers' own GGUF loading, the raw blocks the GPU method gets, and the core's answer when the
package is absent."""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
from pagellm_gguf.method import GGUFConfig
from pagellm_gguf.model_format import GGUFModelFormat
from pagellm_gguf.reader import iterate_gguf_weights, open_gguf
from pagellm_gguf.tensor_slices import unpermute_qk

from pagellm.model_loader import formats
from pagellm.model_loader.source import resolve_model_source
from pagellm.quantization.registry import quantization_methods

CHECKED_LAYERS = ("model.layers.0.", "model.layers.29.")


def _checked(name: str) -> bool:
    return not name.startswith("model.layers.") or name.startswith(CHECKED_LAYERS)


def test_gguf_weights_equal_transformers_dequantized_weights(smollm2_path, smollm2_hf_model):
    """Our GGUF reader (names, q/k un-permutation, dequantization) against transformers' own
    (the session's load of it, shared with the other SmolLM2 tests)."""
    reference = smollm2_hf_model.state_dict()
    seen = 0
    for weight_name, tensor in iterate_gguf_weights(smollm2_path, torch.float32):
        if not _checked(weight_name):
            continue  # two layers are enough to check the mapping; skip the rest for speed
        torch.testing.assert_close(tensor, reference[weight_name], rtol=0, atol=0, msg=weight_name)
        seen += 1
    assert seen == 2 + 2 * 9  # embeddings + final norm, and 9 tensors per checked layer


def test_kept_blocks_are_the_rows_of_the_dequantized_weights(smollm2_path):
    """With keep_quantized, layer 0's linear weights come as raw Q4_1 rows, permuted like the
    float rows (q/k): dequantizing them gives the float path's tensor; norms stay float."""
    q_rows = next(t for t in open_gguf(smollm2_path).tensors if t.name == "blk.0.attn_q.weight")
    q_dense = gguf.quants.dequantize(q_rows.data, q_rows.tensor_type)
    kept = {}
    for name, tensor in iterate_gguf_weights(smollm2_path, torch.float32, keep_quantized=True):
        if name.startswith("model.layers.0."):
            kept[name] = tensor
        elif name.startswith("model.layers.1."):
            break  # the file lists layer by layer: one layer is enough
    linear = {n: t for n, t in kept.items() if n.endswith("proj.weight")}
    assert len(linear) == 7 and len(kept) == 9
    for name, tensor in kept.items():
        qtype = getattr(tensor, "gguf_type", None)
        assert (qtype == gguf.GGMLQuantizationType.Q4_1) == (name in linear), name
    assert all(t.dtype == torch.uint8 for t in linear.values())
    q = linear["model.layers.0.self_attn.q_proj.weight"].numpy()
    unpermuted = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(unpermuted, unpermute_qk(q_dense, 9))  # SmolLM2: 9 heads
    assert not np.array_equal(unpermuted, q_dense)


def test_the_package_registers_the_format_and_the_method(monkeypatch):
    assert formats.get_model_format("gguf") is GGUFModelFormat
    assert quantization_methods.get("gguf") is GGUFConfig
    # The CPU has no kernels for the blocks: the file's weights are dequantized at load there.
    assert GGUFModelFormat.default_quantization("x.gguf", "cpu", torch.float32) is None
    if importlib.util.find_spec("triton") is not None:  # a CUDA platform with the kernels
        assert GGUFModelFormat.default_quantization("x.gguf", "cuda", torch.bfloat16) == "gguf"
        monkeypatch.setenv("PAGELLM_GGUF_DEQUANTIZE", "1")  # the float baseline, on a GPU too
        assert GGUFModelFormat.default_quantization("x.gguf", "cuda", torch.bfloat16) is None
    assert "CUDA" in (GGUFConfig.platform_refusal("cpu", torch.float32) or "")
    with pytest.raises(ValueError, match="reads GGUF files"):
        GGUFConfig.from_config({"quant_method": "gptq"})


def test_a_gguf_model_without_the_package_says_what_to_install(smollm2_path, monkeypatch):
    monkeypatch.setattr(formats.model_formats, "_entries", {})
    monkeypatch.setattr(formats.model_formats, "_loaded", True)
    monkeypatch.setattr(formats, "load_group", lambda group: [])  # no distribution declares it
    with pytest.raises(ValueError, match="pip install pagellm-gguf"):
        resolve_model_source(smollm2_path).hf_directory()


def test_a_gguf_model_with_the_plugin_left_out_by_vllm_plugins_says_so(smollm2_path):
    import subprocess
    import sys

    code = (
        "from pagellm.model_loader.source import resolve_model_source\n"
        f"resolve_model_source({smollm2_path!r}).hf_directory()\n"
    )
    env = {**os.environ, "VLLM_PLUGINS": "openai"}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert child.returncode != 0
    assert (
        "'gguf' plugin of pagellm-gguf, which is skipped: not in the VLLM_PLUGINS" in child.stderr
    )


def test_the_gguf_method_refuses_a_model_of_another_format(tiny_models):
    """``--quantization gguf`` keeps a GGUF file's blocks: on a safetensors checkpoint it would
    run dense weights under its name, so it is refused with the reason."""
    from pagellm.config import ConfigError
    from pagellm.engine.args import EngineArgs

    with pytest.raises(ConfigError, match="keeps the quantized tensors of gguf files"):
        EngineArgs(model=tiny_models["llama3"], quantization="gguf").create_engine_config()
