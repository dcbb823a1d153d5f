"""The segmented forward pass (`pagellm.models.segments`), run eagerly — segments called in order
with each layer's attention between them, no graphs — is the model's forward pass bit for bit,
on tiny Llama 3 and Qwen3 models with the real KV cache and TORCH_SDPA on the CPU; and padding
the segments' inputs to a larger token count with garbage rows changes none of the real rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm import LLM
from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.forward_context import set_forward_context
from pagellm.models.segments import SegmentedDecoder

BLOCK_SIZE = 16
BLOCKS_PER_REQUEST = 4
Step = list[tuple[int, int, int]]
"""A step's requests: (request id, context tokens already cached, tokens computed now)."""


def step_metadata(requests: Step) -> CommonAttentionMetadata:
    """The step's attention metadata; request ``r`` keeps its blocks from step to step
    (`BLOCKS_PER_REQUEST` of its own after the null block)."""
    qsl, seq_lens, slots, tables = [0], [], [], []
    for r, context, query in requests:
        blocks = 1 + r * BLOCKS_PER_REQUEST + np.arange(BLOCKS_PER_REQUEST)
        positions = np.arange(context, context + query)
        slots.append(blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE)
        qsl.append(qsl[-1] + query)
        seq_lens.append(context + query)
        tables.append(blocks)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        num_reqs=len(requests),
        num_actual_tokens=qsl[-1],
        max_query_len=max(q for _, _, q in requests),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl_t,
        query_start_loc_cpu=qsl_t,
        seq_lens=lens_t,
        seq_lens_cpu=lens_t,
        block_table=torch.tensor(np.stack(tables), dtype=torch.int32),
        slot_mapping=torch.tensor(np.concatenate(slots), dtype=torch.int64),
    )


def step_inputs(requests: Step, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (fixed per request and position, so a later step sees the ids an earlier one
    cached) and positions of a step."""
    positions = torch.cat([torch.arange(c, c + q) for _, c, q in requests])
    request = torch.cat([torch.full((q,), r) for r, _, q in requests])
    return (positions * 7 + request * 13 + 3) % vocab, positions


def segmented(
    decoder: SegmentedDecoder, ids: torch.Tensor, positions: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The segments in order over all rows of ``ids``, attention on the first ``num_tokens``;
    the attention output's other rows are garbage, as a padded graph replay leaves them."""
    layers = decoder.attention_layers()
    inputs = decoder.first_segment(ids, positions)
    generator = torch.Generator().manual_seed(0)
    for index, attention in enumerate(layers):
        output = torch.randn(inputs.q.shape, generator=generator) * 100
        n = num_tokens
        output[:n] = attention(inputs.q[:n], inputs.k[:n], inputs.v[:n])
        if index + 1 == len(layers):
            return decoder.last_segment(output, inputs.residual)
        inputs = decoder.next_segment(index + 1, positions, output, inputs.residual)
    raise AssertionError("a decoder has at least one attention layer")


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def runner(request, tiny_models):
    llm = LLM(
        tiny_models[request.param],
        enforce_eager=True,
        max_model_len=256,
        block_size=BLOCK_SIZE,
        kv_cache_memory=16 << 20,
    )
    return llm.llm_engine.engine_core.executor.worker.model_runner


# Two prefills (one whole, one a first chunk), then a mixed step: the first request decoding, a
# new request's whole prompt, and the second request's next chunk after its cached context.
STEPS: list[Step] = [[(0, 0, 37), (1, 0, 20)], [(0, 37, 1), (2, 0, 9), (1, 20, 11)]]


@torch.inference_mode()
def test_segments_with_attention_between_are_the_forward_pass_bit_for_bit(runner):
    model = runner.model
    decoder = model.segmented_decoder()
    vocab = runner.config.model.vocab_size
    for requests in STEPS:
        meta = runner.attn_builder.build(step_metadata(requests))
        ids, positions = step_inputs(requests, vocab)
        with set_forward_context(meta):
            expected = model(ids, positions)
            actual = segmented(decoder, ids, positions, len(ids))
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("padded_to", [64, 128])
@torch.inference_mode()
def test_padding_rows_of_garbage_change_no_real_row(runner, padded_to: int):
    model = runner.model
    decoder = model.segmented_decoder()
    vocab = runner.config.model.vocab_size
    generator = torch.Generator().manual_seed(1)
    for requests in STEPS:
        meta = runner.attn_builder.build(step_metadata(requests))
        ids, positions = step_inputs(requests, vocab)
        n = len(ids)
        padding = padded_to - n
        padded_ids = torch.cat([ids, torch.randint(0, vocab, (padding,), generator=generator)])
        padded_positions = torch.cat(
            [positions, torch.randint(0, 256, (padding,), generator=generator)]
        )
        with set_forward_context(meta):
            expected = model(ids, positions)
            actual = segmented(decoder, padded_ids, padded_positions, n)
        assert actual.shape[0] == padded_to
        assert torch.equal(actual[:n], expected)
