"""The segmented forward pass (`pagellm.models.segments`), run eagerly — segments called in order
with each layer's attention between them, no graphs — is the model's forward pass bit for bit,
on tiny Llama 3 and Qwen3 models with the real KV cache and TORCH_SDPA on the CPU; and padding
the segments' inputs to a larger token count with garbage rows changes none of the real rows."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM
from pagellm.forward_context import set_forward_context
from pagellm.models.segments import SegmentedDecoder
from segment_steps import BLOCK_SIZE, STEPS, step_inputs, step_metadata


def segmented(
    decoder: SegmentedDecoder,
    ids: torch.Tensor,
    positions: torch.Tensor,
    num_tokens: int,
    qkv_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The segments in order over all rows of ``ids``, attention on the first ``num_tokens``;
    the attention output's other rows are garbage, as a padded graph replay leaves them. With
    ``qkv_out``, each layer's q/k/v projection is written there (as piecewise graphs ask), and
    v at least comes back as its slice."""
    layers = decoder.attention_layers()
    inputs = decoder.first_segment(ids, positions, qkv_out)
    generator = torch.Generator().manual_seed(0)
    for index, attention in enumerate(layers):
        output = torch.randn(inputs.q.shape, generator=generator) * 100
        n = num_tokens
        output[:n] = attention(inputs.q[:n], inputs.k[:n], inputs.v[:n])
        if index + 1 == len(layers):
            return decoder.last_segment(output, inputs.residual)
        inputs = decoder.next_segment(index + 1, positions, output, inputs.residual, qkv_out)
        if qkv_out is not None:
            width = qkv_out.shape[1]
            assert inputs.v.data_ptr() == qkv_out.data_ptr() + (width - inputs.v.shape[1]) * 4
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
            first = decoder.first_segment(ids, positions)
            width = first.q.shape[1] + first.k.shape[1] + first.v.shape[1]
            buffer = torch.full((len(ids), width), float("nan"))
            into_buffer = segmented(decoder, ids, positions, len(ids), buffer)
        assert torch.equal(actual, expected)
        assert torch.equal(into_buffer, expected)  # the projection written in place: same bits


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
