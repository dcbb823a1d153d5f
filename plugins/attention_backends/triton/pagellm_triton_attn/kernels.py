"""Triton kernels for paged attention, and the host functions that launch them.

The KV cache of one layer is ``[2, num_blocks, num_kv_heads, block_size, head_size]``: one block
of one KV head is a contiguous ``block_size x head_size`` tile, so a key tile of ``BLOCK_N``
tokens is ``BLOCK_N / block_size`` contiguous runs that load as wide vectors.

A step runs `write_kv_cache`, then one or both attention kernels:

- `write_kv_cache`: scatter the new tokens' K/V into the cache at their slots (slots < 0 are
  CUDA-graph padding and are skipped).
- `paged_attention`: any batch (prompts, chunks after cached context, decodes) in one launch. A
  program owns ``BLOCK_Q`` query tokens of one request times the query heads of one KV head
  (``BLOCK_M = BLOCK_Q x GQA`` rows), so each K/V tile is read once per KV head and tile. It
  can leave one-token rows to:
- `paged_decode`: the rows of one query token, optionally splitting each sequence's tiles over
  several programs (split-KV) whose partial outputs and log-sum-exps a merge kernel combines.
  Every split computes its own range from ``seq_lens`` on the device, so the grid depends only on
  the batch's shape and the launch can be captured in a CUDA graph.

Softmax runs online in float32 and in base 2: scores are multiplied by ``scale * log2(e)`` once,
so ``exp2`` replaces ``exp`` and log-sum-exps are base-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton import knobs

from pagellm_triton_attn import interpreter_compat

if knobs.runtime.interpret:
    interpreter_compat.install()

_LOG2E = 1.4426950408889634
# A finite "minus infinity" for the running max: a row that has seen no key keeps it, and then
# exp2(m_old - m_new) is 1 rather than NaN.
_NO_MAX: tl.constexpr = tl.constexpr(-1.0e30)
# Split-KV never cuts a sequence into more pieces than this (bounds the scratch and the merge).
_MAX_SPLITS = 64


# ------------------------------------------------------------------ writing new K/V into the cache


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cs,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (slot >= 0) & (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)
    # Padding slots are -1: clamp so the (masked-off) address arithmetic stays in range.
    safe_slot = tl.maximum(slot, 0)
    dst = (
        (safe_slot // PAGE) * stride_cb
        + (safe_slot % PAGE) * stride_cs
        + offs_h[:, None] * stride_ch
        + offs_d[None, :]
    )
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    tl.store(k_cache_ptr + dst, k, mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    tl.store(v_cache_ptr + dst, v, mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, num_kv_heads, head_size]`` (last dim contiguous) at
    ``slot_mapping[:T]`` in caches shaped ``[num_blocks, num_kv_heads, block_size, head_size]``."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _check_inner_contiguous(key, value, key_cache, value_cache)
    heads_p = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_size)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P=heads_p,
        HEAD_SIZE=head_size,
        BLOCK_D=block_d,
        PAGE=key_cache.shape[2],
        # One 16-byte vector per thread for a 8 x 128 bf16 tile at 4 warps.
        num_warps=max(1, min(8, heads_p * block_d // 256)),
    )


# ------------------------------------------------------------------ shared attention tile


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
def _attend_tile(
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
):
    """Fold keys [n0, n0 + BLOCK_N) of one sequence and KV head into the running softmax.

    ``MASKED`` tiles apply the causal, window and sequence-end masks; the caller proves that
    the other tiles are entirely visible to every row that matters."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seq_len
    d_ok = offs_d < HEAD_SIZE
    if MASKED:
        page = tl.load(bt_row_ptr + offs_n // PAGE, mask=n_ok, other=0)
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE)
    offs = (page.to(tl.int64) * stride_cb + (offs_n % PAGE) * stride_cs)[:, None] + offs_d[None, :]
    k = _load_kv_tile(k_head_ptr + offs, n_ok, d_ok, MASKED, BLOCK_D != HEAD_SIZE)
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
    v = _load_kv_tile(v_head_ptr + offs, n_ok, d_ok, MASKED, BLOCK_D != HEAD_SIZE)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# ------------------------------------------------------------------ mixed batches


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
    m_i = tl.full([BLOCK_M], _NO_MAX, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(first, full_lo, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_row_ptr, n0, seq_len, window,
            qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D, HEAD_SIZE,
            True, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_row_ptr, n0, seq_len, window,
            qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D, HEAD_SIZE,
            False, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_hi, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_row_ptr, n0, seq_len, window,
            qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D, HEAD_SIZE,
            True, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# ------------------------------------------------------------------ decode (split-KV)


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    window,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_bt,
    GQA: tl.constexpr,
    GQA_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.program_id(2)
    num_splits = tl.num_programs(0)
    q_start = tl.load(qsl_ptr + row)
    if tl.load(qsl_ptr + row + 1) - q_start != 1:
        return  # a prompt or chunk of a mixed batch: `paged_attention` serves it
    seq_len = tl.load(seq_lens_ptr + row)
    token = q_start.to(tl.int64)

    offs_m = tl.arange(0, GQA_P)
    head = kv_head * GQA + offs_m
    m_ok = offs_m < GQA
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    q = tl.load(
        q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # This split's share of the sequence's key tiles, balanced to within one tile. A padding
    # row (seq_len 0) has no tiles: it reads nothing and writes zeros.
    first_tile = tl.maximum(seq_len - window, 0) // BLOCK_N if USE_WINDOW else 0
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tile_lo = first_tile + (split * num_tiles) // num_splits
    tile_hi = first_tile + ((split + 1) * num_tiles) // num_splits

    q_pos = tl.zeros([GQA_P], dtype=tl.int32) + (seq_len - 1)
    bt_row_ptr = block_table_ptr + row * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_ch
    v_head_ptr = v_cache_ptr + kv_head * stride_ch
    acc = tl.zeros([GQA_P, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([GQA_P], _NO_MAX, dtype=tl.float32)
    l_i = tl.zeros([GQA_P], dtype=tl.float32)
    # Decode is bandwidth-bound: masking every tile costs a few integer ops per key and keeps
    # one loop body (one software pipeline) per program.
    for t in range(tile_lo, tile_hi):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, bt_row_ptr, t * BLOCK_N, seq_len,
            window, qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D, HEAD_SIZE,
            True, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    store_mask = m_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # part_out [rows, num_heads, num_splits, BLOCK_D], part_lse [rows, num_heads, num_splits]
        part = (row * (tl.num_programs(1) * GQA) + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=store_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=m_ok)
    else:
        tl.store(
            out_ptr + token * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
):
    head = tl.program_id(0)
    row = tl.program_id(1)
    num_heads = tl.num_programs(0)
    q_start = tl.load(qsl_ptr + row)
    if tl.load(qsl_ptr + row + 1) - q_start != 1:
        return  # not a decode row: the split kernel left it alone, and so must this one
    token = q_start.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    base = (row * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    # Empty splits have lse -inf (weight 0); a row with no keys at all (padding) gets zeros.
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


# ------------------------------------------------------------------ host side


def _check_inner_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(
                f"expected the last dimension to be contiguous, got strides {t.stride()}"
            )


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 models expect float32 attention, not TF32's 10-bit mantissa.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class Tiles:
    """Launch shape of an attention kernel. Untuned defaults for Hopper (H100/H200), checked
    by compiling for sm_90: no register spills, shared memory well under the 227 KiB limit."""

    block_n: int
    """Keys per tile."""
    num_warps: int
    num_stages: int
    block_q: int = 1
    """Query tokens per program (`paged_attention`)."""
    block_m: int = 16
    """Rows per program: query tokens x the query heads of one KV head, at least 16 (tl.dot)."""


# IEEE float32 dots run on CUDA cores, whose layouts spill registers with most tile shapes; this
# one spills at most 16 bytes for any head size (float32 serving is for checking, not speed).
_FP32_TILES = Tiles(block_n=32, num_warps=8, num_stages=2)


def mixed_tiles(dtype: torch.dtype, head_size: int, gqa: int, max_query_len: int) -> Tiles:
    """`paged_attention`'s tiles: about 64 rows (128 for long prompts: fewer K/V re-reads)."""
    gqa_p = triton.next_power_of_2(gqa)
    if dtype == torch.float32:
        target_m, tiles = 16, _FP32_TILES
    elif head_size > 128:
        target_m, tiles = 64, Tiles(block_n=32, num_warps=8, num_stages=2)
    elif max_query_len >= 512:
        target_m, tiles = 128, Tiles(block_n=64, num_warps=8, num_stages=3)
    else:
        target_m, tiles = 64, Tiles(block_n=64, num_warps=4, num_stages=3)
    block_q = max(1, min(target_m // gqa_p, triton.next_power_of_2(max_query_len)))
    return replace(tiles, block_q=block_q, block_m=max(16, block_q * gqa_p))


def decode_tiles(dtype: torch.dtype, head_size: int) -> Tiles:
    """`paged_decode`'s tiles: a 64 x 128 half-precision K tile is 16 KiB; with V and three
    stages a program takes 39 KiB of shared memory and 128 registers a thread, so four programs
    (16 warps) share an SM and keep enough loads in flight to saturate HBM."""
    if dtype == torch.float32:
        return _FP32_TILES
    if head_size > 128:
        return Tiles(block_n=32, num_warps=4, num_stages=2)
    return Tiles(block_n=64, num_warps=4, num_stages=3)


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
) -> None:
    """Causal attention of every query token of a mixed batch over its request's paged context.

    ``query``/``out`` ``[T, num_heads, head_size]``; caches ``[num_blocks, num_kv_heads,
    block_size, head_size]``; request i's tokens are ``query_start_loc[i]:query_start_loc[i+1]``
    and its context (cached and new tokens, already in the cache) is ``seq_lens[i]`` long.
    ``skip_decodes`` leaves rows of one query token to `paged_decode`."""
    if num_reqs == 0 or num_tokens == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    _check_inner_contiguous(query, out, key_cache, value_cache)
    gqa = num_heads // num_kv_heads
    tiles = mixed_tiles(query.dtype, head_size, gqa, max_query_len)
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
        scale * _LOG2E,
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
        SKIP_DECODES=skip_decodes,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def split_scratch(
    num_rows: int, num_heads: int, head_size: int, num_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs and log-sum-exps for `paged_decode` with ``num_splits`` > 1."""
    block_d = triton.next_power_of_2(head_size)
    part_out = torch.empty(num_rows, num_heads, num_splits, block_d, device=device)
    part_lse = torch.empty(num_rows, num_heads, num_splits, device=device)
    return part_out, part_lse


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_rows: int,
    scale: float,
    sliding_window: int | None,
    num_splits: int = 1,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attention for the rows of exactly one query token (token ``query_start_loc[row]``);
    other rows are skipped, so this can share a mixed batch with `paged_attention`.

    With ``num_splits`` > 1 each row's key tiles are shared among that many programs, which write
    into ``scratch`` (from `split_scratch`), then merged. Rows with ``seq_len`` 0 produce zeros
    and read no cache. The launch reads no host-side per-step value besides its shapes."""
    if num_rows == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    _check_inner_contiguous(query, out, key_cache, value_cache)
    gqa = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_size)
    tiles = decode_tiles(query.dtype, head_size)
    split = num_splits > 1
    if split:
        if scratch is None:
            raise ValueError("paged_decode with num_splits > 1 needs split_scratch buffers.")
        part_out, part_lse = scratch
        expected = (num_rows, num_heads, num_splits, block_d)
        if tuple(part_out.shape) != expected or tuple(part_lse.shape) != expected[:3]:
            raise ValueError(
                f"split scratch has shapes {tuple(part_out.shape)} / {tuple(part_lse.shape)}, "
                f"expected {expected} / {expected[:3]}."
            )
    else:
        part_out, part_lse = out, out  # unused by the kernel
    _paged_decode_kernel[(num_splits, num_kv_heads, num_rows)](
        query,
        key_cache,
        value_cache,
        out,
        part_out,
        part_lse,
        query_start_loc,
        seq_lens,
        block_table,
        sliding_window or 0,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        GQA=gqa,
        # tl.dot needs at least 16 rows; the spare rows are masked.
        GQA_P=max(16, triton.next_power_of_2(gqa)),
        BLOCK_N=tiles.block_n,
        BLOCK_D=block_d,
        HEAD_SIZE=head_size,
        PAGE=key_cache.shape[2],
        USE_WINDOW=sliding_window is not None,
        SPLIT=split,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if split:
        _merge_splits_kernel[(num_heads, num_rows)](
            out,
            part_out,
            part_lse,
            query_start_loc,
            num_splits,
            out.stride(0),
            out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            HEAD_SIZE=head_size,
            num_warps=2,
        )


def num_decode_splits(
    num_rows: int, num_kv_heads: int, max_seq_len: int, target_programs: int, min_keys: int
) -> int:
    """Splits per row so that ``num_rows * num_kv_heads * splits`` programs reach about
    ``target_programs``, each with at least ``min_keys`` keys of the longest row."""
    programs = num_rows * num_kv_heads
    if programs >= target_programs:
        return 1
    by_length = max(1, max_seq_len // min_keys)
    return max(1, min(math.ceil(target_programs / programs), by_length, _MAX_SPLITS))
