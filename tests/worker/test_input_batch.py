"""The persistent batch (`InputBatch`) on its own: rows filled from request states, kept
contiguous when requests leave, and every per-row value moved with its request."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.sampling_params import SamplingParams
from pagellm.worker.input_batch import CachedRequestState, InputBatch


def state(req_id: str, prompt: list[int], output: list[int] = (), **params) -> CachedRequestState:
    seed = params.get("seed")
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        generator=None if seed is None else torch.Generator().manual_seed(seed),
        output_token_ids=list(output),
    )


def test_a_request_fills_the_first_free_row_with_its_tokens_blocks_and_parameters():
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_blocks_per_req=4)
    assert batch.add_request(state("a", [1, 2, 3]), [5], 0) == 0
    row = batch.add_request(
        state("b", [4, 5], [6, 7], temperature=0.7, top_k=3, presence_penalty=0.5, seed=1),
        [8, 9],
        3,
    )
    assert row == 1 and batch.num_reqs == 2 and batch.req_ids[:2] == ["a", "b"]
    assert batch.token_ids[1, :4].tolist() == [4, 5, 6, 7]
    assert (batch.num_tokens[1], batch.num_computed_tokens[1], batch.num_prompt_tokens[1]) == (
        4,
        3,
        2,
    )
    assert batch.block_table[1].tolist() == [8, 9, 0, 0] and batch.num_blocks[1] == 2
    assert batch.temperature[1] == np.float32(0.7) and batch.top_k[1] == 3
    assert batch.has_penalties.tolist()[:2] == [False, True]
    assert set(batch.generators) == {1}
    batch.append_block_ids(1, [10])
    assert batch.block_table[1].tolist() == [8, 9, 10, 0] and batch.num_blocks[1] == 3


def test_greedy_rows_get_temperature_zero():
    batch = InputBatch(2, 8, 2)
    batch.add_request(state("g", [1], temperature=0.0, top_p=0.5), [1], 0)
    assert batch.temperature[0] == 0.0 and batch.top_p[0] == 1.0  # the other knobs are moot


def test_removing_a_request_moves_the_last_row_into_the_hole():
    batch = InputBatch(4, 16, 4)
    moves: list[tuple[int, int]] = []
    batch.on_move = lambda src, dst: moves.append((src, dst))
    for i, name in enumerate("abc"):
        batch.add_request(state(name, [i + 1] * (i + 2), logprobs=i), [i + 1], i)
    batch.add_request(state("d", [9, 9, 9, 9, 9], seed=3), [7, 8], 2)
    version = batch.version
    batch.remove_request("b")
    assert batch.version > version
    assert batch.req_ids == ["a", "d", "c", None]
    assert batch.req_id_to_index == {"a": 0, "d": 1, "c": 2}
    assert moves == [(3, 1)]
    # Every per-row value of "d" now lives in row 1.
    assert batch.token_ids[1, :5].tolist() == [9] * 5 and batch.num_tokens[1] == 5
    assert batch.block_table[1, :2].tolist() == [7, 8] and batch.num_blocks[1] == 2
    assert batch.num_computed_tokens[1] == 2 and batch.num_logprobs[1] == -1
    assert set(batch.generators) == {1}
    batch.remove_request("c")  # the last row leaves: nothing moves
    batch.remove_request("unknown")
    assert batch.req_ids == ["a", "d", None, None] and moves == [(3, 1)]
    # A request added now takes the row after the last one.
    assert batch.add_request(state("e", [1]), [2], 0) == 2
