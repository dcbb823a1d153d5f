"""pagellm-gguf's planes and Triton kernels on the CPU against the `gguf` package's numpy
dequantizers (the reference), for each block type at small odd shapes: the repacked planes read
back by an unpacker written from their layout (this process), and the kernels over them in
Triton's interpreter.

Triton picks interpreter mode when it is first imported, so outside an interpreter process (a
CUDA machine) this module collects one test, which runs the file again in a child process with
``TRITON_INTERPRET=1``. The checks use float32 activations: the interpreter truncates float32 ->
bfloat16 casts where the GPU rounds, and the GPU tests (test_gguf_gpu.py) cover bf16.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf_files import random_blocks
from pagellm_gguf.block_types import KERNEL_TYPES, block_shape
from pagellm_gguf.planes import GGUFPlanes, repack

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


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """Triton lowers the plane kernels for an H200 and ptxas assembles them (sm90_compile.py):
    what the interpreter cannot check, before a GPU runs them."""
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip("this Triton's ASTSource takes another signature (written for Triton 3.6)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sm90_compile.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, f"{child.stdout}\n{child.stderr}"
    assert child.stdout.count("compiled") == len(KERNEL_TYPES), child.stdout


def _case(qtype: gguf.GGMLQuantizationType, rows: int, blocks: int = 0, seed: int = 0):
    """Random raw rows, their planes and numpy's float32 weights; K of a few blocks."""
    block_size, _ = block_shape(qtype)
    cols = (blocks or (3 if block_size == 32 else 2)) * block_size
    raw = random_blocks(qtype, rows, cols, seed)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols).copy())
    return repack(torch.from_numpy(raw), int(qtype), cols), reference


def _unpack(planes: GGUFPlanes) -> torch.Tensor:
    """The planes' weights [N, K] per their documented layout (planes.py), in torch."""
    layout, k, n = planes.layout, planes.in_features, planes.out_features

    def codes(words: torch.Tensor, bits: int) -> torch.Tensor:  # word r, code i: row 32/bits*r+i
        unsigned = words.long() & 0xFFFFFFFF
        per_word = 32 // bits
        split = [(unsigned >> (bits * i)) & (2**bits - 1) for i in range(per_word)]
        return torch.stack(split, dim=1).reshape(k, n)

    q = codes(planes.codes, layout.code_bits)
    if layout.signed:
        q = torch.where(q >= 128, q - 256, q)
    if planes.high is not None:
        q = q | (codes(planes.high, layout.high_bits) << layout.code_bits)
    w = (q - layout.offset).float() * planes.scale.float().repeat_interleave(layout.group, 0)
    if planes.bias is not None:
        w = w + planes.bias.float().repeat_interleave(layout.group, 0)
    return w.t()


@pytest.mark.parametrize("qtype", TYPES)
def test_planes_hold_the_numpy_weights_bit_for_bit_in_less_than_bf16_bytes(qtype):
    planes, reference = _case(qtype, rows=37)
    got = _unpack(planes)
    assert torch.equal(got.view(torch.int32), reference.view(torch.int32))  # bits, -0.0 too
    stored = sum(t.numel() * t.element_size() for t in planes.tensors().values())
    assert stored == planes.layout.bytes_per_weight() * reference.numel()
    assert planes.layout.bytes_per_weight() <= 1.0625  # bf16: 2


def test_repack_refuses_rows_of_the_wrong_size():
    raw = torch.zeros(4, 18 * 3 + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8 rows of 54 bytes"):
        repack(raw, int(gguf.GGMLQuantizationType.Q4_0), 96)
    with pytest.raises(ValueError, match="whole number of 32-weight blocks"):
        repack(raw, int(gguf.GGMLQuantizationType.Q4_0), 100)


@in_interpreter
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_the_numpy_reference(qtype):
    from pagellm_gguf import ops

    planes, reference = _case(qtype, rows=37)
    got = ops.dequantize(planes, torch.float32)
    assert torch.equal(got.contiguous().view(torch.int32), reference.view(torch.int32))


def _product_check(got: torch.Tensor, x: torch.Tensor, reference: torch.Tensor) -> None:
    expected = (x.double() @ reference.double().t()).float()
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6 * scale * reference.shape[1] ** 0.5)


@in_interpreter
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 33])  # 1-17: the decode matmul; 33: dequantize + mm
def test_gguf_linear_matches_the_product_with_the_reference(qtype, m):
    from pagellm_gguf import ops

    planes, reference = _case(qtype, rows=19, seed=m)  # 19 columns: a partial 64-column tile
    x = torch.randn(m, reference.shape[1], generator=torch.Generator().manual_seed(m))
    _product_check(ops.gguf_linear(x, planes), x, reference)


@in_interpreter
@pytest.mark.parametrize("qtype", TYPES)
def test_decode_matmul_split_along_k_adds_up_to_the_product(qtype):
    """Given tiles (as the benchmark's sweep gives them): 16-column tiles over 21 columns (a
    whole tile and a partial one), K of four 256-weight blocks (32 32-weight blocks for
    Q4_0/Q4_1/Q8_0) in two and three runs, with tl.dot and with per-thread FMAs."""
    from pagellm_gguf import ops

    block_size, _ = block_shape(qtype)
    planes, reference = _case(qtype, rows=21, blocks=1024 // block_size, seed=5)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(5))
    block_k = 16 * planes.layout.per_word  # the smallest slab tl.dot takes
    for splits, dot in ((2, True), (3, True), (3, False)):
        block_m = 16 if dot else 1  # without tl.dot: one program per row of x
        tiles = ops.DecodeTiles(block_m, 16, block_k, splits, dot=dot)
        _product_check(ops.planes_matmul(x, planes, tiles), x, reference)


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
    names = {name for name, _ in layer.named_parameters()}
    assert names == {
        "bias",
        *(f"gguf_{plane}_0" for plane in ("codes", "scale", "bias")),  # Q4_K: no high bits
        *(f"gguf_{plane}_1" for plane in ("codes", "high", "scale")),  # Q6_K: no bias
        "gguf_weight_2",
    }
    x = torch.randn(3, k)
    expected = x.double() @ torch.cat(parts).double().t() + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-3)


def test_default_tiles_split_k_only_when_output_tiles_are_few():
    pytest.importorskip("triton")
    from pagellm_gguf.ops import DecodeTiles, decode_tiles, k_splits

    assert k_splits(n_tiles=64, k_tiles=16, num_sms=132) == 8  # N = 4096, K = 4096 on an H200
    assert k_splits(n_tiles=448, k_tiles=16, num_sms=132) == 1  # gate_up: enough tiles already
    assert k_splits(n_tiles=64, k_tiles=2, num_sms=132) == 1  # short K: one run
    assert decode_tiles(1, 4096, 4096, 4, 132) == DecodeTiles(1, 64, 256, 8, dot=False)
    assert decode_tiles(1, 28672, 4096, 4, 132) == DecodeTiles(1, 32, 256, 1, dot=False)
    # tl.dot: 128 columns, 16 rows a slab (128 of 4-bit codes, 64 of int8); 32 output tiles
    # for N = 4096, split in 16.
    assert decode_tiles(2, 4096, 4096, 4, 132) == DecodeTiles(16, 128, 128, 16)
    assert decode_tiles(17, 28672, 4096, 8, 132) == DecodeTiles(32, 128, 64, 2)


def test_tiles_that_the_kernel_cannot_run_are_refused():
    pytest.importorskip("triton")
    from pagellm_gguf import ops

    planes, _ = _case(gguf.GGMLQuantizationType.Q4_0, rows=8)
    with pytest.raises(ValueError, match="tl.dot's inner size"):
        ops.planes_matmul(torch.randn(1, 96), planes, ops.DecodeTiles(16, 64, 64, 1))
