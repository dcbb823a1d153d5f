"""The step both attention kernels repeat: fold one tile of paged keys and values into a running
softmax.

Softmax runs online in float32 and in base 2: the host multiplies the scale by `LOG2E` once, so
``exp2`` replaces ``exp`` and log-sum-exps are base-2.

An FP8 cache's tiles are converted to the query's dtype after loading (exact: e4m3 values are
bfloat16 and float16 values); its key scale is folded into ``qk_scale`` by the host and its value
scale multiplies the finished output (the kernels' ``KV_FP8``), so a tile costs no extra multiply.
In the model dtype the conversions are no-ops and the compiled kernels unchanged.

``V_TOKEN_MINOR``: the value cache stores each page token-minor (an FP8 cache's, see
`launch.split_kv_cache`). Its tiles are then loaded unmasked along the keys, as runs of 16
contiguous bytes the compiler is told about (a page index is a loaded value, so it cannot prove
them): slots past the sequence end hold finite values there and get weight 0.

`attend_paged_tile_swapped` is `attend_paged_tile` with both products transposed, for
`paged_decode` with ``Tiles.swap_ab``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A finite "minus infinity" for the running max: a row that has seen no key keeps it, and then
# exp2(m_old - m_new) is 1 rather than NaN.
NO_MAX: tl.constexpr = tl.constexpr(-1.0e30)
# With FP8 products (`Tiles.fp8_mma`) the softmax weights, in [0, 1], enter P @ V times this, as
# e4m3: weights down to 2^-14 then keep e4m3's three-bit mantissa (down to 2^-6 without it),
# and the largest, 256, stays below e4m3's 448. The output is divided back.
P_FP8_SCALE: tl.constexpr = tl.constexpr(256.0)


@triton.jit
def _load_kv_tile(ptrs, n_ok, d_ok, MASK_N: tl.constexpr, MASK_D: tl.constexpr):
    # Four variants so that tiles needing no mask are plain (unpredicated) vector loads.
    if MASK_N:
        if MASK_D:
            tile = tl.load(ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=n_ok[:, None], other=0.0)
    elif MASK_D:
        tile = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_head_ptr,
    v_head_ptr,
    bt_row_ptr,
    n0,
    seq_len,
    window,
    qk_scale,
    stride_cb,
    stride_cs,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_TOKEN_MINOR: tl.constexpr,
):
    """Fold keys [n0, n0 + BLOCK_N) of one sequence and KV head into the running softmax.

    ``MASKED`` tiles apply the causal, window and sequence-end masks; the caller proves that
    the other tiles are entirely visible to every row that matters."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        page = tl.load(bt_row_ptr + offs_n // PAGE, mask=offs_n < seq_len, other=0)
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE)
    return attend_paged_tile(
        acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, page, n0, seq_len, window, qk_scale,
        stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D, HEAD_SIZE, MASKED, USE_WINDOW,
        DOT_PRECISION, V_TOKEN_MINOR,
    )  # fmt: skip


@triton.jit
def tile_pages(bt_row_ptr, n0, seq_len, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache page of each key of the tile starting at ``n0`` (0 past the sequence end)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_row_ptr + offs_n // PAGE, mask=offs_n < seq_len, other=0)


@triton.jit
def attend_paged_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_head_ptr,
    v_head_ptr,
    page,
    n0,
    seq_len,
    window,
    qk_scale,
    stride_cb,
    stride_cs,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_TOKEN_MINOR: tl.constexpr,
):
    """`attend_tile` with the tile's pages already loaded (`tile_pages`)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seq_len
    d_ok = offs_d < HEAD_SIZE
    offs = (page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_cs)[:, None] + offs_d[None, :]
    k = _load_kv_tile(k_head_ptr + offs, n_ok, d_ok, MASKED, BLOCK_D != HEAD_SIZE).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # V beyond the sequence end may be uninitialised (NaN): it must be loaded as zeros, since
    # 0 * NaN would poison the accumulator.
    if V_TOKEN_MINOR:
        # Pages are multiples of 16 slots (`block_size_multiple`), their starts 16-aligned.
        offs_v = (page.to(tl.int64) * stride_cb + offs_n % PAGE)[:, None] + offs_d[None, :] * PAGE
        offs_v = tl.max_contiguous(tl.multiple_of(offs_v, [16, 1]), [16, 1])
        v = _load_kv_tile(v_head_ptr + offs_v, n_ok, d_ok, False, BLOCK_D != HEAD_SIZE)
    else:
        v = _load_kv_tile(v_head_ptr + offs, n_ok, d_ok, MASKED, BLOCK_D != HEAD_SIZE)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_paged_tile_swapped(
    acc_t,
    m_i,
    l_i,
    q_t,
    q_pos,
    k_head_ptr,
    v_head_ptr,
    page,
    n0,
    seq_len,
    window,
    qk_scale,
    stride_cb,
    stride_cs,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_TOKEN_MINOR: tl.constexpr,
    FP8_P: tl.constexpr,
):
    """`attend_paged_tile` with both products transposed (``Tiles.swap_ab``): S^T = K Q^T and
    O^T += V^T P^T, so the key tile's BLOCK_N rows, not the 16 padded query rows, are the
    MMA's M dimension (a warpgroup MMA on sm_90). ``acc_t`` is [BLOCK_D, rows]; ``qk_scale`` a
    scalar or a [1, rows] tensor. ``FP8_P``: the weights enter P @ V as e4m3 times
    `P_FP8_SCALE` (``acc_t`` comes back that much too large)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seq_len
    d_ok = offs_d < HEAD_SIZE
    slots = page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_cs
    k = _load_kv_tile(
        k_head_ptr + slots[:, None] + offs_d[None, :], n_ok, d_ok, True, BLOCK_D != HEAD_SIZE
    )
    s_t = tl.dot(k.to(q_t.dtype), q_t, input_precision=DOT_PRECISION) * qk_scale
    visible = (offs_n[:, None] <= q_pos[None, :]) & n_ok[:, None]
    if USE_WINDOW:
        visible = visible & (offs_n[:, None] > q_pos[None, :] - window)
    s_t = tl.where(visible, s_t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_t, 0))
    alpha = tl.exp2(m_i - m_new)
    p_t = tl.exp2(s_t - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p_t, 0)
    if V_TOKEN_MINOR:  # unmasked along the keys, as `attend_paged_tile` loads it
        offs_v = offs_d[:, None] * PAGE + (page.to(tl.int64) * stride_cb + offs_n % PAGE)[None, :]
        offs_v = tl.max_contiguous(tl.multiple_of(offs_v, [1, 16]), [1, 16])
        if BLOCK_D != HEAD_SIZE:
            v_t = tl.load(v_head_ptr + offs_v, mask=d_ok[:, None], other=0.0)
        else:
            v_t = tl.load(v_head_ptr + offs_v)
    else:  # V beyond the sequence end may be uninitialised (NaN): loaded as zeros
        offs_v = slots[None, :] + offs_d[:, None]
        v_t = tl.load(v_head_ptr + offs_v, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    acc_t = acc_t * alpha[None, :]
    if FP8_P:
        # Into a fresh sum, added to acc_t in float32: on sm_90 Triton would otherwise let FP8
        # MMAs accumulate in the tensor cores' reduced precision through the whole context.
        acc_t = tl.dot(v_t, (p_t * P_FP8_SCALE).to(q_t.dtype), acc_t, max_num_imprecise_acc=BLOCK_N)
    else:
        p16 = p_t.to(q_t.dtype)
        acc_t = tl.dot(v_t.to(q_t.dtype), p16, acc_t, input_precision=DOT_PRECISION)
    return acc_t, m_new, l_i
