"""pagellm-gguf's Triton kernels on the CPU, in Triton's interpreter, against the `gguf` package's
numpy dequantizers (the reference), for each block type at small odd shapes.

Triton picks interpreter mode when it is first imported, so outside an interpreter process (a
CUDA machine) this module collects one test, which runs the file again in a child process with
``TRITON_INTERPRET=1``. The checks use float32 activations: the interpreter truncates float32 ->
bfloat16 casts where the GPU rounds, and the GPU tests (test_gguf_gpu.py) cover bf16.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf_files import random_blocks
from pagellm_gguf.block_types import KERNEL_TYPES, block_shape

REPO = Path(__file__).resolve().parents[4]
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
in_interpreter = pytest.mark.skipif(
    not IN_INTERPRETER or importlib.util.find_spec("triton") is None,
    reason="runs in the interpreter process (the test below starts it)",
)
TYPES = [pytest.param(t, id=t.name) for t in KERNEL_TYPES]


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the interpreter process: the checks run here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_match_numpy_dequantizers_in_interpreter_process() -> None:
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = f"{child.stdout}\n{child.stderr}"
    assert child.returncode == 0, f"Interpreter checks failed:\n{report}"
    assert " passed" in child.stdout, f"No interpreter check ran:\n{report}"


def _case(qtype: gguf.GGMLQuantizationType, rows: int, seed: int = 0):
    block_size, _ = block_shape(qtype)
    cols = 3 * block_size if block_size == 32 else 2 * block_size  # several blocks per row
    raw = random_blocks(qtype, rows, cols, seed)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols).copy())
    return torch.from_numpy(raw), reference


@in_interpreter
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_the_numpy_reference(qtype):
    from pagellm_gguf import ops

    blocks, reference = _case(qtype, rows=37)
    got = ops.dequantize(blocks, int(qtype), reference.shape[1], torch.float32)
    torch.testing.assert_close(got, reference, rtol=0, atol=0)


@in_interpreter
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 5, 33])  # 1 and 5: the dequantizing matmul; 33: dequantize + mm
def test_gguf_linear_matches_the_product_with_the_reference(qtype, m):
    from pagellm_gguf import ops

    blocks, reference = _case(qtype, rows=19, seed=m)
    x = torch.randn(m, reference.shape[1], generator=torch.Generator().manual_seed(m))
    got = ops.gguf_linear(x, blocks, int(qtype))
    expected = (x.double() @ reference.double().t()).float()
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6 * scale * reference.shape[1] ** 0.5)


@in_interpreter
def test_fused_layer_with_parts_of_different_types_and_a_float_part():
    """qkv-like: parts in Q4_K, Q4_K, Q6_K and F32 (a type the kernels skip) with a bias."""
    from pagellm_gguf.method import GGUFConfig

    from pagellm.layers.linear import Linear

    k = 256
    types = [gguf.GGMLQuantizationType.Q4_K] * 2 + [gguf.GGMLQuantizationType.Q6_K, None]
    sizes = [16, 7, 7, 3]
    layer = Linear(k, sum(sizes), True, GGUFConfig(), "layer", output_sizes=sizes)
    parts = []
    for shard, (qtype, rows) in enumerate(zip(types, sizes, strict=True)):
        if qtype is None:
            dense = torch.randn(rows, k)
            layer.weight.weight_loader(layer.weight, dense, shard)
        else:
            raw = random_blocks(qtype, rows, k, seed=shard)
            dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, k).copy())
            blocks = torch.from_numpy(raw)
            blocks.gguf_type = int(qtype)
            layer.weight.weight_loader(layer.weight, blocks, shard)
        parts.append(dense)
    layer.bias.data.copy_(torch.randn(sum(sizes)))
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.linear_method.types == [int(types[0]), int(types[2]), None]  # Q4_K parts joined
    x = torch.randn(3, k)
    expected = x.double() @ torch.cat(parts).double().t() + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-3)


@in_interpreter
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K])
def test_decode_matmul_split_along_k_adds_up_to_the_product(qtype, monkeypatch):
    """With few output tiles the decode matmul splits K over programs (as on a GPU with many
    SMs: patched here) and adds their float32 partial sums."""
    from pagellm_gguf import ops

    monkeypatch.setattr(ops, "_num_sms", lambda device: 64)
    assert ops.k_splits(n_tiles=1, k_tiles=8, num_sms=64) == 2
    k = 1024
    raw = random_blocks(qtype, 21, k, seed=3)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(21, k).copy())
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    got = ops.dequant_matmul(x, torch.from_numpy(raw), int(qtype))
    expected = (x.double() @ reference.double().t()).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6 * expected.abs().max().item() * 32)


def test_k_splits_give_each_sm_programs_without_runs_under_four_tiles():
    pytest.importorskip("triton")
    from pagellm_gguf.ops import k_splits

    assert k_splits(n_tiles=128, k_tiles=32, num_sms=132) == 4  # N = 4096, K = 4096 on an H200
    assert k_splits(n_tiles=896, k_tiles=32, num_sms=132) == 1  # gate_up: enough tiles already
    assert k_splits(n_tiles=128, k_tiles=4, num_sms=132) == 1  # short K: one run
