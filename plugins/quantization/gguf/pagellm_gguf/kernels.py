"""Triton kernels over GGUF planes (``planes.py``): a decode matmul that dequantizes its weight
tiles in registers, and a dequantize to a float matrix (the prefill path's cuBLAS input).

A K tile of ``BLOCK_K`` input rows and ``BLOCK_N`` columns is one load of its code words
``[BLOCK_K / PER_WORD, BLOCK_N]`` (coalesced along N), its scales (and biases, high bits) loaded
at the same shape (row ``r`` of the tile reads the group of input rows ``PER_WORD * r + i``,
the same group for every ``i``: the planes' rows repeat, hitting the cache). Code ``i`` of every
word, ``(words >> bits * i) & mask``, is the ``[BLOCK_K / PER_WORD, BLOCK_N]`` slab of input rows
``k0 + PER_WORD * r + i``; it is dequantized as ``(q - OFFSET) * scale + bias`` in float32 (the
`gguf` package's operations: bit-exact) and multiplied with the matching strided columns of x.
No reshape or broadcast moves data between threads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_pointers(
    codes_ptr,
    high_ptr,
    scale_ptr,
    bias_ptr,
    k0,
    offs_n,
    N,
    PER_WORD: tl.constexpr,
    HIGH_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Pointers [BLOCK_K / PER_WORD, BLOCK_N] into the planes for input rows ``k0 ..
    k0 + BLOCK_K`` (``k0`` a multiple of BLOCK_K) at columns ``offs_n``: code words, high-bit
    words, scales, biases (the high words and biases are stand-ins where the type has none), and
    each word row's shift into its high word (the same for every tile)."""
    offs_r = tl.arange(0, BLOCK_K // PER_WORD)
    first_row = k0 + offs_r * PER_WORD  # the input row of each word row's code 0
    cols = offs_n[None, :]
    codes = codes_ptr + (first_row // PER_WORD).to(tl.int64)[:, None] * N + cols
    group = (first_row // GROUP).to(tl.int64)[:, None] * N + cols
    if HIGH_BITS > 0:
        high_rows = 32 // HIGH_BITS  # input rows per high word
        high = high_ptr + (first_row // high_rows).to(tl.int64)[:, None] * N + cols
        high_shift = ((first_row % high_rows) * HIGH_BITS).to(tl.uint32)[:, None]
    else:
        high = codes
        high_shift = offs_r.to(tl.uint32)[:, None]
    return codes, high, scale_ptr + group, bias_ptr + group, high_shift


@triton.jit
def _load_planes(codes, high, scale, bias, mask, HIGH_BITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One tile of each plane (stand-ins for the planes a type lacks; constexpr conditions:
    only the chosen side is compiled)."""
    # Unsigned words: logical shifts, no sign extension to undo.
    words = tl.load(codes, mask=mask, other=0).to(tl.uint32, bitcast=True)
    scales = tl.load(scale, mask=mask, other=0.0).to(tl.float32)
    biases = tl.load(bias, mask=mask, other=0.0).to(tl.float32) if HAS_BIAS else scales
    if HIGH_BITS > 0:
        highs = tl.load(high, mask=mask, other=0).to(tl.uint32, bitcast=True)
    else:
        highs = words
    return words, highs, scales, biases


@triton.jit
def _decode_slab(
    words,
    high,
    high_shift,
    scale,
    bias,
    i: tl.constexpr,
    CODE_BITS: tl.constexpr,
    SIGNED: tl.constexpr,
    HIGH_BITS: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Float32 weights of code ``i`` of each word (input rows ``PER_WORD * r + i``).

    The code becomes a float through the bits of ``2^23 + q`` (exact for q < 2^23) and one
    subtraction: full-rate ALU operations, where an int -> float conversion runs at an eighth of
    the rate on recent GPUs and would bound the kernel below memory speed."""
    q = (words >> (CODE_BITS * i)) & (2**CODE_BITS - 1)
    if HIGH_BITS > 0:
        top = (high >> (high_shift + HIGH_BITS * i)) & (2**HIGH_BITS - 1)
        q = q | (top << CODE_BITS)
    if SIGNED:  # a two's-complement code c, top bit flipped, is c + 2^(bits - 1)
        q = q ^ 2 ** (CODE_BITS - 1)
        zero = 8388608.0 + OFFSET + 2 ** (CODE_BITS - 1)
    else:
        zero = 8388608.0 + OFFSET
    w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - zero) * scale
    if HAS_BIAS:
        w = w + bias
    return w


@triton.jit
def plane_matmul_kernel(
    x_ptr,
    codes_ptr,
    high_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_ym,
    stride_ys,
    K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    CODE_BITS: tl.constexpr,
    SIGNED: tl.constexpr,
    HIGH_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[s, M, N] = x[M, K_s] @ W[N, K_s]^T over the ``s``-th run of ``K_SPLIT`` input rows
    (program axis 2), W decoded slab by slab from its planes; float32 accumulation (IEEE
    products for float32 activations, not TF32). With one split, y is the output; with several,
    float32 partial sums that the caller adds. K is a compile-time constant: a model has a few
    in_features, and the loop bound is then known.

    ``USE_DOT``: each slab goes through ``tl.dot`` (BLOCK_M >= 16, rows of x past M masked;
    the decoded slab passes through shared memory into the MMA operand layout). Otherwise
    (BLOCK_M = 1: one row of x per program) each thread multiplies and adds its own weights in
    float32 into ``[rows, BLOCK_N]`` partial sums reduced once after the loop: one FMA per
    weight, no shared memory in the loop."""
    PER_WORD: tl.constexpr = 32 // CODE_BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_in = (offs_n < N)[None, :]
    m_in = (offs_m < M)[:, None]
    offs_r = tl.arange(0, BLOCK_K // PER_WORD)
    k_start = tl.program_id(2) * K_SPLIT
    # Pointers computed once and advanced by a scalar per tile (no per-element 64-bit math).
    codes, high, scale, bias, high_shift = _tile_pointers(
        codes_ptr, high_ptr, scale_ptr, bias_ptr, k_start, offs_n, N,
        PER_WORD, HIGH_BITS, GROUP, BLOCK_K,
    )  # fmt: skip
    # With tl.dot: x [BLOCK_M, slab rows] per slab; without (BLOCK_M = 1): x a vector.
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_r * PER_WORD)[None, :]
    x_row = x_ptr + tl.program_id(1) * stride_xm + k_start + offs_r * PER_WORD
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        partial = tl.zeros((BLOCK_K // PER_WORD, BLOCK_N), dtype=tl.float32)
    for k_step in range(0, K_SPLIT, BLOCK_K):
        # K is a multiple of PER_WORD: a word row inside K has all its codes inside K.
        row_in = k_start + k_step + offs_r * PER_WORD < K
        words, highs, scales, biases = _load_planes(
            codes, high, scale, bias, row_in[:, None] & n_in, HIGH_BITS, HAS_BIAS
        )
        for i in tl.static_range(PER_WORD):
            w = _decode_slab(
                words, highs, high_shift, scales, biases, i, CODE_BITS, SIGNED, HIGH_BITS,
                OFFSET, HAS_BIAS,
            )  # fmt: skip
            if not USE_DOT:
                x = tl.load(x_row + i, mask=row_in, other=0.0)
                partial += x.to(tl.float32)[:, None] * w
            elif IEEE:
                x = tl.load(x_ptrs + i, mask=m_in & row_in[None, :], other=0.0)
                acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
            else:
                x = tl.load(x_ptrs + i, mask=m_in & row_in[None, :], other=0.0)
                acc = tl.dot(x, w.to(x.dtype), acc)
        codes += (BLOCK_K // PER_WORD) * N
        scale += (BLOCK_K // GROUP) * N
        bias += (BLOCK_K // GROUP) * N
        if HIGH_BITS > 0:
            high += (BLOCK_K * HIGH_BITS // 32) * N
        x_ptrs += BLOCK_K
        x_row += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(partial, axis=0)[None, :]
    y = y_ptr + tl.program_id(2) * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_in & (offs_n[None, :] < N))


@triton.jit
def plane_dequantize_kernel(
    codes_ptr,
    high_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    CODE_BITS: tl.constexpr,
    SIGNED: tl.constexpr,
    HIGH_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W^T [K, N] in ``out_ptr``'s dtype (rows along N: coalesced stores), one tile of
    BLOCK_K input rows and BLOCK_N columns per program."""
    PER_WORD: tl.constexpr = 32 // CODE_BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_r = tl.arange(0, BLOCK_K // PER_WORD)
    codes, high, scale, bias, high_shift = _tile_pointers(
        codes_ptr, high_ptr, scale_ptr, bias_ptr, k0, offs_n, N, PER_WORD, HIGH_BITS, GROUP,
        BLOCK_K,
    )  # fmt: skip
    row_in = k0 + offs_r * PER_WORD < K
    mask = row_in[:, None] & (offs_n < N)[None, :]
    words, highs, scales, biases = _load_planes(codes, high, scale, bias, mask, HIGH_BITS, HAS_BIAS)
    for i in tl.static_range(PER_WORD):
        w = _decode_slab(
            words, highs, high_shift, scales, biases, i, CODE_BITS, SIGNED, HIGH_BITS, OFFSET,
            HAS_BIAS,
        )  # fmt: skip
        offs_k = k0 + offs_r * PER_WORD + i
        out = out_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)
