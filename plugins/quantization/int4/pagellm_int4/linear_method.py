"""`Int4LinearMethod`: a linear layer's 4-bit weight under the checkpoint's own tensor names
(`create_weights`, loaded part by part into fused layers), repacked once loaded into the kernel
layout (`kernel_layout`), and its forward through the GEMM `gemm.choose_gemm` picks.

After `process_weights_after_loading` a layer holds, whatever the format: ``qweight`` int32
[ceil(K/8), N], ``scales`` float32 [G, N], ``zeros`` uint8 [G, N], ``perm`` int64 [K] (act-order
checkpoints) or None, and ``bias``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pagellm.quantization import LinearMethodBase
from pagellm.quantization.layers import frozen_parameter
from pagellm_int4.checkpoint_tensors import read_layer
from pagellm_int4.gemm import GemmFn, choose_gemm
from pagellm_int4.kernel_layout import KernelLayout, to_kernel_layout
from pagellm_int4.scheme import PACK, Int4Scheme


@dataclass(frozen=True)
class _TensorSpec:
    """One checkpoint tensor of a layer: its shape for the whole (fused) layer, and how fused
    parts stack in it: along ``n_dim`` with ``n_per_entry`` outputs an entry (8 when the outputs
    are packed), or one row per part (``n_dim`` None: ``g_idx``, ``weight_shape``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    n_dim: int | None
    n_per_entry: int = 1


def _specs(scheme: Int4Scheme, k: int, n: int, parts: int) -> dict[str, _TensorSpec]:
    g = scheme.groups(k)
    i32, f32 = torch.int32, torch.float32
    if scheme.format == "gptq":
        return {
            "qweight": _TensorSpec((k // PACK, n), i32, 1),
            "qzeros": _TensorSpec((g, n // PACK), i32, 1, PACK),
            "scales": _TensorSpec((g, n), f32, 1),
            "g_idx": _TensorSpec((parts, k), i32, None),
        }
    if scheme.format == "awq":
        return {
            "qweight": _TensorSpec((k, n // PACK), i32, 1, PACK),
            "qzeros": _TensorSpec((g, n // PACK), i32, 1, PACK),
            "scales": _TensorSpec((g, n), f32, 1),
        }
    specs = {
        "weight_packed": _TensorSpec((n, -(-k // PACK)), i32, 0),
        "weight_scale": _TensorSpec((n, g), f32, 0),
        "weight_shape": _TensorSpec((parts, 2), torch.int64, None),
    }
    if not scheme.sym:
        specs["weight_zero_point"] = _TensorSpec((n // PACK, g), i32, 0, PACK)
    if scheme.desc_act:
        specs["weight_g_idx"] = _TensorSpec((parts, k), i32, None)
    return specs


def _load_part(
    spec: _TensorSpec,
    sizes: list[int],
    name: str,
    param: nn.Parameter,
    tensor: torch.Tensor,
    shard: int | None,
) -> None:
    """The checkpoint tensor of fused part ``shard`` (the whole layer when unfused) into its place."""
    dst = param.data
    if spec.n_dim is None:
        dst = dst[shard or 0]
    elif shard is not None:
        start = sum(sizes[:shard]) // spec.n_per_entry
        dst = dst.narrow(spec.n_dim, start, sizes[shard] // spec.n_per_entry)
    if dst.shape != tensor.shape:
        raise ValueError(
            f"Checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}."
        )
    dst.copy_(tensor)


class Int4LinearMethod(LinearMethodBase):
    def __init__(self, scheme: Int4Scheme, prefix: str) -> None:
        self.scheme = scheme
        self.prefix = prefix
        self.gemm_path = "unset"  # the chosen path's name, once the weights are processed
        self._gemm: GemmFn | None = None
        self._layout: KernelLayout | None = None
        self._specs: dict[str, _TensorSpec] = {}
        self._in_features = 0

    def _check_shape(self, in_features: int, sizes: list[int]) -> None:
        scheme = self.scheme
        if scheme.group_size != -1 and in_features % scheme.group_size:
            raise ValueError(
                f"{self.prefix}: {scheme.format} group_size {scheme.group_size} does not divide "
                f"the layer's {in_features} input features."
            )
        if scheme.format == "gptq" and in_features % PACK:
            raise ValueError(
                f"{self.prefix}: GPTQ packs 8 input features a word; {in_features} is not a "
                "multiple of 8."
            )
        packs_outputs = scheme.format == "awq" or scheme.format == "gptq" or not scheme.sym
        if packs_outputs and any(s % PACK for s in sizes):
            raise ValueError(
                f"{self.prefix}: {scheme.format} packs 8 output features a word (zero points"
                f"{' and weights' if scheme.format == 'awq' else ''}); the layer's parts have "
                f"{sizes} outputs, not all multiples of 8."
            )

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        sizes: list[int] = list(getattr(layer, "output_sizes", None) or [out_features])
        self._check_shape(in_features, sizes)
        self._in_features = in_features
        self._specs = _specs(self.scheme, in_features, out_features, len(sizes))
        for name, spec in self._specs.items():
            data = torch.zeros(spec.shape, dtype=spec.dtype)
            loader = partial(_load_part, spec, sizes, f"{self.prefix}.{name}")
            layer.register_parameter(name, frozen_parameter(data, loader))
        bias_param = (
            frozen_parameter(torch.empty(out_features, dtype=params_dtype)) if bias else None
        )
        layer.register_parameter("bias", bias_param)

    def _one_row(self, layer: nn.Module, name: str) -> torch.Tensor:
        """A per-part tensor (``g_idx``) that every fused part must share."""
        rows = layer.get_parameter(name).data
        if not bool((rows == rows[0]).all()):
            raise ValueError(
                f"{self.prefix}: the fused parts have different {name} (act orders); pagellm-int4 "
                "permutes one fused layer's inputs once, so its parts must share one order."
            )
        return rows[0]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        sizes = list(layer.output_sizes)  # type: ignore[arg-type]
        n = sum(sizes)
        k = self._in_features
        tensors = {name: layer.get_parameter(name).data for name in self._specs}
        if "weight_shape" in tensors:
            self._check_ct_shapes(tensors["weight_shape"], sizes)
        for name in ("g_idx", "weight_g_idx"):
            if name in tensors:
                tensors[name] = self._one_row(layer, name)
        values = read_layer(self.scheme, tensors, k, n)
        layout = to_kernel_layout(values, self.scheme.group_of(k), self.prefix)
        for name in self._specs:
            delattr(layer, name)
        layer.register_parameter("qweight", frozen_parameter(layout.qweight))
        layer.register_parameter("scales", frozen_parameter(layout.scales))
        layer.register_parameter("zeros", frozen_parameter(layout.zeros))
        layer.register_parameter(
            "perm", frozen_parameter(layout.perm) if layout.perm is not None else None
        )
        self._layout = layout
        self.gemm_path, self._gemm = choose_gemm(layout.qweight.device)

    def _check_ct_shapes(self, shapes: torch.Tensor, sizes: list[int]) -> None:
        expected = [[size, self._in_features] for size in sizes]
        if shapes.tolist() != expected:
            raise ValueError(
                f"{self.prefix}: compressed-tensors weight_shape {shapes.tolist()} does not match "
                f"the layer's parts {expected}."
            )

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._gemm is None or self._layout is None:
            raise RuntimeError(f"{self.prefix}: int4 weights used before they were processed.")
        shape = x.shape
        out = self._gemm(x.reshape(-1, shape[-1]), self._layout)
        bias = layer.bias
        if isinstance(bias, torch.Tensor):
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])
