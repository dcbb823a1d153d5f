"""Paged-attention steps in FLASH_ATTN's KV layout for its tests (CPU and GPU), and a torch
reference.

A step's cache holds the context before the step; the new tokens' slots, and every page no row
uses, hold NaN (a kernel that reads them, or a write that misses, shows up as NaN); the slots
past a row's end in its last page hold a large finite value (FA4 may load them, masked; a kernel
that attends to them gives a wrong result).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention.backend import CommonAttentionMetadata

TAIL_VALUE = 100.0


@dataclass
class Step:
    query: torch.Tensor  # [T, H, D], a column slice of a fused QKV projection
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    keys: torch.Tensor  # every row's whole sequence, concatenated: [sum(seq_lens), Hkv, D]
    values: torch.Tensor
    rows: list[tuple[int, int]]  # (context, new tokens); padding rows (0, 1) have seq_len 0
    num_padding: int

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[2]

    def kv_bytes(self) -> int:
        """Bytes of K and V one attention pass over the step reads (each once)."""
        return 2 * self.keys.numel() * self.keys.element_size()

    def common(self, max_seq_len: int | None = None) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=self.num_reqs,
            num_actual_tokens=self.num_tokens,
            max_query_len=max(new for _, new in self.rows),
            max_seq_len=max_seq_len or max(int(self.seq_lens.max()), 1),
            query_start_loc=self.query_start_loc,
            query_start_loc_cpu=self.query_start_loc.cpu(),
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens.cpu(),
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
        )

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query, key, value as the model passes them: ``[T, heads * head_size]``."""
        n = self.num_tokens
        return self.query.reshape(n, -1), self.key.reshape(n, -1), self.value.reshape(n, -1)


def make_step(
    rows: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int = 16,
    padding_rows: int = 0,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Step:
    """``rows`` are (cached context, new tokens); ``padding_rows`` one-token rows follow with
    seq_len 0 and slot -1, as in a padded CUDA-graph batch."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    contexts = torch.tensor([c for c, _ in rows] + [0] * padding_rows, device=dev)
    new = torch.tensor([n for _, n in rows] + [1] * padding_rows, device=dev)
    seq_lens = contexts + new
    seq_lens[len(rows) :] = 0
    num_rows = len(rows) + padding_rows
    blocks = (seq_lens + block_size - 1) // block_size
    total_blocks = int(blocks.sum())
    num_blocks = total_blocks + 9  # the null block 0 and a few never used
    shuffled = torch.randperm(num_blocks - 1, device=dev, generator=gen) + 1
    block_table = torch.zeros(num_rows, max(int(blocks.max()), 1), dtype=torch.int32, device=dev)
    row_of_block = torch.repeat_interleave(torch.arange(num_rows, device=dev), blocks)
    col = torch.arange(total_blocks, device=dev) - torch.repeat_interleave(
        torch.cumsum(blocks, 0) - blocks, blocks
    )
    used = shuffled[:total_blocks].int()
    block_table[row_of_block, col] = used

    total = int(seq_lens.sum())

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen).to(dtype)

    keys, values = randn(total, num_kv_heads, head_size), randn(total, num_kv_heads, head_size)
    row_of_pos = torch.repeat_interleave(torch.arange(num_rows, device=dev), seq_lens)
    pos = torch.arange(total, device=dev) - torch.repeat_interleave(
        torch.cumsum(seq_lens, 0) - seq_lens, seq_lens
    )
    slots = block_table[row_of_pos, pos // block_size].long() * block_size + pos % block_size
    cached = pos < contexts[row_of_pos]
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    kv_cache[:, used.long()] = TAIL_VALUE
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    flat[0, slots[cached]] = keys[cached]
    flat[1, slots[cached]] = values[cached]
    flat[:, slots[~cached]] = float("nan")

    pad = padding_rows
    num_tokens = int(new.sum())
    fused = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size)
    query = fused[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    qsl = torch.zeros(num_rows + 1, dtype=torch.int32, device=dev)
    qsl[1:] = torch.cumsum(new, 0)
    return Step(
        query=query,
        key=torch.cat([keys[~cached], randn(pad, num_kv_heads, head_size)]),
        value=torch.cat([values[~cached], randn(pad, num_kv_heads, head_size)]),
        kv_cache=kv_cache,
        query_start_loc=qsl,
        seq_lens=seq_lens.int(),
        block_table=block_table,
        slot_mapping=torch.cat([slots[~cached], torch.full((pad,), -1, device=dev)]),
        keys=keys,
        values=values,
        rows=list(rows) + [(0, 1)] * padding_rows,
        num_padding=padding_rows,
    )


def reference(step: Step, scale: float, window: int | None) -> torch.Tensor:
    """Causal attention of each row's new queries over its whole sequence, in float32 on a GPU
    and float64 on the CPU, the query heads grouped by KV head; padding rows give zeros."""
    compute = torch.float32 if step.query.is_cuda else torch.float64
    num_heads, head_size = step.query.shape[1:]
    num_kv_heads = step.keys.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(step.query.shape, dtype=compute, device=step.query.device)
    num_real = step.num_reqs - step.num_padding
    q_start = k_start = 0
    for row, (ctx, new) in enumerate(step.rows):
        seq_len = ctx + new if row < num_real else 0
        k = step.keys[k_start : k_start + seq_len].to(compute)
        v = step.values[k_start : k_start + seq_len].to(compute)
        for c0 in range(0, new if seq_len else 0, 1024):  # chunks: long prompts fit in memory
            c1 = min(new, c0 + 1024)
            q = step.query[q_start + c0 : q_start + c1].to(compute)
            q = q.view(c1 - c0, num_kv_heads, group, head_size)
            scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale
            q_pos = torch.arange(ctx + c0, ctx + c1, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            o = torch.einsum("hgqk,khd->qhgd", probs, v)
            out[q_start + c0 : q_start + c1] = o.reshape(c1 - c0, num_heads, head_size)
        q_start += new
        k_start += seq_len
    return out


def assert_new_kv_written(step: Step) -> None:
    """The new tokens' K/V are at their slots, bit for bit."""
    live = step.slot_mapping >= 0
    slots = step.slot_mapping[live]
    flat = step.kv_cache.view(2, -1, *step.kv_cache.shape[3:])
    assert torch.equal(flat[0, slots], step.key[live])
    assert torch.equal(flat[1, slots], step.value[live])
