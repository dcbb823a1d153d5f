"""A decoder's forward pass split at each attention call, for piecewise graphs
(`pagellm.worker.piecewise`): everything between two attention calls is captured as one graph
per token count, and attention runs eagerly in between, with the step's own metadata.

With ``L`` attention layers there are ``L + 1`` segments: `first_segment` (the embedding and the
first layer up to its attention inputs), `next_segment` for layers ``1 .. L - 1`` (the previous
layer's output projection, residual add, norm and MLP, then this layer up to its attention
inputs), and `last_segment` (the last layer after attention and the final norm). Running them in
order with each layer's attention between them is the model's forward pass, operation for
operation. Every operation of a segment works on each token's row alone, so rows appended to
the inputs (padding up to a captured size) change no other row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagellm.attention.layer import Attention


@dataclass
class AttentionInputs:
    """What one layer's attention takes, and the residual stream beside it."""

    q: torch.Tensor
    """[tokens, heads * head_size]; attention returns a tensor of this shape."""
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor
    """[tokens, hidden]"""


class SegmentedDecoder(Protocol):
    """What a model's ``segmented_decoder()`` returns (models without that method run every
    step that no decode graph serves eagerly). A segment reads only its arguments and the
    model's parameters and buffers: no tensor that another segment computed."""

    def attention_layers(self) -> Sequence[Attention]:
        """The attention calls between segments, in order."""
        ...

    def first_segment(
        self, input_ids: torch.Tensor, positions: torch.Tensor, qkv_out: torch.Tensor | None = None
    ) -> AttentionInputs:
        """The embedding and layer 0 up to its attention inputs. ``qkv_out`` (optional, a
        contiguous [tokens, q + k + v] buffer): where the fused q/k/v projection may be written,
        so that q, k and v come back as its column slices and need no copy into it."""
        ...

    def next_segment(
        self,
        index: int,
        positions: torch.Tensor,
        attn_output: torch.Tensor,
        residual: torch.Tensor,
        qkv_out: torch.Tensor | None = None,
    ) -> AttentionInputs:
        """From attention layer ``index - 1``'s output to attention layer ``index``'s inputs
        (``qkv_out`` as in `first_segment`)."""
        ...

    def last_segment(self, attn_output: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """From the last attention layer's output to the final hidden states."""
        ...
