"""pagellm-gguf's reader and registration on the CPU: names and q/k un-permutation against
transformers' own GGUF loading, the raw blocks the GPU method gets, and the core's answer when the
package is absent."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from pagellm.model_loader import formats
from pagellm.model_loader.source import resolve_model_source
from pagellm.quantization.registry import quantization_methods
from pagellm_gguf.method import GGUFConfig
from pagellm_gguf.model_format import GGUFModelFormat
from pagellm_gguf.reader import iterate_gguf_weights

CHECKED_LAYERS = ("model.layers.0.", "model.layers.29.")


def _checked(name: str) -> bool:
    return not name.startswith("model.layers.") or name.startswith(CHECKED_LAYERS)


def test_gguf_weights_equal_transformers_dequantized_weights(smollm2_path):
    """Our GGUF reader (names, q/k un-permutation, dequantization) against transformers' own."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm2_path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    reference = hf.state_dict()
    seen = 0
    for weight_name, tensor in iterate_gguf_weights(smollm2_path, torch.float32):
        if not _checked(weight_name):
            continue  # two layers are enough to check the mapping; skip the rest for speed
        torch.testing.assert_close(tensor, reference[weight_name], rtol=0, atol=0, msg=weight_name)
        seen += 1
    assert seen == 2 + 2 * 9  # embeddings + final norm, and 9 tensors per checked layer


def test_kept_blocks_are_the_rows_of_the_dequantized_weights(smollm2_path):
    """With keep_quantized, linear weights come as raw Q4_1 rows, permuted like the float rows
    (q/k): dequantizing them gives the float path's tensor; norms and embeddings stay float."""
    dense = {n: t for n, t in iterate_gguf_weights(smollm2_path, torch.float32) if _checked(n)}
    kept = 0
    for name, tensor in iterate_gguf_weights(smollm2_path, torch.float32, keep_quantized=True):
        if not _checked(name):
            continue
        qtype = getattr(tensor, "gguf_type", None)
        if qtype is None:
            assert not name.endswith("proj.weight"), name
            torch.testing.assert_close(tensor, dense[name], rtol=0, atol=0)
            continue
        assert qtype == gguf.GGMLQuantizationType.Q4_1 and tensor.dtype == torch.uint8
        values = gguf.quants.dequantize(tensor.numpy(), gguf.GGMLQuantizationType(qtype))
        np.testing.assert_array_equal(values, dense[name].numpy(), err_msg=name)
        kept += 1
    assert kept == 2 * 7  # q, k, v, o, gate, up, down of each checked layer


def test_the_package_registers_the_format_and_the_method():
    assert formats.get_model_format("gguf") is GGUFModelFormat
    assert quantization_methods.get("gguf") is GGUFConfig
    # The CPU has no kernels for the blocks: the file's weights are dequantized at load there.
    assert GGUFModelFormat.default_quantization("x.gguf", "cpu", torch.float32) is None
    assert "CUDA" in (GGUFConfig.platform_refusal("cpu", torch.float32) or "")
    with pytest.raises(ValueError, match="reads GGUF files"):
        GGUFConfig.from_config({"quant_method": "gptq"})


def test_a_gguf_model_without_the_package_says_what_to_install(smollm2_path, monkeypatch):
    monkeypatch.setattr(formats.model_formats, "_entries", {})
    monkeypatch.setattr(formats.model_formats, "_loaded", True)
    with pytest.raises(ValueError, match="pip install pagellm-gguf"):
        resolve_model_source(smollm2_path).hf_directory()
