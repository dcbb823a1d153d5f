"""Triton kernels reading GGUF blocks: dequantize to a float matrix, and a matmul that
dequantizes its weight tiles in registers.

Each weight (row ``n``, column ``k``) is decoded where it lies: its block is ``k // block_size``,
at byte ``n * row_bytes + block * type_size`` of the raw rows, and its scale and quant bits sit at
fixed offsets of the block (llama.cpp's layout, ggml-common.h; ``gguf.quants`` dequantizes the
same bytes in numpy, the reference of the tests). A block's scales are loaded once per group of
weights sharing them; the quant bytes once per weight (the two nibbles of a byte hit the cache),
so the weight bytes are read from memory about once.
"""

from __future__ import annotations

import triton
import triton.language as tl

# GGMLQuantizationType values (gguf.constants), as kernel constants.
Q4_0: tl.constexpr = tl.constexpr(2)
Q4_1: tl.constexpr = tl.constexpr(3)
Q8_0: tl.constexpr = tl.constexpr(8)
Q4_K: tl.constexpr = tl.constexpr(12)
Q5_K: tl.constexpr = tl.constexpr(13)
Q6_K: tl.constexpr = tl.constexpr(14)


@triton.jit
def _u8(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, offs, mask):
    """The little-endian float16 at byte ``offs`` (blocks are byte-aligned only), as float32."""
    bits = _u8(ptr, offs, mask) | (_u8(ptr, offs + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(ptr, scales, sub, mask):
    """Sub-block ``sub``'s 6-bit scale and min of a Q4_K/Q5_K super-block (12 packed bytes at
    ``scales``): sub-blocks 0-3 use the low 6 bits of bytes 0-7; 4-7 the nibbles of bytes 8-11
    with the top 2 bits of bytes 0-7."""
    low = sub < 4
    b_sub = _u8(ptr, scales + sub, mask)
    b_next = _u8(ptr, scales + sub + 4, mask)
    b_prev = _u8(ptr, scales + tl.where(low, sub, sub - 4), mask)
    scale = tl.where(low, b_sub & 63, (b_next & 15) | ((b_prev >> 6) << 4))
    minimum = tl.where(low, b_next & 63, (b_next >> 4) | ((b_sub >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _spread(t, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SIZE: tl.constexpr):
    """Per-group values [BLOCK_N, GROUPS] repeated over each group's SIZE columns."""
    wide = tl.broadcast_to(t[:, :, None], (BLOCK_N, GROUPS, SIZE))
    return tl.reshape(wide, (BLOCK_N, GROUPS * SIZE))


@triton.jit
def dequantize_tile(
    w_ptr,
    offs_n,
    k0,
    N,
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The float32 weights [BLOCK_N, BLOCK_K] at rows ``offs_n``, columns ``k0`` (a multiple of
    BLOCK_K, itself a power of two >= 32) onwards, of raw GGUF rows of type ``QTYPE``.

    Scales are read once per group of weights sharing them (32; 16 for Q6_K) and spread over the
    group; quant bits are read per weight."""
    row = offs_n.to(tl.int64)[:, None] * row_bytes
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_in = (offs_n < N)[:, None]
    mask = n_in & (offs_k < K)[None, :]
    # Q4_0, Q4_1, Q8_0 have 32-weight blocks; the K-quants (12-14) 256-weight super-blocks.
    if QTYPE < Q4_K:
        offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # the tile's blocks
        g_mask = n_in & (offs_g * 32 < K)[None, :]
        j = (offs_k % 32)[None, :]
        if QTYPE == Q4_0:
            block = row + (offs_g * 18)[None, :]
            base = row + (offs_k // 32 * 18)[None, :]
            q = (_u8(w_ptr, base + 2 + j % 16, mask) >> (j // 16 * 4)) & 15
            d = _spread(_f16(w_ptr, block, g_mask), BLOCK_N, BLOCK_K // 32, 32)
            w = d * (q - 8).to(tl.float32)
        elif QTYPE == Q4_1:
            block = row + (offs_g * 20)[None, :]
            base = row + (offs_k // 32 * 20)[None, :]
            q = (_u8(w_ptr, base + 4 + j % 16, mask) >> (j // 16 * 4)) & 15
            d = _spread(_f16(w_ptr, block, g_mask), BLOCK_N, BLOCK_K // 32, 32)
            m = _spread(_f16(w_ptr, block + 2, g_mask), BLOCK_N, BLOCK_K // 32, 32)
            w = d * q.to(tl.float32) + m
        else:
            block = row + (offs_g * 34)[None, :]
            base = row + (offs_k // 32 * 34)[None, :]
            b = _u8(w_ptr, base + 2 + j, mask)
            d = _spread(_f16(w_ptr, block, g_mask), BLOCK_N, BLOCK_K // 32, 32)
            w = d * (b - ((b >> 7) << 8)).to(tl.float32)  # int8
    else:
        j = (offs_k % 256)[None, :]
        sub = j // 32
        if QTYPE == Q6_K:
            # ql[128] (low nibbles), qh[64] (2 high bits), int8 scales[16] (one per 16), d.
            offs_g = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            g_mask = n_in & (offs_g * 16 < K)[None, :]
            block = row + (offs_g // 16 * 210)[None, :]
            s = _u8(w_ptr, block + 192 + (offs_g % 16)[None, :], g_mask)
            ds = _f16(w_ptr, block + 208, g_mask) * (s - ((s >> 7) << 8)).to(tl.float32)
            base = row + (offs_k // 256 * 210)[None, :]
            ql = _u8(w_ptr, base + j // 128 * 64 + j % 64, mask) >> (j % 128 // 64 * 4)
            qh = _u8(w_ptr, base + 128 + j // 128 * 32 + j % 32, mask) >> (j % 128 // 32 * 2)
            q = ((ql & 15) | ((qh & 3) << 4)) - 32
            w = _spread(ds, BLOCK_N, BLOCK_K // 16, 16) * q.to(tl.float32)
        else:
            # Q4_K: d, dmin, 12 scale bytes, 128 nibble bytes; Q5_K adds 32 high-bit bytes
            # before the nibbles. One 6-bit scale and min per 32-weight sub-block.
            offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            g_mask = n_in & (offs_g * 32 < K)[None, :]
            if QTYPE == Q4_K:
                block = row + (offs_g // 8 * 144)[None, :]
                base = row + (offs_k // 256 * 144)[None, :]
                q = (_u8(w_ptr, base + 16 + j // 64 * 32 + j % 32, mask) >> (sub % 2 * 4)) & 15
            else:
                block = row + (offs_g // 8 * 176)[None, :]
                base = row + (offs_k // 256 * 176)[None, :]
                q = (_u8(w_ptr, base + 48 + j // 64 * 32 + j % 32, mask) >> (sub % 2 * 4)) & 15
                q = q | (((_u8(w_ptr, base + 16 + j % 32, mask) >> sub) & 1) << 4)
            scale, minimum = _k_scale_min(w_ptr, block + 4, (offs_g % 8)[None, :], g_mask)
            d_scale = _f16(w_ptr, block, g_mask) * scale
            d_min = _f16(w_ptr, block + 2, g_mask) * minimum
            w = _spread(d_scale, BLOCK_N, BLOCK_K // 32, 32) * q.to(tl.float32)
            w = w - _spread(d_min, BLOCK_N, BLOCK_K // 32, 32)
    return w


@triton.jit
def dequantize_kernel(
    w_ptr,
    out_ptr,
    N,
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w = dequantize_tile(w_ptr, offs_n, k0, N, K, row_bytes, QTYPE, BLOCK_N, BLOCK_K)
    out = out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequant_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    row_bytes,
    stride_xm,
    stride_ym,
    stride_ys,
    K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    QTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[s, M, N] = x[M, K_s] @ W[N, K_s]^T over the ``s``-th run of ``K_SPLIT`` columns
    (program axis 2), W decoded tile by tile from its GGUF rows; float32 accumulation (IEEE
    products for float32 activations, not TF32). With one split, y is the output; with several,
    float32 partial sums that the caller adds. K is a compile-time constant: a model has a few
    in_features, and the loop bound is then known."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = tl.program_id(2) * K_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=(offs_m[:, None] < M) & k_in[None, :],
            other=0.0,
        )
        w = dequantize_tile(w_ptr, offs_n, k_start + k0, N, K, row_bytes, QTYPE, BLOCK_N, BLOCK_K)
        w = w.to(x.dtype)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    y = y_ptr + tl.program_id(2) * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
