"""The per-layer scales of an FP8 KV cache: taken out of the checkpoint's tensors as they stream to
the model, then given to the attention layers.

A cache entry stores ``value / scale`` (saturated to e4m3's range), so a layer whose keys reach
1,000 needs a key scale of about 1000 / 448. Checkpoints name the scales as vLLM reads them
(`vllm.model_executor.model_loader.weight_utils.maybe_remap_kv_scale_name`):

- ``<layer>.self_attn.k_scale`` / ``.v_scale`` (compressed-tensors, llm-compressor),
- ``<layer>.self_attn.attn.k_scale`` / ``.v_scale`` (vLLM's own module names),
- ``<layer>.self_attn.k_proj.k_scale`` / ``.v_proj.v_scale`` (NVIDIA ModelOpt),
- ``<layer>.self_attn.k_proj.output_scale`` / ``.v_proj.output_scale`` (AutoFP8),
- ``<layer>.self_attn.kv_scale``: one scale for keys and values (deprecated).

Without them every scale is 1.0 (right for activations within +-448); scales are not calibrated.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator

from torch import nn

from pagellm.attention.layer import Attention
from pagellm.layers.linear import CheckpointTensor, materialize

logger = logging.getLogger(__name__)

_SCALE_NAME = re.compile(
    r"^(?P<attn>.+\.self_attn)\."
    r"(?:attn\.(?P<own>[kv])_scale|(?P<proj>[kv])_proj\.(?:[kv]|output)_scale|(?P<plain>[kv]{1,2})_scale)$"
)

KVScales = dict[str, dict[str, float]]
"""Attention block name (``model.layers.0.self_attn``) -> {"k": scale, "v": scale}."""


def take_kv_scales(
    weights: Iterable[tuple[str, CheckpointTensor]], into: KVScales
) -> Iterator[tuple[str, CheckpointTensor]]:
    """``weights`` without their KV cache scales, which land in ``into`` as they stream by."""
    for name, tensor in weights:
        match = _SCALE_NAME.match(name)
        if match is None:
            yield name, tensor
            continue
        which = match["own"] or match["proj"] or match["plain"]
        tensor = materialize(tensor)
        if tensor.numel() != 1:
            raise NotImplementedError(
                f"Checkpoint tensor {name!r} holds {tensor.numel()} KV cache scales; only one "
                "scale per layer (per-tensor) is supported."
            )
        scale = float(tensor.reshape(-1)[0])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"Checkpoint KV cache scale {name!r} is {scale}, not a positive number."
            )
        for part in which:  # "kv" sets both
            into.setdefault(match["attn"], {})[part] = scale


def apply_kv_scales(model: nn.Module, scales: KVScales, cache_dtype: str) -> None:
    """Give each attention layer its scales (1.0 where the checkpoint has none) and say where
    they came from."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
    unknown = [block for block in scales if f"{block}.attn" not in layers]
    if unknown:
        raise ValueError(f"Checkpoint KV cache scales match no attention layer: {unknown[:4]}.")
    if cache_dtype == "auto":
        if scales:
            logger.info(
                "The checkpoint's KV cache scales are unused: the KV cache is not quantized."
            )
        return
    for block, found in scales.items():
        layers[f"{block}.attn"].set_kv_cache_scales(found.get("k", 1.0), found.get("v", 1.0))
    if scales:
        logger.info(
            "KV cache %s: k/v scales from the checkpoint for %d of %d attention layers "
            "(1.0 for the others)",
            cache_dtype,
            len(scales),
            len(layers),
        )
    else:
        logger.info(
            "KV cache %s: the checkpoint has no k/v scales; 1.0 for every layer (not calibrated)",
            cache_dtype,
        )
