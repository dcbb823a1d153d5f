"""Decode-only steps captured once per batch size as device graphs (CUDA graphs on NVIDIA GPUs),
then replayed: one launch instead of one per kernel. The platform records and replays
(`Platform.capture_graph`); this module picks the sizes, stages the padded inputs captures read
and finds the graph that fits a step.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadataBuilder
from pagellm.forward_context import set_forward_context
from pagellm.platforms.interface import Platform
from pagellm.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


@dataclass
class CapturedGraph:
    """A decode step of ``size`` rows: ``replay()`` re-runs the forward pass on whatever the
    persistent step buffers hold, writing into ``hidden``."""

    size: int
    replay: Callable[[], None]
    hidden: torch.Tensor
    attn_metadata: Any
    """The metadata the graph was captured with; the graph reads its tensors."""


class DecodeGraphs:
    def __init__(self, platform: type[Platform]) -> None:
        self.platform = platform
        self.sizes: list[int] = []
        """Captured batch sizes, ascending; empty when graphs are off."""
        self.captured: dict[int, CapturedGraph] = {}

    def for_step(self, num_reqs: int, num_tokens: int) -> CapturedGraph | None:
        """The smallest graph that holds a decode-only step of ``num_reqs`` rows, or None (the
        step runs eagerly)."""
        sizes = self.sizes
        if num_tokens != num_reqs or not sizes or num_reqs > sizes[-1]:
            return None
        return self.captured[sizes[bisect.bisect_left(sizes, num_reqs)]]

    def capture(
        self,
        model: torch.nn.Module,
        attn_backend: type[AttentionBackend],
        attn_builder: AttentionMetadataBuilder,
        buffers: StepBuffers,
        capture_sizes: list[int],
        max_model_len: int,
        pool: object,
    ) -> float:
        """One graph per size (largest first, in ``pool``, which they share); returns the
        seconds it took."""
        if not attn_backend.cudagraph_support:
            raise ValueError(
                f"Attention backend {attn_backend.name} does not support CUDA graphs; "
                "pass --enforce-eager."
            )
        sizes = sorted(s for s in capture_sizes if s <= buffers.max_reqs)
        started = time.perf_counter()
        platform = self.platform
        used_before = platform.device_memory_used()
        for size in reversed(sizes):
            # Every row is padding (seq_len 0, slot -1): capture reads no KV cache.
            buffers.stage_padding(0, 0, size)
            common = buffers.attention_metadata(
                size, size, 1, max_model_len, buffers.max_blocks_per_req
            )
            meta = attn_builder.build_for_cudagraph(common)

            def forward(size: int = size, meta: Any = meta) -> torch.Tensor:
                with set_forward_context(meta):
                    return model(
                        buffers.device_tensors.input_ids[:size],
                        buffers.device_tensors.positions[:size],
                    )

            for _ in range(2):  # warm-up: kernels compiled and autotuned outside capture
                forward()
            platform.synchronize()
            replay, hidden = platform.capture_graph(forward, pool)
            self.captured[size] = CapturedGraph(size, replay, hidden, meta)
        platform.synchronize()
        self.sizes = sizes
        seconds = time.perf_counter() - started
        used_after = platform.device_memory_used()
        logger.info(
            "Captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s, %s",
            len(sizes),
            sizes[0],
            sizes[-1],
            seconds,
            "device memory not measured"
            if used_before is None or used_after is None
            else f"{(used_after - used_before) / 2**20:.0f} MiB of device memory",
        )
        return seconds
