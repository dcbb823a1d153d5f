"""A step's inputs laid out without a model (`plan_step`, `prepare_inputs`): which rows run and
sample, each token's position and cache slot, and the padding of a graph replay."""

from __future__ import annotations

import torch

from pagellm.sampling_params import SamplingParams
from pagellm.scheduler.output import CachedRequestData, SchedulerOutput
from pagellm.worker.input_batch import CachedRequestState, InputBatch
from pagellm.worker.step_buffers import StepBuffers
from pagellm.worker.step_inputs import plan_step, prepare_inputs

BLOCK = 4


def make_batch(*requests: tuple[str, list[int], list[int], list[int], int]) -> InputBatch:
    """(req_id, prompt, output, block ids, computed tokens) per request."""
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=8)
    for req_id, prompt, output, blocks, computed in requests:
        state = CachedRequestState(req_id, prompt, SamplingParams(), None, None, output)
        batch.add_request(state, blocks, computed)
    return batch


def scheduled(tokens: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData(), tokens, sum(tokens.values()), set(), set())


def buffers() -> StepBuffers:
    return StepBuffers(64, 4, 8, torch.device("cpu"), pin_memory=False)


def test_prefill_and_decode_rows_get_their_positions_slots_and_spans():
    batch = make_batch(
        ("prefill", [10, 11, 12, 13, 14], [], [3, 7], 0),
        ("decode", [20, 21, 22], [23, 24], [2, 9], 4),
    )
    plan = plan_step(batch, scheduled({"decode": 1, "prefill": 5}))
    assert plan.rows.tolist() == [0, 1] and plan.req_ids == ["prefill", "decode"]
    assert plan.query_lens.tolist() == [5, 1] and plan.query_end.tolist() == [5, 6]
    assert plan.query_start.tolist() == [0, 5]
    assert plan.seq_lens.tolist() == [5, 5] and plan.sample_pos.tolist() == [0, 1]
    buf = buffers()
    common = prepare_inputs(batch, buf, plan, BLOCK, num_padded=6)
    assert buf.host.positions[:6].tolist() == [0, 1, 2, 3, 4, 4]
    assert buf.host.input_ids[:6].tolist() == [10, 11, 12, 13, 14, 24]
    # Slot = block id * block size + offset: positions 0-3 in block 3, 4 in block 7; the decode
    # row's position 4 in its second block, 9.
    assert common.slot_mapping.tolist() == [12, 13, 14, 15, 28, 36]
    assert common.query_start_loc.tolist() == [0, 5, 6]
    assert common.seq_lens.tolist() == [5, 5]
    assert common.block_table.tolist() == [[3, 7], [2, 9]]  # the columns the contexts need
    assert (common.num_reqs, common.num_actual_tokens) == (2, 6)
    assert (common.max_query_len, common.max_seq_len) == (5, 5)


def test_a_prefill_chunk_does_not_sample_and_rows_keep_batch_order():
    batch = make_batch(
        ("idle", [1, 2], [3], [1], 3),
        ("chunked", list(range(100, 110)), [], [4, 5, 6], 4),
        ("last", [7, 8], [9], [8], 2),
    )
    plan = plan_step(batch, scheduled({"last": 1, "chunked": 4}))
    assert plan.rows.tolist() == [1, 2] and plan.req_ids == ["chunked", "last"]
    assert plan.sample_pos.tolist() == [1] and plan.sample_rows.tolist() == [2]
    buf = buffers()
    common = prepare_inputs(batch, buf, plan, BLOCK, num_padded=5)
    assert buf.host.positions[:5].tolist() == [4, 5, 6, 7, 2]
    assert buf.host.input_ids[:5].tolist() == [104, 105, 106, 107, 9]
    assert common.slot_mapping.tolist() == [20, 21, 22, 23, 34]
    assert common.block_table.tolist() == [[4, 5], [8, 0]]


def test_a_decode_step_padded_for_a_graph_replay_gets_rows_that_read_nothing():
    batch = make_batch(("a", [1, 2], [3], [1], 2), ("b", [4], [5, 6], [2], 2))
    plan = plan_step(batch, scheduled({"a": 1, "b": 1}))
    buf = buffers()
    common = prepare_inputs(batch, buf, plan, BLOCK, num_padded=4)
    assert common.slot_mapping.tolist() == [6, 10, -1, -1]
    assert common.query_start_loc.tolist() == [0, 1, 2, 3, 4]  # padding rows: one token each
    assert common.seq_lens.tolist() == [3, 3, 0, 0]
    assert buf.host.input_ids[:4].tolist() == [3, 6, 0, 0]
    assert (common.num_reqs, common.num_actual_tokens, common.max_seq_len) == (4, 4, 3)
