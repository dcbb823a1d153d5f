"""One step laid out: which batch rows run, their spans in the step's flattened tokens, and the
device inputs the forward pass reads (token ids, positions, slot mapping, block table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.manager import cdiv
from pagellm.scheduler.output import SchedulerOutput
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.step_buffers import StepBuffers


@dataclass
class StepPlan:
    rows: np.ndarray
    """Batch rows scheduled this step, ascending (the step's request order)."""
    req_ids: list[str]
    query_lens: np.ndarray
    """Tokens each row computes this step."""
    query_end: np.ndarray
    """Where each row's tokens end in the step's flattened tokens (cumulative ``query_lens``)."""
    seq_lens: np.ndarray
    """Each row's context length once this step is done (cached + new tokens)."""
    num_tokens: int
    sample_pos: np.ndarray
    """Indices into ``rows`` of the rows that sample: their tokens reach the row's last one (the
    others are prefill chunks)."""

    @property
    def query_start(self) -> np.ndarray:
        return self.query_end - self.query_lens

    @property
    def sample_rows(self) -> np.ndarray:
        return self.rows[self.sample_pos]


def plan_step(batch: InputBatch, out: SchedulerOutput) -> StepPlan:
    scheduled = out.num_scheduled_tokens
    num_reqs = len(scheduled)
    if num_reqs == batch.num_reqs:
        rows = np.arange(num_reqs)  # everyone runs: rows are already contiguous and ordered
    else:
        rows = np.array(sorted(batch.req_id_to_index[r] for r in scheduled), dtype=np.int64)
    req_ids = cast(list[str], [batch.req_ids[i] for i in rows])
    query_lens = np.fromiter((scheduled[r] for r in req_ids), dtype=np.int64, count=num_reqs)
    seq_lens = batch.num_computed_tokens[rows] + query_lens
    return StepPlan(
        rows=rows,
        req_ids=req_ids,
        query_lens=query_lens,
        query_end=np.cumsum(query_lens),
        seq_lens=seq_lens,
        num_tokens=out.total_num_scheduled_tokens,
        sample_pos=np.flatnonzero(seq_lens >= batch.num_tokens[rows]),
    )


def prepare_inputs(
    batch: InputBatch, buffers: StepBuffers, plan: StepPlan, block_size: int, num_padded: int
) -> CommonAttentionMetadata:
    """Lay the step's inputs out in the host staging buffers, copy them to the device buffers
    (non-blocking from pinned memory) and describe them. ``num_padded`` exceeds the token count
    only for a graph replay (`StepBuffers.stage_padding`)."""
    rows, total = plan.rows, plan.num_tokens
    num_reqs = len(rows)
    buffers.wait_until_staging_is_free()
    h = buffers.host
    if total == num_reqs:  # decode-only: one token per row, no repeats needed
        positions = batch.num_computed_tokens[rows]
        row_of_token = rows
    else:
        row_of_token = np.repeat(rows, plan.query_lens)
        offset_in_query = np.arange(total) - np.repeat(plan.query_start, plan.query_lens)
        positions = batch.num_computed_tokens[row_of_token] + offset_in_query
    h.positions[:total] = positions
    h.input_ids[:total] = batch.token_ids[row_of_token, positions]
    h.slot_mapping[:total] = batch.block_table[
        row_of_token, positions // block_size
    ] * block_size + (positions % block_size)
    h.query_start_loc[1 : num_reqs + 1] = plan.query_end
    h.seq_lens[:num_reqs] = plan.seq_lens
    num_rows = num_reqs
    if num_padded > total:
        buffers.stage_padding(total, num_reqs, num_padded)
        num_rows = num_padded
    max_seq_len = int(plan.seq_lens.max())
    max_blocks = cdiv(max_seq_len, block_size)
    if num_reqs == batch.num_reqs:  # rows 0..n-1 (see `plan_step`): a plain slice
        h.block_table[:num_reqs, :max_blocks] = batch.block_table[:num_reqs, :max_blocks]
    else:
        h.block_table[:num_reqs, :max_blocks] = batch.block_table[rows, :max_blocks]
    return buffers.attention_metadata(
        num_rows, num_padded, int(plan.query_lens.max()), max_seq_len, max_blocks
    )
