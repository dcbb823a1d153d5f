"""`paged_decode`: attention for the rows of one query token, optionally split-KV.

Each sequence's key tiles can be split over several programs whose partial outputs and
log-sum-exps a merge kernel combines. Every split computes its own range from ``seq_lens`` on the
device, so the grid depends only on the batch's shape and the launch can be captured in a CUDA
graph.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .launch import (
    FP8_E4M3_MAX,
    Tiles,
    check_inner_contiguous,
    decode_tiles,
    dot_precision,
    fp8_as_f16,
    gpu_target,
    is_fp8_cache,
    values_token_minor,
)
from .online_softmax import (
    LOG2E,
    NO_MAX,
    P_FP8_SCALE,
    attend_paged_tile,
    attend_paged_tile_swapped,
    tile_pages,
)

# Split-KV never cuts a sequence into more pieces than this (bounds the scratch and the merge).
_MAX_SPLITS = 64


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
    order_ptr,
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
    GQA: tl.constexpr,
    GQA_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_AS_F16: tl.constexpr,
    V_TOKEN_MINOR: tl.constexpr,
    SWAP_AB: tl.constexpr,
    FP8_MMA: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_ORDER: tl.constexpr,
):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Programs are dispatched in grid order: with an order (longest rows first), the long rows
    # start early and the last wave holds short ones, so no long row runs alone at the end.
    row = tl.load(order_ptr + tl.program_id(2)) if HAS_ORDER else tl.program_id(2)
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
    row_qk_scale = qk_scale
    if FP8_MMA:
        # Each row's query as e4m3 at its own scale (absmax to 448), which joins the softmax's:
        # both products then run as FP8 MMAs on the tiles as loaded.
        q_abs = tl.max(tl.abs(q.to(tl.float32)), 1)
        q_scale = tl.where(q_abs > 0.0, q_abs / FP8_E4M3_MAX, 1.0)
        q = (q.to(tl.float32) / q_scale[:, None]).to(k_cache_ptr.dtype.element_ty)
        row_qk_scale = (q_scale * qk_scale)[None, :]
    elif FP8_AS_F16:
        q = q.to(tl.float16)  # the tiles then convert in one instruction per pair, and exactly

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
    m_i = tl.full([GQA_P], NO_MAX, dtype=tl.float32)
    l_i = tl.zeros([GQA_P], dtype=tl.float32)
    # Decode is bandwidth-bound: masking every tile costs a few integer ops per key and keeps
    # one loop body (one software pipeline) per program.
    # The next tile's pages are loaded one iteration ahead: the K/V loads then depend on no load
    # of their own iteration, and the pipeliner can keep more than one tile in flight.
    page = tile_pages(bt_row_ptr, tile_lo * BLOCK_N, seq_len, PAGE, BLOCK_N)
    if SWAP_AB:
        q_t = tl.trans(q)
        acc_t = tl.zeros([BLOCK_D, GQA_P], dtype=tl.float32)
        for t in range(tile_lo, tile_hi):
            next_page = tile_pages(bt_row_ptr, (t + 1) * BLOCK_N, seq_len, PAGE, BLOCK_N)
            acc_t, m_i, l_i = attend_paged_tile_swapped(
                acc_t, m_i, l_i, q_t, q_pos, k_head_ptr, v_head_ptr, page, t * BLOCK_N,
                seq_len, window, row_qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D,
                HEAD_SIZE, USE_WINDOW, DOT_PRECISION, V_TOKEN_MINOR, FP8_MMA,
            )  # fmt: skip
            page = next_page
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([GQA_P, BLOCK_D], dtype=tl.float32)
        for t in range(tile_lo, tile_hi):
            next_page = tile_pages(bt_row_ptr, (t + 1) * BLOCK_N, seq_len, PAGE, BLOCK_N)
            acc, m_i, l_i = attend_paged_tile(
                acc, m_i, l_i, q, q_pos, k_head_ptr, v_head_ptr, page, t * BLOCK_N, seq_len,
                window, qk_scale, stride_cb, stride_cs, PAGE, BLOCK_N, BLOCK_D,
                HEAD_SIZE, True, USE_WINDOW, DOT_PRECISION, V_TOKEN_MINOR,
            )  # fmt: skip
            page = next_page

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8_MMA:
        out = out * (v_scale / P_FP8_SCALE)  # P @ V also took the weights times P_FP8_SCALE
    elif KV_FP8:
        out = out * v_scale  # the FP8 cache's values were stored divided by it
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tiles: Tiles | None = None,
    target: GPUTarget | None = None,
    row_order: torch.Tensor | None = None,
) -> None:
    """Attention for the rows of exactly one query token (token ``query_start_loc[row]``);
    other rows are skipped, so this can share a mixed batch with `paged_attention`.

    With ``num_splits`` > 1 each row's key tiles are shared among that many programs, which write
    into ``scratch`` (from `split_scratch`), then merged. Rows with ``seq_len`` 0 produce zeros
    and read no cache. The launch reads no host-side per-step value besides its shapes. Float8
    caches hold K/V divided by ``k_scale``/``v_scale``. ``tiles``: other tiles than
    `decode_tiles`' (for tile sweeps, `benchmarks/triton_decode_tiles.py`). ``target``: the GPU
    to choose tiles for, when not the tensors' own (`gpu_target`; cross-compiling passes it).
    ``row_order``: int32 [num_rows], a permutation of the rows, the order in which programs take
    them (`rows_longest_first`); the results do not depend on it."""
    if num_rows == 0:
        return
    if target is None:
        target = gpu_target(query.device)
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    check_inner_contiguous(query, out, key_cache)
    v_token_minor = values_token_minor(key_cache, value_cache)
    gqa = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_size)
    tiles = tiles or decode_tiles(query.dtype, head_size, key_cache.dtype, target)
    if tiles.fp8_mma and not (tiles.swap_ab and is_fp8_cache(key_cache)):
        raise ValueError(
            f"Tiles.fp8_mma needs swap_ab and an FP8 KV cache (got swap_ab={tiles.swap_ab}, "
            f"a {key_cache.dtype} cache)."
        )
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
        seq_lens if row_order is None else row_order,  # unread without HAS_ORDER
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
        GQA=gqa,
        # tl.dot needs at least 16 rows; the spare rows are masked.
        GQA_P=max(16, triton.next_power_of_2(gqa)),
        BLOCK_N=tiles.block_n,
        BLOCK_D=block_d,
        HEAD_SIZE=head_size,
        PAGE=key_cache.shape[2],
        USE_WINDOW=sliding_window is not None,
        KV_FP8=is_fp8_cache(key_cache),
        FP8_AS_F16=fp8_as_f16(query, key_cache),
        V_TOKEN_MINOR=v_token_minor,
        SWAP_AB=tiles.swap_ab,
        FP8_MMA=tiles.fp8_mma,
        SPLIT=split,
        DOT_PRECISION=dot_precision(query.dtype, target),
        HAS_ORDER=row_order is not None,
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


def rows_longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """The rows by decreasing length (ties in row order), as int32: a `paged_decode` order."""
    return np.argsort(-seq_lens.astype(np.int64), kind="stable").astype(np.int32)


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
