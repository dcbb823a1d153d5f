"""pagellm-int4's Triton kernels on the CPU, through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1 when torch has no CUDA), against the torch reference of the kernel layout, at
shapes that are not multiples of the tiles. Sizes stay tiny: the interpreter runs each program
in NumPy. GPU sizes are in test_int4_gpu.py.

bfloat16 is left to the GPU tests: Triton's interpreter multiplies bfloat16's raw bits in
``tl.dot`` and truncates float32 -> bfloat16 casts (pagellm-triton-attn's ``interpreter_compat``
describes the first); float16 takes the same code path here."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagellm_int4 import gemm
from pagellm_int4.int4_values import Int4Values
from pagellm_int4.kernel_layout import (
    KernelLayout,
    dequantize,
    pack_tiles,
    to_kernel_layout,
    unpack_tiles,
)
from pagellm_int4.kernels import tiles as int4_tiles
from pagellm_int4.kernels import w4a16
from pagellm_int4.kernels.w4a16 import Int4KernelInputError


def _layout(k: int, n: int, group: int, act_order: bool, seed: int = 0) -> KernelLayout:
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    values = Int4Values(
        q=torch.randint(0, 16, (k, n), generator=g, dtype=torch.uint8),
        zeros=torch.randint(0, 17, (groups, n), generator=g, dtype=torch.uint8),
        scales=torch.rand(groups, n, generator=g) * 0.1 + 0.01,
        g_idx=(torch.randperm(k, generator=g) % groups) if act_order else torch.arange(k) // group,
    )
    return to_kernel_layout(values, group, "test")


# (M, N, K, group): one group over K = 200 (not a multiple of the K tile), groups of 32 and 16,
# groups of 40 (no K tile divides them: per-row scales), M past one M tile.
SHAPES = [(1, 40, 200, 200), (5, 24, 96, 32), (17, 40, 64, 16), (3, 24, 120, 40)]


@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES)
def test_w4a16_gemm_matches_the_reference_in_float32(m, n, k, group):
    layout = _layout(k, n, group, act_order=group == 32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    a = x if layout.perm is None else x[:, layout.perm]
    out = w4a16.w4a16_gemm(a, layout.qweight, layout.scales, layout.zeros, group)
    ref = gemm.reference_gemm(x, layout)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_w4a16_gemm_in_float16_accumulates_in_float32():
    layout = _layout(96, 24, 32, act_order=False)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(2)).half()
    out = w4a16.w4a16_gemm(x, layout.qweight, layout.scales, layout.zeros, 32)
    exact = x.float() @ dequantize(layout, torch.float16).float()
    assert out.dtype == torch.float16
    # float32 sums of float16 products: only the final rounding to float16 remains.
    torch.testing.assert_close(out.float(), exact, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("k", "n", "group"), [(200, 40, 200), (120, 136, 40)])
def test_dequantize_kernel_is_the_reference_bit_for_bit(k, n, group):
    layout = _layout(k, n, group, act_order=False, seed=3)
    for dtype in (torch.float32, torch.float16):
        out = w4a16.dequantize_int4(layout.qweight, layout.scales, layout.zeros, group, k, dtype)
        assert torch.equal(out, dequantize(layout, dtype))


def test_kernel_inputs_of_the_wrong_layout_are_refused():
    layout = _layout(64, 16, 32, act_order=False)
    x = torch.randn(2, 64)
    with pytest.raises(
        Int4KernelInputError, match=r"qweight has dtype torch.int32 and shape \(8, 16\)"
    ):
        w4a16.w4a16_gemm(x, layout.qweight[:8].contiguous(), layout.scales, layout.zeros, 32)
    with pytest.raises(Int4KernelInputError, match=r"scales has dtype torch.float16"):
        w4a16.w4a16_gemm(x, layout.qweight, layout.scales.half(), layout.zeros, 32)


@pytest.mark.parametrize("reduce", ["serial", "kernel"])
@pytest.mark.parametrize(("k", "split_k"), [(200, 2), (200, 3), (640, 3)])
def test_split_k_partial_sums_add_up_to_the_reference(k, split_k, reduce):
    """K = 200 in two tiles of 128 (one group; 3 splits are cut to 2, one tile each), K = 640's
    five tiles in 3 uneven splits (2, 1, 2); partial sums added by the last program of each
    output tile or by a second kernel, both in split order: the same bits."""
    layout = _layout(k, 40, k, act_order=False, seed=4)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
    tiles = int4_tiles.TileConfig("dot", 16, 32, 128, split_k, 4, 2, reduce=reduce)
    out = w4a16.w4a16_gemm(x, layout.qweight, layout.scales, layout.zeros, k, tiles=tiles)
    torch.testing.assert_close(out, gemm.reference_gemm(x, layout), rtol=1e-5, atol=1e-5)
    other = dataclasses.replace(tiles, reduce="kernel" if reduce == "serial" else "serial")
    again = w4a16.w4a16_gemm(x, layout.qweight, layout.scales, layout.zeros, k, tiles=other)
    assert torch.equal(out, again)
    if reduce == "serial":  # the counters are back at zero for the next launch
        assert not bool(w4a16.tile_counters(x.device, 2).any())


def test_tile_interleaved_packing_puts_row_16i_plus_r_in_nibble_i_of_word_r():
    q = torch.randint(0, 16, (300, 5), generator=torch.Generator().manual_seed(11)).to(torch.uint8)
    words = pack_tiles(q)
    assert words.shape == (3 * 16, 5)  # 300 rows padded to three tiles of 128
    for row in (0, 15, 16, 127, 128, 200, 299):
        tile, within = divmod(row, 128)
        i, r = divmod(within, 16)
        got = (words[tile * 16 + r] >> (4 * i)) & 0xF
        assert torch.equal(got.to(torch.uint8), q[row])
    assert not bool(((words[2 * 16 :] >> 4 * 3) & 0xF).bool().any())  # rows 300..383: zero
    assert torch.equal(unpack_tiles(words, 300), q)


def test_tiles_without_a_measured_table_split_k_to_fill_the_sms():
    h200 = 132
    assert int4_tiles.scales_per_tile(4096, 128, 128)
    assert int4_tiles.scales_per_tile(4096, 4096, 128)  # one group: any K tile
    assert not int4_tiles.scales_per_tile(4096, 32, 128)
    assert int4_tiles.tile_config(1, 4096, 4096, 128, h200).kind == "dot"
    assert int4_tiles.tile_config(1, 4096, 4096, 128, h200).block_m == 16
    assert int4_tiles.tile_config(64, 4096, 4096, 128, h200).block_m == 64
    # 32 output tiles of 128 columns for N = 4096: split in 16 (512 programs, two K tiles
    # each); none at prefill sizes; gate_up's 224 tiles (N = 28672) in 2.
    assert int4_tiles.tile_config(1, 4096, 4096, 128, h200).split_k == 16
    assert int4_tiles.tile_config(64, 4096, 4096, 128, h200).split_k == 1
    assert int4_tiles.tile_config(1, 28672, 4096, 128, h200).split_k == 2


def test_a_measured_table_is_used_for_its_shapes_and_the_rule_elsewhere(tmp_path, monkeypatch):
    table = {
        "tiles": {
            "4096,4096,128": {
                "4": int4_tiles.table_entry(int4_tiles.TileConfig("fma", 4, 64, 256, 4, 4, 2)),
                "16": int4_tiles.table_entry(int4_tiles.TileConfig("dot", 16, 256, 128, 2, 8, 4)),
            }
        }
    }
    (tmp_path / "Some_GPU_80GB.json").write_text(json.dumps(table))
    monkeypatch.setattr(int4_tiles, "CONFIG_DIR", tmp_path)
    int4_tiles.measured_table.cache_clear()
    try:
        pick = functools.partial(
            int4_tiles.tile_config, n=4096, k=4096, group_size=128, num_sms=132
        )
        assert pick(1, device_name="Some GPU 80GB").block_k == 256
        assert pick(16, device_name="Some GPU 80GB").kind == "dot"
        assert pick(17, device_name="Some GPU 80GB") == pick(17)  # past the table: the rule
        assert pick(1, device_name="Other GPU") == pick(1)
    finally:
        int4_tiles.measured_table.cache_clear()


@pytest.mark.parametrize(
    ("kind", "block_m", "chains"),
    [("fma", 1, 1), ("fma", 4, 1), ("dot", 16, 1), ("dot", 16, 2), ("dot_t", 16, 1)],
)
@pytest.mark.parametrize(
    ("k", "n", "group"),
    # K tiles past K (masked), one group, groups shorter than a tile, and a shape where every
    # load is in bounds (K = 512 in two splits of two tiles, N a multiple of the tile).
    [(384, 72, 128), (200, 72, 200), (256, 72, 32), (512, 128, 128)],
)
def test_both_kinds_of_program_match_the_reference(kind, block_m, chains, k, n, group):
    """Tile-interleaved words (row 16 i + r of a tile in nibble i of word row r) as the kernel
    reads them, against the reference path on the unpacked codes; the dot kind with its slabs
    summed in one MMA chain or two."""
    layout = _layout(k, n, group, act_order=False, seed=8)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    tiles = int4_tiles.TileConfig(kind, block_m, 64, 128, 2, 4, 2, chains=chains)
    out = w4a16.w4a16_gemm(x, layout.qweight, layout.scales, layout.zeros, group, tiles=tiles)
    torch.testing.assert_close(out, gemm.reference_gemm(x, layout), rtol=1e-5, atol=1e-5)


def test_tiles_other_than_the_interleaved_tile_are_refused():
    layout = _layout(64, 16, 32, act_order=False)
    with pytest.raises(Int4KernelInputError, match="BLOCK_K must be 128"):
        w4a16.w4a16_gemm(
            torch.randn(2, 64),
            layout.qweight,
            layout.scales,
            layout.zeros,
            32,
            tiles=int4_tiles.TileConfig("dot", 16, 64, 64, 1, 4, 2),
        )


@pytest.mark.parametrize("m", [3, gemm.FUSED_MAX_M + 1])
def test_the_triton_path_takes_the_fused_kernel_or_dequantize_then_matmul_by_m(m, monkeypatch):
    """The Triton path's function, run here on CPU tensors through the interpreter: act-order
    inputs permuted, the fused kernel up to FUSED_MAX_M rows, dequantize + mm above."""
    calls: list[str] = []
    for name in ("w4a16_gemm", "dequantize_int4"):
        kernel = getattr(w4a16, name)
        monkeypatch.setattr(
            w4a16, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw)
        )
    layout = _layout(64, 24, 16, act_order=True, seed=6)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(7))
    out = gemm._triton_gemm(w4a16)(x, layout)
    assert calls == (["w4a16_gemm"] if m <= gemm.FUSED_MAX_M else ["dequantize_int4"])
    torch.testing.assert_close(out, gemm.reference_gemm(x, layout), rtol=1e-5, atol=1e-5)


def test_tiles_that_do_not_fit_the_gpu_fall_back_to_narrow_single_stage_tiles(monkeypatch):
    from triton.runtime.errors import OutOfResources

    launched: list[int4_tiles.TileConfig] = []
    real_launch = w4a16._launch

    def launch(*args):
        tiles = args[7]  # x, qweight, scales, zeros, out, ws, group_size, tiles, ...
        launched.append(tiles)
        if tiles.block_n == 256:
            raise OutOfResources(245760, 232448, "shared memory")
        real_launch(*args)

    monkeypatch.setattr(w4a16, "_launch", launch)
    layout = _layout(256, 64, 128, act_order=False, seed=12)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(13))
    too_wide = int4_tiles.TileConfig("dot", 16, 256, 128, 1, 8, 4)
    out = w4a16.w4a16_gemm(x, layout.qweight, layout.scales, layout.zeros, 128, tiles=too_wide)
    assert launched == [too_wide, int4_tiles.SAFE_TILES]
    torch.testing.assert_close(out, gemm.reference_gemm(x, layout), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_kind_of_program_compiles_for_sm90_without_a_gpu():
    """Triton lowers the fused kernel for an H100/H200 and ptxas assembles it (sm90_compile.py),
    for every kind of program with the inline PTX unpack (which the interpreter cannot run) and
    with Triton ops: before a GPU runs them."""
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip("this Triton's ASTSource takes another signature (written for Triton 3.6)")
    script = Path(__file__).with_name("sm90_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, f"{child.stdout}\n{child.stderr}"
    assert child.stdout.count("compiled ") == 7, child.stdout
