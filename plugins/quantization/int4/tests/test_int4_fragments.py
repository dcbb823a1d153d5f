"""The fragment layout of the CUDA kernels, on the CPU: each lane's words decoded the way the
kernel decodes them (``lop3(word >> 4 i, 0x000f000f)``) and placed by the PTX ISA's table of the
m16n8k16 A fragment give back the weight; the scales' strip order; the path choice without a
GPU; and the CUDA source compiled for sm_90 where nvcc is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from pagellm_int4 import gemm
from pagellm_int4.cuda.build import NVCC_FLAGS, SOURCE, find_nvcc
from pagellm_int4.fragment_layout import (
    PAD_TILES,
    dequantize_fragments,
    fragment_layout_problem,
    pack_fragments,
    permute_strips,
    to_fragment_layout,
    unpack_fragments,
)
from pagellm_int4.int4_values import Int4Values
from pagellm_int4.kernel_layout import dequantize, to_kernel_layout


def _a_fragment_element(lane: int, element: int) -> tuple[int, int]:
    """(row, column) of element ``element`` (0..7: a0 holds 0 and 1, ... a3 6 and 7) of a lane's
    A fragment for mma.m16n8k16 with 16-bit types, as the PTX ISA tabulates it."""
    group_id, thread_in_group = lane // 4, lane % 4
    row = group_id if element in (0, 1, 4, 5) else group_id + 8
    col = thread_in_group * 2 + (element & 1) + (8 if element >= 4 else 0)
    return row, col


def _decode_like_the_kernel(words: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """[K, N] codes from the flat words, lane by lane and register by register."""
    k16, n64 = -(-k // 16), -(-n // 64)
    tiles = words[: n64 * k16 * 128].view(n64, k16, 32, 4).tolist()
    out = torch.full((k16 * 16, n64 * 64), -1, dtype=torch.int64)
    for nt in range(n64):
        for kt in range(k16):
            for lane in range(32):
                for j, word in enumerate(tiles[nt][kt][lane]):
                    word &= 0xFFFFFFFF
                    for i in range(4):
                        pair = (word >> (4 * i)) & 0x000F000F  # the LOP3's operand
                        for half, code in enumerate((pair & 0xF, pair >> 16)):
                            row, col = _a_fragment_element(lane, 2 * i + half)
                            # A = W^T of the strip's 16-column block j: row = output column.
                            out[16 * kt + col, 64 * nt + 16 * j + row] = code
    return out[:k, :n]


@pytest.mark.parametrize(("k", "n"), [(16, 64), (48, 100), (32, 200), (7, 5)])
def test_each_lane_decodes_its_mma_fragments_to_the_weight(k, n):
    q = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(k * n))
    q = q.to(torch.uint8)
    words = pack_fragments(q)
    k16, n64 = -(-k // 16), -(-n // 64)
    assert words.dtype == torch.int32 and words.numel() == (n64 * k16 + PAD_TILES) * 128
    assert not bool(words[n64 * k16 * 128 :].any())
    decoded = _decode_like_the_kernel(words, k, n)
    assert torch.equal(decoded, q.long())
    assert torch.equal(unpack_fragments(words, k, n), q)


def test_a_lanes_scales_are_contiguous_in_strip_order():
    """Position 8 g + 2 j + h of a strip holds column 16 j + g + 8 h: lane g's eight columns
    (the rows of its A fragments, h for a1/a3) in one 32-byte load."""
    n = 130
    cols = torch.arange(n, dtype=torch.float32).view(1, n)
    strips = permute_strips(cols)
    assert strips.shape == (1, 192)
    for strip in range(3):
        for g in range(8):
            for j in range(4):
                for h in range(2):
                    col = 64 * strip + 16 * j + g + 8 * h
                    want = float(col) if col < n else 0.0
                    assert strips[0, 64 * strip + 8 * g + 2 * j + h].item() == want


@pytest.mark.parametrize("act_order", [False, True])
def test_the_fragment_layout_dequantizes_to_the_tile_layouts_weight(act_order):
    gen = torch.Generator().manual_seed(3)
    k, n, group = 96, 72, 32
    values = Int4Values(
        q=torch.randint(0, 16, (k, n), generator=gen).to(torch.uint8),
        zeros=torch.randint(0, 17, (k // group, n), generator=gen).to(torch.uint8),
        scales=torch.rand(k // group, n, generator=gen) + 0.01,
        g_idx=(torch.randperm(k, generator=gen) % (k // group))
        if act_order
        else torch.arange(k) // group,
    )
    fragments = to_fragment_layout(values, group, "layer")
    tiles = to_kernel_layout(values, group, "layer")
    assert (fragments.perm is None) == (not act_order)
    if act_order:
        assert torch.equal(fragments.perm, tiles.perm)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_fragments(fragments, dtype), dequantize(tiles, dtype))
    assert fragments.steps_per_group == 2 and fragments.k16 == 6 and fragments.n64 == 2


def test_layers_the_cuda_kernels_cannot_take_are_named():
    assert fragment_layout_problem(4096, 128) is None
    assert fragment_layout_problem(4096, 4096) is None  # one group
    assert "not a multiple of 16" in fragment_layout_problem(4104, 4104)
    assert "group size 8" in fragment_layout_problem(4096, 8)


def test_without_a_gpu_the_reference_path_and_no_cuda_kernels(monkeypatch):
    chosen = gemm.choose_gemm(torch.device("cpu"), 64, 32)
    assert chosen.name == "reference" and chosen.make_layout is to_kernel_layout
    gemm.cuda_kernels_or_reason.cache_clear()
    monkeypatch.setenv(gemm.KERNELS_ENV, "triton")
    assert gemm.cuda_kernels_or_reason(torch.device("cuda")) == "PAGELLM_INT4_KERNELS=triton"
    gemm.cuda_kernels_or_reason.cache_clear()
    monkeypatch.setenv(gemm.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="expected auto, cuda or triton"):
        gemm.cuda_kernels_or_reason(torch.device("cuda"))
    gemm.cuda_kernels_or_reason.cache_clear()


@pytest.fixture(scope="module")
def sm90_report(tmp_path_factory):
    """ptxas's report of w4a16_mma.cu compiled for sm_90 (the H100/H200): {kernel: (registers,
    spill line)}."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    cubin = tmp_path_factory.mktemp("sm90") / "w4a16.cubin"
    run = subprocess.run(
        [nvcc, *NVCC_FLAGS, "-arch=sm_90", "-Xptxas", "-v", "-o", str(cubin), str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    kernels, name, spills = {}, None, None
    for line in run.stderr.splitlines():
        if "Compiling entry function" in line:
            name = line.split("'")[1]
        elif "spill stores" in line:
            spills = line.strip()
        elif "Used" in line and "registers" in line and name:
            kernels[name] = (int(line.split("Used ")[1].split()[0]), spills)
            name = None
    return kernels


def test_the_cuda_source_compiles_for_sm90_without_spills(sm90_report):
    """Every kernel of w4a16_mma.cu compiles for the H100/H200 with no local-memory spills
    (the register arrays of the prefetch ring must stay in registers), and the kernels with 8
    rows and 4 or 8 steps a scaling fit blocks of 16 warps (at most 128 registers)."""
    assert len(sm90_report) == 60, sorted(sm90_report)
    for name, (registers, spills) in sm90_report.items():
        assert spills.startswith("0 bytes stack frame, 0 bytes spill stores"), (name, spills)
        if "_m8_" in name and name.endswith(("_s4", "_s8")):
            assert registers <= 128, (name, registers)


def test_every_launch_shape_the_rule_or_the_sweep_takes_has_its_kernel(sm90_report):
    """`MmaConfig.kernel_name` of every shape `kernel_problem` admits (both dtypes, 8 and 16
    rows, every scaling step) is a compiled kernel; the shapes without one are refused; x two
    steps ahead saves the 16-row kernels registers (the reason for it)."""
    import itertools

    from pagellm_int4.cuda.kernels import PREFETCH_DISTANCES, X_DEPTHS, MmaConfig

    names = set()
    for dtype, rows, spg, warps in itertools.product(
        ("bf16", "fp16"), (1, 8, 9, 16), (1, 2, 4, 8), (1, 4, 8, 16, 32)
    ):
        for depth, x_depths in X_DEPTHS.items():
            for x_depth, prefetch in itertools.product(x_depths, PREFETCH_DISTANCES[depth]):
                cfg = MmaConfig(warps, 1, depth, x_depth, prefetch)
                if cfg.kernel_problem(rows, spg) is None:
                    names.add(cfg.kernel_name(dtype, rows, spg))
    gemms = {name for name in sm90_report if name.startswith("w4a16_mma_")}
    assert names == gemms
    assert "at most 8" in MmaConfig(16, 1, 8).kernel_problem(9, 8)
    assert "at most 16" in MmaConfig(32, 1, 8).kernel_problem(1, 8)
    assert "4 or 8 steps a scaling" in MmaConfig(4, 1, 8, 2).kernel_problem(1, 2)
    assert "no kernel" in MmaConfig(4, 1, 4, 2).kernel_problem(1, 8)
    assert "prefetches 16" in MmaConfig(4, 1, 4, None, 16).kernel_problem(1, 8)
    assert "L2 prefetch" in MmaConfig(4, 1, 8, None, 16).kernel_problem(9, 1)
    assert MmaConfig(4, 1, 8, 2, 16).kernel_name("bf16", 1, 8) == "w4a16_mma_bf16_m8_d8x2p16_s8"
    assert MmaConfig(4, 1, 8, 8).kernel_name("bf16", 3, 8) == "w4a16_mma_bf16_m8_d8_s8"
    assert MmaConfig(4, 1, 8, 2).kernel_name("fp16", 12, 4) == "w4a16_mma_fp16_m16_d8x2_s4"
    for dtype in ("bf16", "fp16"):
        for spg in (4, 8):
            full, short = (
                sm90_report[f"w4a16_mma_{dtype}_m16_{r}_s{spg}"][0] for r in ("d8", "d8x2")
            )
            assert short < full, (dtype, spg, short, full)


def _cuda_tool(name: str) -> str | None:
    """A CUDA binary tool: next to nvcc, on PATH, or the one Triton ships."""
    nvcc = find_nvcc()
    candidates = [Path(nvcc).resolve().parent / name] if nvcc else []
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    found = shutil.which(name)
    return found or next((str(c) for c in candidates if c.is_file()), None)


def test_the_gemm_loads_its_first_weights_before_it_waits_for_the_previous_kernel(tmp_path):
    """In every GEMM's SASS for sm_90 the first weight loads (16-byte, L1 no-allocate) and the
    L2 prefetches come before `griddepcontrol.wait` (ACQBULK): what programmatic dependent
    launch overlaps with the kernel before (ptxas moved the wait above the loads until the
    prefetches stood between them); after it, only the p16 kernels prefetch (in their loop)."""
    nvcc, cuobjdump = find_nvcc(), _cuda_tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    cubin = tmp_path / "w4a16.cubin"
    subprocess.run(
        [nvcc, *NVCC_FLAGS, "-arch=sm_90", "-o", str(cubin), str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    sass = subprocess.run(
        [cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True
    ).stdout
    functions = sass.split("Function : ")[1:]
    gemms = [f for f in functions if f.startswith("w4a16_mma_")]
    assert len(gemms) == 56
    for text in gemms:
        name = text.split()[0]
        before = text[: text.index("ACQBULK")]
        depth = 8 if "_d8" in name else 4
        assert before.count("LDG.E.NA.128") == depth, name
        assert "CCTL.E.PF2" in before, name
        assert text.count("ACQBULK") == 2, name  # and once before the sums are written
        after = text[text.index("ACQBULK") :]
        assert ("CCTL.E.PF2" in after) == name.endswith(("p16_s4", "p16_s8")), name


def test_the_launch_structs_match_cuda_h(tmp_path):
    """`driver._LaunchConfig` and `_LaunchAttribute` (for cuLaunchKernelEx) have cuda.h's
    sizes and offsets, and the attribute id its value."""
    import ctypes

    from pagellm_int4.cuda.driver import (
        PROGRAMMATIC_STREAM_SERIALIZATION,
        _LaunchAttribute,
        _LaunchConfig,
    )

    ours = (
        ctypes.sizeof(_LaunchAttribute),
        ctypes.sizeof(_LaunchConfig),
        _LaunchConfig.hStream.offset,
        _LaunchConfig.attrs.offset,
        _LaunchConfig.numAttrs.offset,
        _LaunchAttribute.value.offset,
        PROGRAMMATIC_STREAM_SERIALIZATION,
    )
    assert ours == (72, 56, 32, 40, 48, 8, 6)
    nvcc, cc = find_nvcc(), shutil.which("cc") or shutil.which("gcc")
    header = Path(nvcc).resolve().parent.parent / "include" if nvcc else None
    if cc is None or header is None or not (header / "cuda.h").is_file():
        return
    source = tmp_path / "layout.c"
    source.write_text(
        "#include <cuda.h>\n#include <stdio.h>\n#include <stddef.h>\n"
        'int main(void) { printf("%zu %zu %zu %zu %zu %zu %d", sizeof(CUlaunchAttribute), '
        "sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream), "
        "offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), "
        "offsetof(CUlaunchAttribute, value), "
        "(int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION); return 0; }\n"
    )
    binary = tmp_path / "layout"
    subprocess.run([cc, f"-I{header}", str(source), "-o", str(binary)], check=True, timeout=120)
    printed = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    assert tuple(int(v) for v in printed.split()) == ours


def test_the_launch_shape_rule_picks_the_measured_shapes_at_llama_8b():
    """`default_config` on an H100 (132 SMs) at the four Llama-3.1-8B matmuls: the launch shapes
    `benchmarks/int4_cuda_sweep.py` measured fastest there (or, for down at M = 1 and o
    at M = 16, within 3 % and 14 % of it: docs/benchmarks.md, 2026-12-08)."""
    from pagellm_int4.cuda.kernels import MmaConfig, default_config

    shapes = {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }
    picked = {
        (name, m): default_config(n // 64, k // 16, 132, m)
        for name, (n, k) in shapes.items()
        for m in (1, 16)
    }
    assert picked == {
        ("qkv", 1): MmaConfig(4, 4, 8),
        ("qkv", 16): MmaConfig(8, 1, 8),
        ("o", 1): MmaConfig(4, 8, 8),
        ("o", 16): MmaConfig(8, 2, 8),
        ("gate_up", 1): MmaConfig(4, 1, 8),
        ("gate_up", 16): MmaConfig(4, 1, 8),
        ("down", 1): MmaConfig(4, 8, 8),
        ("down", 16): MmaConfig(8, 2, 8),
    }
    assert MmaConfig(4, 4, 8).steps(256, 8) == 16 and MmaConfig(4, 8, 8).steps(896, 8) == 32


def test_the_candidate_launch_rules_take_compiled_kernels_and_the_8_row_shapes():
    """``PAGELLM_INT4_LAUNCH_RULE`` candidates (for timing in a whole model): ``x2`` gives 9..16
    rows x two steps ahead and the 8-row warps and splits, ``x2p16`` adds the L2 prefetch at
    every M; with groups of fewer than 64 rows both are the measured rule; every shape they
    pick has its kernel; an unknown rule is refused."""
    from pagellm_int4.cuda.kernels import MmaConfig, default_config

    shapes = {"qkv": (96, 256), "o": (64, 256), "gate_up": (448, 256), "down": (64, 896)}
    for n64, k16 in shapes.values():
        one = default_config(n64, k16, 132, 1)
        for spg in (4, 8):
            x2 = default_config(n64, k16, 132, 16, spg, "x2")
            assert (x2.warps, x2.splits, x2.x_depth, x2.prefetch) == (one.warps, one.splits, 2, 0)
            p16 = default_config(n64, k16, 132, 1, spg, "x2p16")
            assert p16 == MmaConfig(one.warps, one.splits, 8, None, 16)
            for m in (1, 16):
                for rule in ("x2", "x2p16"):
                    cfg = default_config(n64, k16, 132, m, spg, rule)
                    assert cfg.kernel_problem(m, spg) is None, (cfg, m, spg)
        for spg in (1, 2):
            assert default_config(n64, k16, 132, 16, spg, "x2") == default_config(n64, k16, 132, 16)
    with pytest.raises(ValueError, match="PAGELLM_INT4_LAUNCH_RULE='fast'"):
        default_config(64, 256, 132, 1, 8, "fast")
