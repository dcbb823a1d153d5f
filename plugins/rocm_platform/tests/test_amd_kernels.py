"""The Triton kernels the ROCm platform runs (TRITON_ATTN's attention kernels and the fused ops
of `pagellm_cuda.ops`) compile for gfx942 (CDNA3), gfx950 (CDNA4) and gfx1100 (RDNA3), fit in
64 KiB of LDS, and are launched with shapes chosen for the target's wavefront; pagellm-fp8's
activation quantization and block-scaled GEMM compile in float8_e4m3fnuz for gfx942 and in
float8_e4m3fn for gfx950.

No AMD GPU exists where these run: Triton's AMD backend compiles ahead of time from the Triton
wheel alone, with no ROCm installation (`pagellm_rocm.cross_compile`). The compiles run in one
child process (`amd_kernel_cases.py`) because this test process runs Triton in interpreter mode
(the root conftest sets ``TRITON_INTERPRET=1`` on a machine without a GPU), where kernels cannot
be compiled; its Triton cache is a fresh directory, so every kernel is compiled for real. Numerics
are tested elsewhere, in the interpreter (test_triton_attn_kernels.py, test_cuda_ops.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagellm_rocm.cross_compile import AMD_TARGETS, amd_backend_missing

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from amd_kernel_cases import CASES  # noqa: E402
from pagellm_triton_attn.kernels.launch import decode_tiles, mixed_tiles  # noqa: E402

LDS_LIMIT = 64 * 1024
THREADS_PER_ATTENTION_PROGRAM = 256
missing = amd_backend_missing()
needs_amd_backend = pytest.mark.skipif(missing is not None, reason=str(missing))

RUNS = [(name, arch) for name, (_, _, archs) in CASES.items() for arch in archs]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[dict]]:
    """Every case compiled for every target it runs on, by (case, arch)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    child = subprocess.run(
        [sys.executable, str(HERE / "amd_kernel_cases.py"), *AMD_TARGETS],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert child.returncode == 0, f"the compile process failed:\n{child.stderr[-4000:]}"
    by_case: dict[tuple[str, str], list[dict]] = {}
    for result in json.loads(child.stdout)["results"]:
        by_case.setdefault((result["case"], result["arch"]), []).append(result)
    return by_case


@needs_amd_backend
@pytest.mark.parametrize(("case", "arch"), RUNS, ids=[f"{c}-{a}" for c, a in RUNS])
def test_kernel_compiles_for_the_amd_target_within_its_lds(compiled, case, arch):
    results = compiled[(case, arch)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    target = AMD_TARGETS[arch]
    for result in results:
        assert result["warp_size"] == target.warp_size
        assert result["shared"] <= LDS_LIMIT, (
            f"{result['kernel']} takes {result['shared']} bytes of LDS on {arch}"
        )
        if result["kernel"].startswith("_paged_"):  # the attention kernels' tiles
            threads = result["num_warps"] * result["warp_size"]
            assert threads == THREADS_PER_ATTENTION_PROGRAM


@needs_amd_backend
def test_fused_ops_size_their_launches_by_the_wavefront(compiled):
    """The same rows get the same threads on every target: half the wavefronts where they are
    twice as wide (eight elements per thread)."""
    cases = (
        "ops.rms_norm",
        "ops.rotary_embedding",
        "ops.qk_norm_rotary",
        "ops.silu_and_mul",
        "ops.write_paged_kv",
    )
    for case in (*cases, "attn.write_kv_cache.bf16"):
        threads = {
            arch: compiled[(case, arch)][0]["num_warps"] * AMD_TARGETS[arch].warp_size
            for arch in AMD_TARGETS
        }
        assert len(set(threads.values())) == 1, (case, threads)
    rms = {arch: compiled[("ops.rms_norm", arch)][0]["num_warps"] for arch in AMD_TARGETS}
    assert rms == {"gfx942": 8, "gfx950": 8, "gfx1100": 16}  # 4096 bf16 / 8 = 512 threads


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_interpreted_kernels_are_refused_with_the_fix():
    from pagellm_cuda.ops import layernorm
    from pagellm_rocm.cross_compile import CrossCompileError, recorded_launches

    kernel = layernorm._rms_norm_kernel
    launches = recorded_launches(layernorm, "_rms_norm_kernel")
    with pytest.raises(CrossCompileError, match="run without TRITON_INTERPRET=1"):
        launches.__enter__()
    assert layernorm._rms_norm_kernel is kernel  # left as it was


# ---------------------------------------------------------------------- the tile rules


@pytest.mark.parametrize("arch", list(AMD_TARGETS))
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "head_size"),
    [
        (torch.bfloat16, torch.bfloat16, 64),
        (torch.bfloat16, torch.bfloat16, 128),
        (torch.bfloat16, torch.bfloat16, 256),
        (torch.bfloat16, torch.float8_e4m3fn, 128),
        (torch.float32, torch.float32, 128),
    ],
)
def test_amd_decode_tiles_keep_one_stage_of_k_and_v_within_32_kib(
    arch, dtype, cache_dtype, head_size
):
    target = AMD_TARGETS[arch]
    tiles = decode_tiles(dtype, head_size, cache_dtype, target)
    stage = 2 * tiles.block_n * head_size * cache_dtype.itemsize
    assert stage <= 32 * 1024 and (tiles.block_n == 128 or stage == 32 * 1024)
    assert tiles.num_warps * target.warp_size == THREADS_PER_ATTENTION_PROGRAM
    assert tiles.num_stages == 2


@pytest.mark.parametrize(
    ("arch", "dtype", "block_n", "block_m"),
    [
        ("gfx942", torch.bfloat16, 64, 64),
        ("gfx950", torch.float32, 32, 16),
        ("gfx1100", torch.bfloat16, 32, 16),
        ("gfx1100", torch.float32, 16, 16),
    ],
)
def test_amd_mixed_tiles_per_family(arch, dtype, block_n, block_m):
    tiles = mixed_tiles(dtype, 128, 4, 512, AMD_TARGETS[arch])
    assert (tiles.block_n, tiles.block_m, tiles.block_q) == (block_n, block_m, block_m // 4)
    assert tiles.num_warps * AMD_TARGETS[arch].warp_size == THREADS_PER_ATTENTION_PROGRAM


def test_nvidia_and_interpreter_tiles_are_unchanged_by_targets():
    from triton.backends.compiler import GPUTarget

    hopper = GPUTarget("cuda", 90, 32)
    for target in (None, hopper):
        assert mixed_tiles(torch.bfloat16, 128, 4, 64, target).num_stages == 3
        assert decode_tiles(torch.bfloat16, 128, torch.bfloat16, target).block_n == 64
