"""Steps of a few requests laid out by hand for tests that call a model's forward pass (or its
segments) directly: the attention metadata of a step and its token ids and positions, each
request in KV blocks of its own that it keeps from step to step."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.attention.backend import CommonAttentionMetadata

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


# Two prefills (one whole, one a first chunk), then a mixed step: the first request decoding, a
# new request's whole prompt, and the second request's next chunk after its cached context.
STEPS: list[Step] = [[(0, 0, 37), (1, 0, 20)], [(0, 37, 1), (2, 0, 9), (1, 20, 11)]]
