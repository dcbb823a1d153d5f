"""W4A16 on Triton, from the kernel layout (``pagellm_int4.kernel_layout``): tile-interleaved
int32 words (word row r of a 128-row tile holds, in nibble i, row 16 i + r), float32 scales and
uint8 zeros [G, N], contiguous groups.

- `w4a16_gemm` (decode): a program streams the words of its [128, BLOCK_N] weight tiles once.
  A word tile [16, BLOCK_N] holds eight *slabs*: nibble ``i`` of every word, the 16 consecutive
  input rows ``k0 + 16 i .. k0 + 16 i + 15``, multiplied with one contiguous [BLOCK_M, 16] load
  of the activations. Three kinds of program: ``dot`` (tensor cores, one ``tl.dot`` per slab,
  K = 16), ``dot_t`` (the same product transposed, out^T = W^T x^T: with the inline PTX the
  unpacked weights are the MMA's A operand straight from registers, and on sm_90 128 columns
  make it a warpgroup MMA; elsewhere it runs as ``dot``) and ``fma`` (CUDA cores, a few rows a
  program, float32 products and sums). Both unpack with inline PTX (two
  words at a time: byte permutes, a shift and a LOP3 per pair of codes, and one packed FMA that
  leaves ``q - z``, exact); the codes are built as float bits (``offset + q``), never through an
  int-to-float conversion, a quarter-rate instruction that bounded the first version of this
  kernel. When a tile lies in one group the scale is applied once per tile and column; for
  shorter groups every weight is dequantized, ``(q - z) * s``, before the product.
  Small M splits K over several programs (`tile_config`), whose float32 partial sums are added
  in a fixed order (deterministic: graph replays equal eager runs), by the last program of each
  output tile to finish (``reduce="serial"``, one launch) or by a second kernel.
- `dequantize_int4` (prefill, in ``dequantize.py``): the whole weight [K, N] in the activation
  dtype, for a cuBLAS GEMM, slab by slab from each word tile.

Tiles come from a table measured on the GPU (``configs/<device name>.json``, written by
``benchmarks/int4_gemm.py --sweep``) for the shapes it lists, else from `tile_config`'s rule.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pagellm_int4.kernel_layout import TILE_K
from pagellm_int4.kernels.dequantize import dequantize_int4
from pagellm_int4.kernels.inputs import Int4KernelInputError, check_weight
from pagellm_int4.kernels.split_k import add_splits_if_last, sum_splits_kernel, tile_counters
from pagellm_int4.kernels.tiles import (
    SAFE_TILES,
    TENSOR_CORE_KINDS,
    TileConfig,
    scales_per_tile,
    tile_config,
)
from pagellm_int4.kernels.unpack import CODE_OF, CODE_OFFSET, codes_f32, slab_codes, unpack_slabs

__all__ = ["Int4KernelInputError", "dequantize_int4", "w4a16_gemm"]

logger = logging.getLogger(__name__)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _activation_slab(
    x_ptr, offs_m, rows, M, K, stride_xm, MASK_M: tl.constexpr, EVEN_K: tl.constexpr
):
    """x[offs_m, rows] (x's rows contiguous), zero outside [M, K]; masks only where needed."""
    ptrs = x_ptr + offs_m[:, None] * stride_xm + rows[None, :]
    if MASK_M and not EVEN_K:
        return tl.load(ptrs, mask=(offs_m < M)[:, None] & (rows < K)[None, :], other=0.0)
    elif MASK_M:
        return tl.load(ptrs, mask=(offs_m < M)[:, None], other=0.0)
    elif not EVEN_K:
        return tl.load(ptrs, mask=(rows < K)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_om,
    stride_os,
    split_k,
    TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    SERIAL: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALES_PER_TILE: tl.constexpr,
    USE_DOT: tl.constexpr,
    USE_ASM: tl.constexpr,
    SWAP: tl.constexpr,
    CHAINS: tl.constexpr,
    CODE: tl.constexpr,
    OFFSET: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """EVEN_K: K is a multiple of BLOCK_K; EVEN_N: N is a multiple of BLOCK_N. Then the weight
    loads need no mask (the bounds checks cost as much as the unpacking).

    Split-K (SPLIT): program ``pid_s`` of ``split_k`` takes K tiles
    ``[pid_s T / S, (pid_s + 1) T / S)`` (any S, balanced to one tile; TILES of them each when S
    divides T) and writes its float32 partial sums to ``ws``. SERIAL: the last program of an
    output tile to arrive (a counter per tile, taken with acquire-release atomics and put back
    to zero for the next launch) adds the S partials in split order and writes the output, so
    one launch does it all and the sum does not depend on who came last; otherwise
    `sum_splits_kernel` adds them in a second launch."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)  # word rows of a tile
    mask_m: tl.constexpr = BLOCK_M > 1  # one row a program: the grid covers M exactly
    n_mask = offs_n < N
    words_k = (K + BLOCK_K - 1) // BLOCK_K * (BLOCK_K // 8)  # the padded tiles' word rows
    # The dot kind accumulates [BLOCK_M, BLOCK_N]; the fma kind keeps one partial sum per word
    # row too, [BLOCK_M, BLOCK_K / 8, BLOCK_N], summed over the word rows once at the end (no
    # cross-thread reduction in the loop).
    if SWAP:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    if TILES > 0:  # the splits share K evenly: a loop of known length (fewer registers)
        first = pid_s * TILES
        n_tiles = TILES
    else:
        k_tiles = (K + BLOCK_K - 1) // BLOCK_K
        first = pid_s * k_tiles // split_k
        n_tiles = (pid_s + 1) * k_tiles // split_k - first
    w_ptrs = qw_ptr + (first * (BLOCK_K // 8) + offs_w)[:, None] * stride_qk + offs_n[None, :]
    for t in range(n_tiles):
        k0 = (first + t) * BLOCK_K
        if EVEN_K and EVEN_N:
            words = tl.load(w_ptrs)
        else:
            offs_r = k0 // 8 + offs_w
            words = tl.load(w_ptrs, mask=(offs_r < words_k)[:, None] & n_mask[None, :], other=0)
        w_ptrs += (BLOCK_K // 8) * stride_qk
        if SCALES_PER_TILE:
            g = k0 // GROUP_SIZE
            if EVEN_K and EVEN_N:
                s = tl.load(s_ptr + g * N + offs_n)
                z = tl.load(z_ptr + g * N + offs_n).to(tl.float32)
            else:
                tile_in = n_mask & (k0 < K)
                s = tl.load(s_ptr + g * N + offs_n, mask=tile_in, other=0.0)
                z = tl.load(z_ptr + g * N + offs_n, mask=tile_in, other=0).to(tl.float32)
            if USE_ASM:
                # q - z per weight inside the unpack: no activation sums (whose cross-thread
                # reductions cost more barriers than the products), a's only use is the product.
                neg_zero = (-(z + OFFSET)).to(x_ptr.dtype.element_ty)
                slabs = unpack_slabs(words, tl.broadcast_to(neg_zero[None, :], words.shape), CODE)
                if USE_DOT:
                    if SWAP:  # out^T = W^T x^T: the weights are the A operand, from registers
                        part_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                        for i in tl.static_range(8):
                            rows = k0 + (BLOCK_K // 8) * i + offs_w
                            a = _activation_slab(
                                x_ptr, offs_m, rows, M, K, stride_xm, mask_m, EVEN_K
                            )
                            part_t = tl.dot(tl.trans(slabs[i]), tl.trans(a), part_t)
                        acc_t += part_t * s[:, None]
                    else:
                        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        if CHAINS == 2:  # odd slabs into a second sum: two MMA chains of four
                            part2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        for i in tl.static_range(8):
                            rows = k0 + (BLOCK_K // 8) * i + offs_w
                            a = _activation_slab(
                                x_ptr, offs_m, rows, M, K, stride_xm, mask_m, EVEN_K
                            )
                            if CHAINS == 2 and i % 2 == 1:
                                part2 = tl.dot(a, slabs[i], part2)
                            else:
                                part = tl.dot(a, slabs[i], part)
                        if CHAINS == 2:
                            part += part2
                        acc += part * s[None, :]
                else:  # fma: products on the CUDA cores, one sum per word row
                    part = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
                    for i in tl.static_range(8):
                        rows = k0 + (BLOCK_K // 8) * i + offs_w
                        a = _activation_slab(x_ptr, offs_m, rows, M, K, stride_xm, mask_m, EVEN_K)
                        part += a.to(tl.float32)[:, :, None] * slabs[i].to(tl.float32)[None, :, :]
                    acc += part * s[None, None, :]
            elif USE_DOT:
                # offset + q in the product, offset + z times the activations' sum taken off
                # once per tile (the sum reduced across threads once, not per slab).
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if CHAINS == 2:
                    part2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                a_sum = tl.zeros((BLOCK_M, BLOCK_K // 8), dtype=tl.float32)
                for i in tl.static_range(8):
                    rows = k0 + (BLOCK_K // 8) * i + offs_w
                    a = _activation_slab(x_ptr, offs_m, rows, M, K, stride_xm, mask_m, EVEN_K)
                    if CHAINS == 2 and i % 2 == 1:
                        part2 = tl.dot(a, slab_codes(words, i, CODE), part2)
                    else:
                        part = tl.dot(a, slab_codes(words, i, CODE), part)
                    a_sum += a.to(tl.float32)
                if CHAINS == 2:
                    part += part2
                x_sum = tl.sum(a_sum, axis=1)
                acc += (part - x_sum[:, None] * (z[None, :] + OFFSET)) * s[None, :]
            else:
                part = tl.zeros((BLOCK_M, BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
                x_sum = tl.zeros((BLOCK_M, BLOCK_K // 8), dtype=tl.float32)
                for i in tl.static_range(8):
                    rows = k0 + (BLOCK_K // 8) * i + offs_w
                    a = _activation_slab(x_ptr, offs_m, rows, M, K, stride_xm, mask_m, EVEN_K)
                    part += a.to(tl.float32)[:, :, None] * codes_f32(words, i)[None, :, :]
                    x_sum += a.to(tl.float32)
                acc += (part - x_sum[:, :, None] * z[None, None, :]) * s[None, None, :]
        else:
            for i in tl.static_range(8):
                rows = k0 + (BLOCK_K // 8) * i + offs_w
                k_in = rows < K
                a = _activation_slab(x_ptr, offs_m, rows, M, K, stride_xm, mask_m, EVEN_K)
                w_mask = k_in[:, None] & n_mask[None, :]
                g_rows = (rows // GROUP_SIZE)[:, None] * N + offs_n[None, :]
                s2 = tl.load(s_ptr + g_rows, mask=w_mask, other=0.0)
                z2 = tl.load(z_ptr + g_rows, mask=w_mask, other=0).to(tl.float32)
                w = ((codes_f32(words, i) - z2) * s2).to(a.dtype)
                if USE_DOT:
                    acc = tl.dot(a, w, acc)
                else:
                    acc += a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc, axis=1)
    if SWAP:  # one transpose per program, at the end
        acc = tl.trans(acc_t)
    out_mask = (offs_m < M)[:, None] & n_mask[None, :]
    offs_out = offs_m[:, None] * stride_om + offs_n[None, :]
    if not SPLIT:
        tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(ws_ptr + pid_s * stride_os + offs_out, acc, mask=out_mask)
        if SERIAL:
            add_splits_if_last(
                ws_ptr, cnt_ptr, out_ptr, offs_out, out_mask, stride_os, split_k, BLOCK_M, BLOCK_N
            )


@functools.cache
def _device_facts(device: torch.device) -> tuple[int, str]:
    if device.type != "cuda":
        return 1, ""  # the interpreter runs one program after another
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.name


@functools.cache
def _warn_fallback(tiles: TileConfig, fallback: TileConfig, reason: str) -> None:
    logger.warning("int4 GEMM tiles %s do not fit this GPU (%s); using %s", tiles, reason, fallback)


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    out: torch.Tensor,
    ws: torch.Tensor,
    group_size: int,
    tiles: TileConfig,
    splits: int,
    per_tile: bool,
    use_asm: bool,
) -> None:
    m, k = x.shape
    n = qweight.shape[1]
    code = CODE_OF[x.dtype]
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), splits)
    k_tiles = triton.cdiv(k, tiles.block_k)
    serial = splits > 1 and tiles.reduce == "serial"
    counters = tile_counters(x.device, grid[0] * grid[1]) if serial else out
    _w4a16_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        out,
        ws,
        counters,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        n,
        m * n,
        splits,
        TILES=k_tiles // splits if k_tiles % splits == 0 else 0,
        SPLIT=splits > 1,
        SERIAL=serial,
        GROUP_SIZE=group_size,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        SCALES_PER_TILE=per_tile,
        USE_DOT=tiles.kind in TENSOR_CORE_KINDS,
        USE_ASM=use_asm,
        SWAP=use_asm and tiles.kind == "dot_t",
        CHAINS=tiles.chains,
        CODE=code,
        OFFSET=CODE_OFFSET[code],
        EVEN_K=k % tiles.block_k == 0,
        EVEN_N=n % tiles.block_n == 0,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    split_k: int | None = None,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """``x`` [M, K] (bf16, fp16; fp32 in the interpreter) times the int4 weight: [M, N] in x's
    dtype. ``tiles`` replaces the table's or rule's tiles, ``split_k`` their split (tests and
    ``benchmarks/int4_gemm.py --sweep``)."""
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise Int4KernelInputError(
            f"x has shape {tuple(x.shape)} and dtype {x.dtype}; expected [M, K] bf16/fp16/fp32"
        )
    m, k = x.shape
    n = check_weight(qweight, scales, zeros, k, group_size)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if tiles is None:
        num_sms, name = _device_facts(x.device)
        tiles = tile_config(m, n, k, group_size, num_sms, name)
    if tiles.block_k != TILE_K:
        raise Int4KernelInputError(
            f"the kernel reads whole interleaved tiles: BLOCK_K must be {TILE_K}, got {tiles}"
        )
    code = CODE_OF[x.dtype]
    per_tile = scales_per_tile(k, group_size, tiles.block_k)
    # Inline PTX compiles only for the GPU, and packs 16-bit codes.
    use_asm = tiles.unpack == "asm" and x.is_cuda and per_tile and code > 0
    # No more splits than K tiles: every split has at least one.
    splits = max(1, min(split_k or tiles.split_k, triton.cdiv(k, tiles.block_k)))
    ws = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    args = (x, qweight, scales, zeros, out, ws, group_size)
    try:
        _launch(*args, tiles, splits, per_tile, use_asm)
    except OutOfResources as exc:
        # Tiles that overflow this GPU's shared memory or registers (a table made on a larger
        # GPU, or a rule that misjudged): narrower single-stage tiles, with a warning once.
        fallback = dataclasses.replace(
            SAFE_TILES, block_m=max(16, tiles.block_m), reduce=tiles.reduce
        )
        _warn_fallback(tiles, fallback, str(exc))
        _launch(*args, fallback, splits, per_tile, use_asm)
    if splits > 1 and tiles.reduce != "serial":
        block = 1024
        sum_splits_kernel[(triton.cdiv(m * n, block),)](ws, out, m * n, SPLIT_K=splits, BLOCK=block)
    return out
