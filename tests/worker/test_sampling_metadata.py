"""`SamplingMetadataBuilder` without a model: the metadata of the sampling rows, gathered from a
persistent batch of requests with every kind of sampling parameter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.sampling_params import SamplingParams
from pagellm.worker.input_batch import CachedRequestState, InputBatch
from pagellm.worker.penalty_state import PenaltyState
from pagellm.worker.sampling_metadata import SamplingMetadataBuilder

VOCAB = 50
EOS = 2


class Runner:
    """The batch, its request states and penalty statistics, as the model runner keeps them."""

    def __init__(self) -> None:
        self.batch = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=4)
        self.requests: dict[str, CachedRequestState] = {}
        self.penalties = PenaltyState(4, VOCAB, torch.device("cpu"))
        self.batch.on_move = self.penalties.move_row
        self.builder = SamplingMetadataBuilder(
            self.batch, self.requests, self.penalties, VOCAB, torch.device("cpu"), seed=0
        )

    def add(self, req_id: str, prompt: list[int], output: list[int] = (), **params) -> int:
        sampling = SamplingParams(**params)
        generator = None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
        state = CachedRequestState(req_id, prompt, sampling, generator, EOS, list(output))
        self.requests[req_id] = state
        row = self.batch.add_request(state, [1], len(prompt) + len(output))
        if self.batch.has_penalties[row]:
            self.penalties.fill_row(row, prompt, list(output))
        return row

    def build(self, *rows: int):
        return self.builder.build(np.array(rows, dtype=np.int64))


@pytest.fixture
def runner() -> Runner:
    return Runner()


def test_dense_parameters_per_sampling_row(runner):
    runner.add("greedy", [5, 6], temperature=0.0)
    runner.add("nucleus", [5], temperature=0.8, top_p=0.9, top_k=200, logprobs=3)
    runner.add("seeded", [5], temperature=1.0, top_k=4, min_p=0.1, seed=7)
    md = runner.build(1, 2, 0)  # the rows that sample, in the step's order
    assert md.temperature.tolist() == pytest.approx([0.8, 1.0, 0.0])
    assert (md.all_greedy, md.all_random) == (False, False)
    assert md.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert md.top_k.tolist() == [VOCAB, 4, VOCAB]  # capped at the vocabulary; 0 means off
    assert md.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert md.max_num_logprobs == 3
    assert set(md.generators) == {1} and md.generators[1] is runner.batch.generators[2]
    assert md.penalties is None and md.logit_bias is None and md.banned is None

    greedy_only = runner.build(0)
    assert greedy_only.all_greedy and not greedy_only.all_random
    assert greedy_only.top_p is None and greedy_only.top_k is None and greedy_only.min_p is None
    assert greedy_only.max_num_logprobs is None


def test_parameters_are_reused_until_the_batch_or_the_rows_change(runner):
    runner.add("a", [5], temperature=0.5)
    runner.add("b", [6], temperature=0.7)
    first = runner.build(0, 1)
    assert runner.build(0, 1) is first
    assert runner.build(1).temperature.tolist() == pytest.approx([0.7])
    runner.batch.remove_request("a")  # "b" moves to row 0
    assert runner.build(0).temperature.tolist() == pytest.approx([0.7])


def test_penalties_come_with_the_rows_output_counts(runner):
    runner.add("plain", [5])
    runner.add("presence", [7, 8], [9, 9, 3], presence_penalty=0.5, frequency_penalty=0.25)
    runner.add("repetition", [4], [1], repetition_penalty=1.3)
    md = runner.build(0, 1)
    p = md.penalties
    assert p.presence.tolist() == [0.0, 0.5] and p.frequency.tolist() == [0.0, 0.25]
    assert p.output_counts[1, 9].item() == 2 and p.output_counts[1, 3].item() == 1
    assert p.output_counts[0].sum().item() == 0
    assert p.prompt_mask is None  # no row here has a repetition penalty
    p = runner.build(2, 1).penalties
    assert p.repetition.tolist() == pytest.approx([1.3, 1.0])
    assert p.prompt_mask[0].nonzero().flatten().tolist() == [4]
    assert p.prompt_mask[1].nonzero().flatten().tolist() == [7, 8]
    assert runner.build(0).penalties is None


def test_bias_allowed_tokens_bad_words_and_min_tokens(runner):
    runner.add("bias", [5], logit_bias={3: 2.0, 7: -1.5})
    runner.add("allowed", [5], allowed_token_ids=[1, 4])
    # 10 is banned after [8, 9] (the output ends so), 11 always, 13 not (12 did not come before);
    # prefixes are matched in the output only.
    runner.add("bad", [5], [8, 9], bad_words_token_ids=[[8, 9, 10], [11], [12, 13], [5, 6]])
    runner.add("short", [5], [6], min_tokens=3, stop_token_ids=[20, 99])
    md = runner.build(0, 1, 2, 3)
    rows, tokens, values = md.logit_bias
    assert rows.tolist() == [0, 0] and tokens.tolist() == [3, 7]
    assert values.tolist() == pytest.approx([2.0, -1.5])
    assert md.allowed_mask.shape == (4, VOCAB)
    assert md.allowed_mask[1].nonzero().flatten().tolist() == [1, 4]
    assert md.allowed_mask[0].all() and md.allowed_mask[3].all()
    banned_rows, banned_tokens = md.banned
    # The stop tokens and EOS are banned until min_tokens are out; 99 is past the vocabulary.
    assert list(zip(banned_rows.tolist(), banned_tokens.tolist(), strict=True)) == [
        (2, 10),
        (2, 11),
        (3, 20),
        (3, EOS),
    ]
    assert runner.build(0, 1) is not runner.build(0, 1)  # per-row lists are gathered each step


def test_min_tokens_stops_banning_once_reached(runner):
    row = runner.add("short", [5], [6, 7], min_tokens=3, stop_token_ids=[20])
    assert runner.build(row).banned is not None
    runner.batch.num_tokens[row] += 1  # a third output token was appended
    md = runner.build(row)
    assert md.banned is None
