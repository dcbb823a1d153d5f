"""Which kernel serves which phase, from the measurements of `measurements`.

The candidates are the kernels that import here and fit the GPU, the head size and the block
size: the FlashAttention providers for prefill (and mixed) steps, those and TRITON for decode.
Each phase gets the candidate measured fastest for it on this GPU at this block size (an entry
without a block size stands in for one); without any measurement, prefill takes the first
provider in `PROVIDERS` order and decode the prefill kernel. ``PAGELLM_FLASH_ATTN_PREFILL`` /
``PAGELLM_FLASH_ATTN_DECODE`` (a kernel name) override the choice, for A/B runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pagellm_flash_attn.kernels import KERNELS, PROVIDERS, AttentionKernel
from pagellm_flash_attn.kernels.base import sm_name
from pagellm_flash_attn.measurements import MEASUREMENTS, Measurement, Phase

PREFILL_VAR = "PAGELLM_FLASH_ATTN_PREFILL"
DECODE_VAR = "PAGELLM_FLASH_ATTN_DECODE"
UNITS = {"prefill": "TFLOP/s", "decode": "GB/s"}


class NoFlashKernel(ValueError):
    """No kernel can serve a phase here; the message lists every kernel's reason."""


@dataclass(frozen=True)
class PhaseChoice:
    prefill: type[AttentionKernel]
    decode: type[AttentionKernel]
    prefill_why: str
    decode_why: str
    passed_over: tuple[str, ...]
    """Why each kernel that is not a candidate is not."""


def candidates(
    kernels: Iterable[type[AttentionKernel]],
    capability: tuple[int, int],
    head_size: int,
    block_size: int,
) -> tuple[list[type[AttentionKernel]], list[str]]:
    """The kernels that can serve the model here, and why each other one cannot."""
    usable, reasons = [], []
    for kernel in kernels:
        unavailable = kernel.unavailable_reason() or kernel.unsupported_gpu(capability)
        why = (
            [unavailable]
            if unavailable
            else kernel.unsupported_shape(capability, head_size, block_size)
        )
        if why:
            reasons.extend(why)
        else:
            usable.append(kernel)
    return usable, reasons


def measured(
    kernel: str,
    phase: Phase,
    capability: tuple[int, int],
    block_size: int,
    measurements: Iterable[Measurement] = MEASUREMENTS,
) -> Measurement | None:
    """The (last) measurement of ``kernel`` for ``phase`` on this GPU at this block size, or
    else its measurement without a recorded block size."""
    mine = [
        m
        for m in measurements
        if m.kernel == kernel and m.phase == phase and m.capability == capability
    ]
    exact = [m for m in mine if m.block_size == block_size]
    unrecorded = [m for m in mine if m.block_size is None]
    found = exact or unrecorded
    return found[-1] if found else None


def _pick(
    phase: Phase,
    usable: list[type[AttentionKernel]],
    default: type[AttentionKernel],
    forced: str | None,
    capability: tuple[int, int],
    block_size: int,
    measurements: Iterable[Measurement],
) -> tuple[type[AttentionKernel], str]:
    var = PREFILL_VAR if phase == "prefill" else DECODE_VAR
    if forced:
        chosen = next((k for k in usable if k.name == forced.upper()), None)
        if chosen is None:
            names = [k.name for k in usable]
            known = "" if forced.upper() in KERNELS else f" (kernels: {', '.join(KERNELS)})"
            raise NoFlashKernel(f"{var}={forced} cannot serve {phase} here{known}; usable: {names}")
        return chosen, f"set by {var}"
    scored = [
        (m, k)
        for k in usable
        if (m := measured(k.name, phase, capability, block_size, measurements)) is not None
    ]
    if not scored:
        return (
            default,
            f"no {phase} measurement on {sm_name(capability)} at block size {block_size}",
        )
    scored.sort(key=lambda mk: mk[0].value, reverse=True)
    best, chosen = scored[0]
    others = ", ".join(f"{k.name} {m.value:,.0f}" for m, k in scored[1:])
    at = f" at block size {best.block_size}" if best.block_size else ""
    why = f"{best.value:,.0f} {UNITS[phase]} measured on {sm_name(capability)}{at}"
    return chosen, why + (f"; {others}" if others else "")


def choose_phases(
    capability: tuple[int, int],
    head_size: int,
    block_size: int,
    *,
    measurements: Iterable[Measurement] = MEASUREMENTS,
    environ: Mapping[str, str] = os.environ,
) -> PhaseChoice:
    providers, passed_over = candidates(PROVIDERS, capability, head_size, block_size)
    if not providers:
        raise NoFlashKernel("; ".join(passed_over))
    others, others_passed_over = candidates(
        [k for k in KERNELS.values() if k not in PROVIDERS], capability, head_size, block_size
    )
    measurements = tuple(measurements)
    prefill, prefill_why = _pick(
        "prefill", providers, providers[0], environ.get(PREFILL_VAR), capability, block_size,
        measurements,
    )  # fmt: skip
    decode, decode_why = _pick(
        "decode", providers + others, prefill, environ.get(DECODE_VAR), capability, block_size,
        measurements,
    )  # fmt: skip
    return PhaseChoice(
        prefill, decode, prefill_why, decode_why, tuple(passed_over + others_passed_over)
    )
