"""The user's CUDA-graph choice (``--cudagraph-mode``, ``--piecewise-capture-sizes``,
``--enforce-eager``) and the platform's (`Platform.check_and_update_config`, which turns decode
graphs on where it records graphs and the attention backend can be captured), made one
`CompilationConfig`: `compilation_config` before the platform's look, `apply_cudagraph_mode`
after it.

Piecewise graphs (`pagellm.worker.piecewise`) come with the decode graphs by default
(``auto``) wherever the platform turns those on: measured on the H200 (docs/benchmarks.md), they
took the prefill-heavy run from 2.32 to 1.92 s and W2 from 24,430 to 25,527 output tok/s with the
same tokens. ``--cudagraph-mode decode`` keeps decode graphs alone.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pagellm.attention.registry import attention_backends
from pagellm.config import CompilationConfig, ConfigError, EngineConfig
from pagellm.platforms.interface import Platform

logger = logging.getLogger(__name__)

RequestedCudaGraphMode = Literal["auto", "none", "decode", "decode_and_piecewise"]
"""auto: the platform's choice (decode graphs where it records graphs), with piecewise graphs
beside them; none: the same as ``--enforce-eager``; decode: decode graphs alone, refused where
the platform captures none; decode_and_piecewise: decode graphs and piecewise graphs, refused
likewise."""

_GRAPH_MODES = ("decode", "decode_and_piecewise")

DEFAULT_PIECEWISE_CAPTURE_SIZES = (
    16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384
)  # fmt: skip
"""Token counts with piecewise graphs by default (those up to ``max_num_batched_tokens``, and
that budget itself unless it is above the largest: such huge steps run eagerly): powers of two
up to 256, where a step is bound by reading the weights and padding rows cost little, then
steps of at most half the size below, so that no step above 256 tokens computes more than 1.5
times its rows. Full 8,192-token steps gain too: on the H200 a
prefill step of W2's model (Qwen3-0.6B shapes) runs its ~470 kernels in 26 ms, and launched one
by one from Python they left the device idle for part of it. Each size costs one graph per
attention layer plus one; on the H200, 290 graphs (10 sizes of W2's model) took 0.4 s to capture
and 330 MiB (`--piecewise-capture-sizes` to choose others)."""


def compilation_config(args: Any, pooling: bool) -> CompilationConfig:
    """The compilation config the platform looks at, from the engine arguments (`EngineArgs`'
    fields of the same names); refuses contradictory requests."""
    mode, enforce_eager = args.cudagraph_mode, args.enforce_eager
    if enforce_eager and mode in _GRAPH_MODES:
        raise ConfigError(
            f"cudagraph_mode={mode!r} (--cudagraph-mode) asks for CUDA graphs, which "
            "enforce_eager (--enforce-eager) turns off; drop one of them."
        )
    if args.piecewise_capture_sizes is not None and (
        mode not in ("auto", "decode_and_piecewise") or enforce_eager
    ):
        why = "enforce_eager (--enforce-eager) is set" if enforce_eager else f"it is {mode!r}"
        raise ConfigError(
            "piecewise_capture_sizes (--piecewise-capture-sizes) applies only with piecewise "
            f"graphs (--cudagraph-mode auto or decode_and_piecewise), and {why}."
        )
    if pooling and mode in _GRAPH_MODES:
        raise ConfigError(
            f"cudagraph_mode={mode!r} (--cudagraph-mode): a pooling model's steps always run "
            "eagerly (graphs replay generation steps); drop --cudagraph-mode."
        )
    # Decode graphs replay one-token steps, which a pooling model never runs.
    return CompilationConfig(enforce_eager=enforce_eager or pooling or mode == "none")


def apply_cudagraph_mode(config: EngineConfig, args: Any, platform: Any) -> None:
    """After the platform's `check_and_update_config`: refuse a graph mode the platform left
    off, and add the piecewise graphs when asked."""
    comp, mode = config.compilation, args.cudagraph_mode
    if mode in _GRAPH_MODES and comp.cudagraph_mode == "none":
        backend = attention_backends.get(config.attention_backend)
        overrides = next(k for k in platform.__mro__ if "capture_graph" in vars(k))
        if overrides is Platform:  # its capture_graph raises: the platform records none
            why = f"platform {platform.name} records no graphs"
        elif not backend.cudagraph_support:
            why = (
                f"attention backend {backend.name} does not support them (choose one that "
                "does with --attention-backend)"
            )
        else:
            why = f"platform {platform.name} left them off (see its log line)"
        raise ConfigError(
            f"cudagraph_mode={mode!r} (--cudagraph-mode) needs CUDA graphs, but {why}; "
            "use --cudagraph-mode auto or none."
        )
    if mode == "auto" and comp.cudagraph_mode == "decode":
        mode = "decode_and_piecewise"  # the default beside the platform's decode graphs
    elif mode == "auto" and args.piecewise_capture_sizes is not None:
        logger.info(
            "piecewise_capture_sizes (--piecewise-capture-sizes) unused: platform %s left CUDA "
            "graphs off, so every step runs eagerly.",
            platform.name,
        )
    if mode != "decode_and_piecewise":
        return
    budget = config.scheduler.max_num_batched_tokens
    comp.piecewise_capture_sizes = piecewise_capture_sizes(args.piecewise_capture_sizes, budget)
    comp.cudagraph_mode = "decode_and_piecewise"
    sizes = comp.piecewise_capture_sizes
    logger.info(
        "Piecewise CUDA graphs on for steps of up to %d tokens that no decode graph serves "
        "(%d sizes: %s).",
        sizes[-1],
        len(sizes),
        ", ".join(map(str, sizes)),
    )


def piecewise_capture_sizes(requested: list[int] | None, max_num_batched_tokens: int) -> list[int]:
    """The user's sizes (sorted, each checked against the token budget), or the default ones
    that fit the budget and the budget itself when it is below the largest, so that a full step
    needs no padding."""
    if requested is None:
        sizes = {s for s in DEFAULT_PIECEWISE_CAPTURE_SIZES if s <= max_num_batched_tokens}
        if max_num_batched_tokens <= DEFAULT_PIECEWISE_CAPTURE_SIZES[-1]:
            sizes.add(max_num_batched_tokens)  # larger steps run eagerly
        return sorted(sizes)
    if not requested:
        raise ConfigError(
            "piecewise_capture_sizes=[] (--piecewise-capture-sizes) names no size; give at least "
            "one token count, or use --cudagraph-mode decode for no piecewise graphs."
        )
    too_large = sorted(s for s in set(requested) if s > max_num_batched_tokens)
    if too_large:
        raise ConfigError(
            f"piecewise_capture_sizes {too_large} (--piecewise-capture-sizes) exceed "
            f"max_num_batched_tokens={max_num_batched_tokens}: no step has that many tokens; "
            "drop them or raise --max-num-batched-tokens."
        )
    return sorted(set(requested))
