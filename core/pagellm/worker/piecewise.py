"""Piecewise graphs: the steps no decode graph serves (prefills, mixed prefill + decode batches,
decode batches above the largest decode graph) replayed in pieces. The model's forward pass is
split at each attention call (`pagellm.models.segments`); for each capture size (a token count)
every segment is recorded once as a device graph (`Platform.capture_graph`). A step of ``n``
tokens is padded up to the next size and replays that size's segments in order, each layer's
attention running eagerly in between on the ``n`` real rows with the step's own metadata: any
batch shape, and any attention backend, since attention is never captured here.

What a segment hands to the next lives in static buffers (`SegmentBuffers`), allocated once at
the largest size (a size uses their first rows) outside the graphs' memory pool. Everything else
a segment computes is a temporary of its own graph, so every graph of every size shares one
pool (with the decode graphs): only one runs at a time. The last segment's output (the final
hidden states) is each size's graph output, kept, as a decode graph's is.

Padding rows (``n`` up to the size) hold what earlier steps left in the buffers (finite: they
start zeroed, and the step buffers hold real token ids and positions). No operation of a
segment mixes rows, attention reads only the real rows, and the runner samples only those.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.attention.layer import Attention
from pagellm.forward_context import set_forward_context
from pagellm.models.segments import AttentionInputs, SegmentedDecoder
from pagellm.platforms.interface import Platform
from pagellm.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


def segmented_decoder(model: Any) -> SegmentedDecoder | None:
    """The model's forward pass in segments, or None when it has none (its steps that no
    decode graph serves then run eagerly)."""
    method = getattr(model, "segmented_decoder", None)
    return None if method is None else method()


def _packed(inputs: AttentionInputs) -> torch.Tensor | None:
    """q, k and v as the one [tokens, q + k + v] tensor they are column slices of, side by side,
    or None. They are when the fused qkv projection's output was normed and rotated in place
    (the platform's fused ops): then one copy stores all three."""
    q, k, v = inputs.q, inputs.k, inputs.v
    width = q.shape[1] + k.shape[1] + v.shape[1]
    size = q.element_size()
    storages = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    adjacent = (
        k.data_ptr() == q.data_ptr() + q.shape[1] * size
        and v.data_ptr() == k.data_ptr() + k.shape[1] * size
    )
    if len(storages) == 1 and adjacent and all(t.stride() == (width, 1) for t in (q, k, v)):
        return q.as_strided((q.shape[0], width), (width, 1))
    return None


@dataclass
class SegmentBuffers:
    """What crosses from one segment to the next, at the largest capture size."""

    qkv: torch.Tensor
    """q, k and v side by side ([tokens, q + k + v]); ``q``, ``k`` and ``v`` are its slices."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor
    attn_output: torch.Tensor
    """The attention's output, which the next segment reads (shaped like ``q``)."""

    @classmethod
    def like(cls, inputs: AttentionInputs) -> SegmentBuffers:
        """Zeroed buffers shaped like a first segment's outputs."""
        q, k, v = inputs.q, inputs.k, inputs.v
        widths = [q.shape[1], k.shape[1], v.shape[1]]
        qkv = torch.zeros(q.shape[0], sum(widths), dtype=q.dtype, device=q.device)
        sq, sk, sv = qkv.split(widths, dim=1)
        return cls(qkv, sq, sk, sv, torch.zeros_like(inputs.residual), torch.zeros_like(q))

    def store(self, inputs: AttentionInputs, size: int) -> None:
        """Copy a segment's outputs into the first ``size`` rows (inside the segment's graph):
        q, k and v in one copy where they allow it (`_packed`); the residual not at all where
        the segment updated these rows in place (the platform's fused add + norm)."""
        packed = _packed(inputs)
        if packed is not None:
            if packed.data_ptr() != self.qkv.data_ptr():  # else already there (`qkv_out`)
                self.qkv[:size].copy_(packed)
        else:
            for buffer, tensor in ((self.q, inputs.q), (self.k, inputs.k), (self.v, inputs.v)):
                buffer[:size].copy_(tensor)
        if inputs.residual.data_ptr() != self.residual.data_ptr():
            self.residual[:size].copy_(inputs.residual)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.qkv, self.residual, self.attn_output)
        )


class PiecewiseGraphs:
    def __init__(self, platform: type[Platform]) -> None:
        self.platform = platform
        self.sizes: list[int] = []
        """Captured token counts, ascending; empty when piecewise graphs are off."""
        self.replays: dict[int, list[Callable[[], None]]] = {}
        """Per size, the replay of each segment, in order."""
        self.hidden: dict[int, torch.Tensor] = {}
        """Per size, the final hidden states the last segment's replay writes."""
        self.buffers: SegmentBuffers | None = None
        self._layers: Sequence[Attention] = ()

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds a step of ``num_tokens`` tokens, or None."""
        sizes = self.sizes
        if not sizes or num_tokens > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, num_tokens)]

    def capture(
        self, model: Any, step_buffers: StepBuffers, capture_sizes: list[int], pool: object
    ) -> float:
        """Every segment of the model at every size (largest first), in ``pool``; returns the
        seconds it took (0 for a model without segments, which is left eager)."""
        decoder = segmented_decoder(model)
        if decoder is None:
            logger.info(
                "Piecewise CUDA graphs off: %s has no segmented forward pass; steps that no "
                "decode graph serves run eagerly.",
                type(model).__name__,
            )
            return 0.0
        platform, started = self.platform, time.perf_counter()
        used_before = platform.device_memory_used()
        sizes = sorted(capture_sizes)
        self._layers = decoder.attention_layers()
        inputs = step_buffers.device_tensors
        largest = sizes[-1]
        self.buffers = SegmentBuffers.like(
            decoder.first_segment(inputs.input_ids[:largest], inputs.positions[:largest])
        )
        for size in reversed(sizes):
            segments = [
                self._segment(decoder, index, size, inputs.input_ids, inputs.positions)
                for index in range(len(self._layers) + 1)
            ]
            for _ in range(2):  # warm-up: kernels compiled and autotuned outside capture
                for segment in segments:
                    segment()
            platform.synchronize()
            self.replays[size] = []
            for segment in segments:
                replay, output = platform.capture_graph(segment, pool)
                self.replays[size].append(replay)
            self.hidden[size] = output
        platform.synchronize()
        self.sizes = sizes
        seconds = time.perf_counter() - started
        used_after = platform.device_memory_used()
        memory = (
            "device memory not measured"
            if used_before is None or used_after is None
            else f"{(used_after - used_before) / 2**20:.0f} MiB of device memory "
            f"({self.buffers.nbytes() / 2**20:.0f} MiB of buffers between segments)"
        )
        logger.info(
            "Captured %d piecewise CUDA graphs (%d segments x %d sizes, %d..%d tokens) in %.1f s, "
            "%s",
            len(sizes) * len(segments),
            len(segments),
            len(sizes),
            sizes[0],
            largest,
            seconds,
            memory,
        )
        return seconds

    def _segment(
        self,
        decoder: SegmentedDecoder,
        index: int,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> Callable[[], torch.Tensor]:
        """Segment ``index`` at ``size`` tokens over the static buffers, as captured."""
        buffers = self.buffers
        assert buffers is not None  # set by `capture` first
        ids, pos = input_ids[:size], positions[:size]
        attn_output, residual = buffers.attn_output[:size], buffers.residual[:size]
        qkv = buffers.qkv[:size]  # the projection is written there, and normed/rotated in place
        if index == len(self._layers):
            return lambda: decoder.last_segment(attn_output, residual)

        def run() -> torch.Tensor:
            if index == 0:
                inputs = decoder.first_segment(ids, pos, qkv)
            else:
                inputs = decoder.next_segment(index, pos, attn_output, residual, qkv)
            buffers.store(inputs, size)
            return residual  # a static buffer: the graph's output is unused

        return run

    def run(self, size: int, num_tokens: int, attn_metadata: Any) -> torch.Tensor:
        """One step of ``num_tokens`` tokens (the step buffers already hold its inputs) through
        the graphs of ``size``, attention in between with ``attn_metadata`` (built for the
        step's real tokens); returns the final hidden states of those tokens."""
        buffers, n = self.buffers, num_tokens
        assert buffers is not None  # `size` comes from `size_for`: graphs were captured
        replays = self.replays[size]
        with set_forward_context(attn_metadata):
            for replay, attention in zip(replays[:-1], self._layers, strict=True):
                replay()
                attention(buffers.q[:n], buffers.k[:n], buffers.v[:n], buffers.attn_output[:n])
        replays[-1]()
        return self.hidden[size][:n]
