"""A request's tokens as the scheduler keeps them: the prompt as a tuple (out of the garbage
collector's full collections once it survived one), the output as a list, and no third list of
both; slices across the prompt's end, block hashes and the workers' copy agree with one list of
all the tokens."""

from __future__ import annotations

import gc

import pytest

from pagellm.executor import wire
from pagellm.kv_cache.hashing import make_block_hasher
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

BLOCK = 4


def _request(prompt: list[int], outputs: list[int] = ()) -> Request:
    request = Request(
        "r",
        prompt,
        SamplingParams(max_tokens=64),
        eos_token_id=None,
        block_hasher=make_block_hasher(BLOCK),
    )
    for token in outputs:
        request.append_output_token(token)
    return request


def test_token_slices_match_one_list_of_all_tokens():
    prompt, outputs = list(range(100, 110)), list(range(7))
    request = _request(prompt, outputs)
    tokens = prompt + outputs
    assert request.all_token_ids == tokens and request.num_tokens == len(tokens)
    for start in range(len(tokens) + 1):
        for end in range(start, len(tokens) + 1):
            assert list(request.token_slice(start, end)) == tokens[start:end], (start, end)


@pytest.mark.parametrize("num_outputs", [0, 1, 2, 5, 9])
def test_block_hashes_across_the_prompts_end_match_a_prompt_of_all_tokens(num_outputs):
    prompt, outputs = list(range(50, 61)), list(range(300, 300 + num_outputs))
    grown = _request(prompt, outputs)
    whole = _request(prompt + outputs)
    assert len(grown.block_hashes) == (len(prompt) + num_outputs) // BLOCK
    assert grown.block_hashes == whole.block_hashes


def test_the_prompt_leaves_the_collectors_watch_and_the_request_holds_no_list_of_it():
    request = _request(list(range(1000)), [1, 2, 3])
    gc.collect()
    assert isinstance(request.prompt_token_ids, tuple)
    assert not gc.is_tracked(request.prompt_token_ids)
    lists = [v for v in vars(request).values() if isinstance(v, list)]
    assert all(len(v) < 1000 for v in lists), [len(v) for v in lists]


def test_the_workers_get_the_prompt_as_a_tuple_over_the_wire():
    """What the multiprocess executor sends its workers: the prompt decodes as a tuple too."""
    request = _request([5, 6, 7])
    new = NewRequestData(
        req_id="r",
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        block_ids=[1],
        num_computed_tokens=0,
    )
    step = SchedulerOutput([new], CachedRequestData(), {"r": 3}, 3, set(), set())
    msg = wire.driver_decoder.decode(wire.encoder.encode(wire.ExecuteModel(1, step)))
    prompt = msg.scheduler_output.scheduled_new_reqs[0].prompt_token_ids
    assert prompt == (5, 6, 7) and isinstance(prompt, tuple)
