"""FLASHINFER's one-token rows on TRITON_ATTN's split-KV decode kernel: the default on CUDA when
pagellm-triton-attn can run; ``PAGELLM_FLASHINFER_DECODE=flashinfer`` picks FlashInfer's
tensor-core decode wrapper, ``=triton`` insists on this kernel (start-up fails without it).

Measured on an H100 (docs/benchmarks.md, 2026-12-07), FlashInfer's decode kernel takes 6.04 ms of
a 256-row decode step of W2's model where TRITON_ATTN's takes 5.77, which left FLASHINFER 2-4 %
behind TRITON_ATTN on W1 and W2; with this kernel its decode steps take TRITON_ATTN's time
(6.61 against 6.60 ms, 14.15 against 14.15 ms) and W1/W2 are level with TRITON_ATTN's. FLASHINFER
keeps its FA3 prefill and decodes as TRITON_ATTN does, over its own NHD pages
(pagellm-triton-attn's `DecodeRunner`: a permuted view, no copy). Decode-only steps and captured
decode graphs then need no page gather and no FlashInfer plan; in a mixed step the prefill
wrapper serves the rows after the leading decode rows, then the kernel writes every one-token row.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm_flashinfer.planning import LayerParams

logger = logging.getLogger(__name__)

DECODE_VAR = "PAGELLM_FLASHINFER_DECODE"
DECODE_KERNELS = ("flashinfer", "triton")


def decode_kernel_choice(device: torch.device, environ: Mapping[str, str] = os.environ) -> str:
    """``PAGELLM_FLASHINFER_DECODE`` when set; else ``"triton"`` on CUDA when TRITON_ATTN's
    kernel can run there (the measured faster one), else ``"flashinfer"``."""
    value = environ.get(DECODE_VAR)
    if value is None:
        if device.type == "cuda" and triton_unavailable_reason() is None:
            return "triton"
        return "flashinfer"
    if value not in DECODE_KERNELS:
        raise ValueError(f"{DECODE_VAR}={value!r}: expected one of {', '.join(DECODE_KERNELS)}")
    return value


def triton_unavailable_reason() -> str | None:
    try:
        from pagellm_triton_attn.backend import TritonAttentionBackend
    except ImportError as exc:
        return (
            f"pagellm-triton-attn is not installed ({exc}; "
            "pip install 'pagellm-flashinfer[triton]')"
        )
    return TritonAttentionBackend.is_available()


def triton_decode_runner(
    kv_cache_spec: KVCacheSpec, device: torch.device, environ: Mapping[str, str] = os.environ
) -> Any:
    """pagellm-triton-attn's `DecodeRunner` when the one-token rows go to TRITON_ATTN's kernel
    (`decode_kernel_choice`), else None; raises ValueError when ``PAGELLM_FLASHINFER_DECODE=triton``
    asks for that kernel and it cannot run here."""
    if decode_kernel_choice(device, environ) != "triton":
        logger.info("FLASHINFER: one-token rows on FlashInfer's tensor-core decode wrapper")
        return None
    asked = DECODE_VAR in environ  # unset, the choice already checked that the kernel can run
    reason = triton_unavailable_reason() if asked else None
    if reason:
        raise ValueError(
            f"{DECODE_VAR}=triton, but TRITON_ATTN's decode kernel cannot run: {reason}"
        )
    from pagellm_triton_attn.decode_runner import DecodeRunner

    how = (
        f"{DECODE_VAR}=triton"
        if asked
        else f"the default; {DECODE_VAR}=flashinfer for FlashInfer's"
    )
    logger.info("FLASHINFER: one-token rows on TRITON_ATTN's decode kernel (%s)", how)
    return DecodeRunner(kv_cache_spec, device)


class TritonDecode:
    """A step part's "wrapper" (``run(q, (k_cache, v_cache), out=...)``, as FlashInfer's) that
    runs TRITON_ATTN's decode kernel over every row of the step, writing the one-token rows."""

    def __init__(
        self, runner: Any, common: CommonAttentionMetadata, num_decode_rows: int, for_graph: bool
    ) -> None:
        self.runner = runner
        self.query_start_loc = common.query_start_loc
        self.seq_lens = common.seq_lens
        self.block_table = common.block_table
        self.plan = runner.plan(common, num_decode_rows, for_graph)
        self.params: LayerParams | None = None

    @staticmethod
    def set_params(part: Any, params: LayerParams) -> None:
        """A `StepPart`'s ``plan``: the layers' softmax scale and window (no FlashInfer plan)."""
        part.wrapper.params = params

    def prepare_replay(self, common: CommonAttentionMetadata) -> None:
        self.runner.prepare_replay(self.plan, common)

    def run(
        self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor:
        params = self.params
        assert params is not None, "planned by the step's first layer"
        window = None if params.window_left < 0 else params.window_left + 1
        return self.runner.run(
            q,
            kv_cache[0],
            kv_cache[1],
            out,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.plan,
            params.sm_scale,
            window,
        )
