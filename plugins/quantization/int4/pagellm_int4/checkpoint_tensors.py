"""A layer's tensors in each checkpoint format, to and from `Int4Values`: what the loader reads
after loading (`read_layer`), what the round-to-nearest writer writes (`write_layer`).

| format | tensors (N outputs, K inputs, G groups) |
|---|---|
| gptq | ``qweight`` int32 [K/8, N] (rows packed), ``qzeros`` int32 [G, N/8] (columns packed; v1: zero - 1), ``scales`` [G, N], ``g_idx`` int32 [K] |
| awq | ``qweight`` int32 [K, N/8], ``qzeros`` int32 [G, N/8], both columns packed in AWQ's order, ``scales`` [G, N] |
| compressed-tensors | ``weight_packed`` int32 [N, ceil(K/8)] (q + 8, columns packed), ``weight_scale`` [N, G], ``weight_zero_point`` int32 [ceil(N/8), G] (zero + 8, rows packed; asymmetric only), ``weight_shape`` [2], ``weight_g_idx`` [K] (act-order only) |
"""

from __future__ import annotations

import torch

from pagellm_int4.int4_values import Int4Values, sequential_g_idx
from pagellm_int4.packing import (
    AWQ_ORDER,
    pack_cols,
    pack_rows,
    unpack_cols,
    unpack_rows,
)
from pagellm_int4.scheme import Int4Scheme

CT_OFFSET = 8
"""compressed-tensors stores signed 4-bit values (-8..7) as unsigned nibbles, plus 8."""
SYMMETRIC_ZERO = 8


def read_layer(
    scheme: Int4Scheme,
    tensors: dict[str, torch.Tensor],
    in_features: int,
    out_features: int,
) -> Int4Values:
    """The layer's loaded tensors (local names) as values (``g_idx`` a single [K] row)."""
    k, n = in_features, out_features
    group = scheme.group_of(k)
    device = next(iter(tensors.values())).device
    if scheme.format == "gptq":
        zeros = unpack_cols(tensors["qzeros"], n)
        if scheme.gptq_v1:
            zeros = zeros + 1  # uint8: 15 + 1 is 16, as GPTQ v1 kernels read it
        return Int4Values(
            q=unpack_rows(tensors["qweight"], k),
            zeros=zeros,
            scales=tensors["scales"].float(),
            g_idx=tensors["g_idx"].long(),
        )
    if scheme.format == "awq":
        return Int4Values(
            q=unpack_cols(tensors["qweight"], n, AWQ_ORDER),
            zeros=unpack_cols(tensors["qzeros"], n, AWQ_ORDER),
            scales=tensors["scales"].float(),
            g_idx=sequential_g_idx(k, group, device),
        )
    scales = tensors["weight_scale"].float().t().contiguous()
    if scheme.sym:
        zeros = torch.full(scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8, device=device)
    else:
        # Both q and the zero carry the +8 offset, so the nibbles subtract as stored.
        zeros = unpack_rows(tensors["weight_zero_point"], n).t().contiguous()
    g_idx = tensors.get("weight_g_idx")
    return Int4Values(
        q=unpack_cols(tensors["weight_packed"], k).t().contiguous(),
        zeros=zeros,
        scales=scales,
        g_idx=g_idx.long() if g_idx is not None else sequential_g_idx(k, group, device),
    )


def write_layer(
    scheme: Int4Scheme, values: Int4Values, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The layer's tensors in ``scheme.format`` (local names, as the format stores them)."""
    scales = values.scales.to(scale_dtype)
    if scheme.format == "gptq":
        zeros = values.zeros.to(torch.int16)
        if scheme.gptq_v1:
            if bool((zeros == 0).any()):
                raise ValueError("A GPTQ v1 checkpoint cannot store a zero point of 0.")
            zeros = zeros - 1
        return {
            "qweight": pack_rows(values.q),
            "qzeros": pack_cols(zeros),
            "scales": scales,
            "g_idx": values.g_idx.to(torch.int32),
        }
    if scheme.format == "awq":
        return {
            "qweight": pack_cols(values.q, AWQ_ORDER),
            "qzeros": pack_cols(values.zeros, AWQ_ORDER),
            "scales": scales,
        }
    k, n = values.q.shape
    out = {
        "weight_packed": pack_cols(values.q.t()),
        "weight_scale": scales.t().contiguous(),
        "weight_shape": torch.tensor([n, k], device=values.q.device),
    }
    if not scheme.sym:
        out["weight_zero_point"] = pack_rows(values.zeros.t())
    if scheme.desc_act:
        out["weight_g_idx"] = values.g_idx.to(torch.int32)
    return out
