"""`paged_attention`: any batch (prompts, chunks after cached context, decodes) in one launch.

A program owns ``BLOCK_Q`` query tokens of one request times the query heads of one KV head
(``BLOCK_M = BLOCK_Q x GQA`` rows), so each K/V tile is read once per KV head and tile. Fully
visible key tiles run without masks; only the window edge and the causal diagonal are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .launch import (
    check_inner_contiguous,
    dot_precision,
    fp8_as_f16,
    gpu_target,
    is_fp8_cache,
    mixed_tiles,
    values_token_minor,
)
from .online_softmax import LOG2E, NO_MAX, attend_paged_tile, attend_tile, tile_pages


# Per-step integers are not specialised on (== 1, multiple of 16): one compiled kernel serves
# every batch.
@triton.jit(do_not_specialize=["num_reqs", "num_virtual_tiles"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_reqs,
    num_virtual_tiles,
    window,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GQA: tl.constexpr,
    GQA_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    V_TOKEN_MINOR: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Programs run roughly in id order: with the KV head varying fastest, the costliest tiles
    # start first on every head. Request r owns virtual tiles [qsl[r] // BLOCK_Q + r,
    # qsl[r+1] // BLOCK_Q + r + 1), at least cdiv(query_len, BLOCK_Q) of them; the surplus
    # programs exit at once. Walking the tiles backwards starts the last (longest) tiles of the
    # last (usually newest, longest) prefill first, which shortens the tail of the launch.
    pid = tl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    tile = num_virtual_tiles - 1 - pid // NUM_KV_HEADS
    lo = tile * 0
    hi = lo + num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    req = lo
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    q0 = (tile - q_start // BLOCK_Q - req) * BLOCK_Q
    if q0 >= q_len:
        return
    if SKIP_DECODES and q_len == 1:
        return  # `paged_decode` serves this row

    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    # Row m is query token q0 + m // GQA_P, head m % GQA_P of this KV head's group.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q0 + offs_m // GQA_P
    group = offs_m % GQA_P
    row_ok = (q_idx < q_len) & (group < GQA) & (offs_m < BLOCK_Q * GQA_P)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    head = kv_head * GQA + group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP8_AS_F16:
        q = q.to(tl.float16)  # the tiles then convert in one instruction per pair, and exactly

    # Keys from the last query's window start to the first query's position are visible to
    # every query of the tile: whole key tiles in [full_lo, full_hi) run without masks, the
    # edges (window start, causal diagonal) with them.
    p_min = context_len + q0
    p_max = context_len + tl.minimum(q0 + BLOCK_Q, q_len) - 1
    if USE_WINDOW:
        first = (tl.maximum(p_min - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(p_max - window + 1, 0), BLOCK_N) * BLOCK_N
    else:
        first = 0
        full_lo = 0
    full_hi = ((p_min + 1) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(full_lo, full_hi)
    end = p_max + 1

    bt_row_ptr = block_table_ptr + req * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_ch
    v_head_ptr = v_cache_ptr + kv_head * stride_ch
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NO_MAX, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(first, full_lo, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_row_ptr, n0, seq_len, window,
            qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D, HEAD_SIZE,
            True, USE_WINDOW, DOT_PRECISION, V_TOKEN_MINOR,
        )  # fmt: skip
    # Pages one tile ahead, as in `paged_decode`: more than one K/V tile in flight.
    page = tile_pages(bt_row_ptr, full_lo, seq_len, PAGE, BLOCK_N)
    for n0 in range(full_lo, full_hi, BLOCK_N):
        next_page = tile_pages(bt_row_ptr, n0 + BLOCK_N, seq_len, PAGE, BLOCK_N)
        acc, m_i, l_i = attend_paged_tile(
            acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, page, n0, seq_len, window,
            qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D, HEAD_SIZE,
            False, USE_WINDOW, DOT_PRECISION, V_TOKEN_MINOR,
        )  # fmt: skip
        page = next_page
    for n0 in range(full_hi, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_row_ptr, n0, seq_len, window,
            qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D, HEAD_SIZE,
            True, USE_WINDOW, DOT_PRECISION, V_TOKEN_MINOR,
        )  # fmt: skip

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        acc = acc * v_scale  # the FP8 cache's values were stored divided by it
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_reqs: int,
    num_tokens: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None,
    skip_decodes: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    target: GPUTarget | None = None,
) -> None:
    """Causal attention of every query token of a mixed batch over its request's paged context.

    ``query``/``out`` ``[T, num_heads, head_size]``; caches ``[num_blocks, num_kv_heads,
    block_size, head_size]``; request i's tokens are ``query_start_loc[i]:query_start_loc[i+1]``
    and its context (cached and new tokens, already in the cache) is ``seq_lens[i]`` long.
    ``skip_decodes`` leaves rows of one query token to `paged_decode`. Float8 caches hold K/V
    divided by ``k_scale``/``v_scale``. ``target``: the GPU to choose tiles for, when not the
    tensors' own (`gpu_target`; cross-compiling passes it)."""
    if num_reqs == 0 or num_tokens == 0:
        return
    if target is None:
        target = gpu_target(query.device)
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    check_inner_contiguous(query, out, key_cache)
    v_token_minor = values_token_minor(key_cache, value_cache)
    gqa = num_heads // num_kv_heads
    tiles = mixed_tiles(query.dtype, head_size, gqa, max_query_len, target)
    num_virtual_tiles = num_tokens // tiles.block_q + num_reqs
    _paged_attention_kernel[(num_kv_heads * num_virtual_tiles,)](
        query,
        key_cache,
        value_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        num_reqs,
        num_virtual_tiles,
        sliding_window or 0,
        scale * k_scale * LOG2E,  # the FP8 cache's keys were stored divided by k_scale
        v_scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GQA=gqa,
        GQA_P=triton.next_power_of_2(gqa),
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=triton.next_power_of_2(head_size),
        HEAD_SIZE=head_size,
        PAGE=key_cache.shape[2],
        USE_WINDOW=sliding_window is not None,
        KV_FP8=is_fp8_cache(key_cache),
        FP8_AS_F16=fp8_as_f16(query, key_cache),
        V_TOKEN_MINOR=v_token_minor,
        SKIP_DECODES=skip_decodes,
        DOT_PRECISION=dot_precision(query.dtype, target),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
