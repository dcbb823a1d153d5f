"""`Int4LinearMethod`: a linear layer's 4-bit weight under the checkpoint's own tensor names
(`create_weights`, loaded part by part into fused layers), repacked once loaded into the layout
of the GEMM `gemm.choose_gemm` picks for the device (`kernel_layout` for the reference and
Triton paths, `fragment_layout` for the CUDA kernels), and its forward through that GEMM.

After `process_weights_after_loading` a layer holds, whatever the format: ``qweight`` (int32
words of 8 codes), ``scales`` float32, ``zeros`` uint8, ``perm`` int64 [K] (act-order
checkpoints) or None, and ``bias``; the shapes are the layout's."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pagellm.layers.linear import CheckpointTensor
from pagellm.layers.parallel_linear import TensorParallelError
from pagellm.quantization import LayerSplit, LinearMethodBase, TensorSplit
from pagellm.quantization.layers import frozen_parameter
from pagellm_int4.checkpoint_tensors import read_layer
from pagellm_int4.gemm import GemmFn, Layout, choose_gemm
from pagellm_int4.rank_groups import rank_groups
from pagellm_int4.scheme import PACK, Int4Scheme

_WORD = "packed int32 word"
_GROUP = "quantization group"


@dataclass(frozen=True)
class _TensorSpec:
    """One checkpoint tensor of a layer: its shape for the whole (fused) layer, and how fused
    parts stack in it: along ``n_dim`` with ``n_per_entry`` outputs an entry (8 when the outputs
    are packed), or one row per part (``n_dim`` None: ``g_idx``, ``weight_shape``). A
    row-parallel rank reads it along the checkpoint tensor's ``k_dim``, ``k_per_entry`` inputs
    an entry (8 packed, or a quantization group: ``k_unit``), or whole (``k_dim`` None)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    n_dim: int | None
    n_per_entry: int = 1
    k_dim: int | None = None
    k_per_entry: int = 1
    k_unit: str = "feature"

    def split(self, parallel: str) -> TensorSplit | None:
        if parallel == "column":
            if self.n_dim is None:
                return None
            unit = _WORD if self.n_per_entry > 1 else "feature"
            return TensorSplit(self.n_dim, self.n_per_entry, unit=unit)
        if self.k_dim is None:
            return None
        return TensorSplit(self.k_dim, self.k_per_entry, unit=self.k_unit)


def _specs(
    scheme: Int4Scheme, k: int, n: int, parts: int, g: int, group_dim: bool
) -> dict[str, _TensorSpec]:
    """The layer's tensors (``g`` groups); ``group_dim``: a row-parallel rank reads the groups
    of its inputs (False: every group, when there is one or act-order scatters them)."""
    i32, f32 = torch.int32, torch.float32

    def grouped(shape: tuple[int, int], dtype: torch.dtype, n_dim: int, per: int, k_dim: int):
        """Scales or zeros: their group dimension ``k_dim`` cut by whole groups."""
        cut = k_dim if group_dim else None
        return _TensorSpec(shape, dtype, n_dim, per, cut, scheme.group_size, _GROUP)

    if scheme.format == "gptq":
        return {
            "qweight": _TensorSpec((k // PACK, n), i32, 1, 1, 0, PACK, _WORD),
            "qzeros": grouped((g, n // PACK), i32, 1, PACK, 0),
            "scales": grouped((g, n), f32, 1, 1, 0),
            "g_idx": _TensorSpec((parts, k), i32, None, k_dim=0),
        }
    if scheme.format == "awq":
        return {
            "qweight": _TensorSpec((k, n // PACK), i32, 1, PACK, 0),
            "qzeros": grouped((g, n // PACK), i32, 1, PACK, 0),
            "scales": grouped((g, n), f32, 1, 1, 0),
        }
    specs = {
        "weight_packed": _TensorSpec((n, -(-k // PACK)), i32, 0, 1, 1, PACK, _WORD),
        "weight_scale": grouped((n, g), f32, 0, 1, 1),
        "weight_shape": _TensorSpec((parts, 2), torch.int64, None),
    }
    if not scheme.sym:
        specs["weight_zero_point"] = grouped((n // PACK, g), i32, 0, PACK, 1)
    if scheme.desc_act:
        specs["weight_g_idx"] = _TensorSpec((parts, k), i32, None, k_dim=0)
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
        self._layout: Layout | None = None
        self._specs: dict[str, _TensorSpec] = {}
        self._in_features = 0
        self._split: LayerSplit | None = None

    def _shape_problem(self, in_features: int, sizes: list[int] | tuple[int, ...]) -> str | None:
        scheme = self.scheme
        if scheme.group_size != -1 and in_features % scheme.group_size:
            return (
                f"{scheme.format} group_size {scheme.group_size} does not divide the layer's "
                f"{in_features} input features"
            )
        if scheme.format == "gptq" and in_features % PACK:
            return f"GPTQ packs 8 input features a word; {in_features} is not a multiple of 8"
        packs_outputs = scheme.format == "awq" or scheme.format == "gptq" or not scheme.sym
        if packs_outputs and any(s % PACK for s in sizes):
            return (
                f"{scheme.format} packs 8 output features a word (zero points"
                f"{' and weights' if scheme.format == 'awq' else ''}); the layer's parts have "
                f"{list(sizes)} outputs, not all multiples of 8"
            )
        return None

    def _check_shape(self, in_features: int, sizes: list[int], split: LayerSplit | None) -> None:
        problem = self._shape_problem(in_features, sizes)
        if problem is None:
            return
        if split is not None and (
            self._shape_problem(split.full_in_features, split.full_output_sizes) is None
        ):
            raise TensorParallelError(
                f"{self.prefix}: split over tensor_parallel_size {split.tp_size}, rank "
                f"{split.rank}'s part of the layer cuts its packed words or groups: {problem}; "
                "choose a tensor_parallel_size that leaves every rank whole groups and words."
            )
        raise ValueError(f"{self.prefix}: {problem}.")

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        sizes: list[int] = list(getattr(layer, "output_sizes", None) or [out_features])
        split: LayerSplit | None = getattr(layer, "tp_split", None)
        self._check_shape(in_features, sizes, split)
        self._in_features = in_features
        self._split = split
        scheme = self.scheme
        row = split is not None and split.parallel == "row"
        # Act-order scatters each group over the inputs: a row-parallel rank reads every group.
        whole_groups = scheme.group_size == -1 or (row and scheme.desc_act)
        k_groups = (
            split.full_in_features if split is not None and row and whole_groups else in_features
        )
        groups = scheme.groups(k_groups)
        self._specs = _specs(
            scheme, in_features, out_features, len(sizes), groups, not whole_groups
        )
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
        split = self._split
        if (
            split is not None
            and split.parallel == "row"
            and ("g_idx" in tensors or "weight_g_idx" in tensors)
        ):
            # The rank's g_idx names the checkpoint's groups: renumber them to those it holds.
            values = rank_groups(values, self.scheme.group_of(k), split, self.prefix)
        group_size = self.scheme.group_of(k)
        gemm = choose_gemm(values.q.device, k, group_size)
        layout = gemm.make_layout(values, group_size, self.prefix)
        for name in self._specs:
            delattr(layer, name)
        layer.register_parameter("qweight", frozen_parameter(layout.qweight))
        layer.register_parameter("scales", frozen_parameter(layout.scales))
        layer.register_parameter("zeros", frozen_parameter(layout.zeros))
        layer.register_parameter(
            "perm", frozen_parameter(layout.perm) if layout.perm is not None else None
        )
        self._layout = layout
        self.gemm_path, self._gemm = gemm.name, gemm.run

    def checkpoint_split(
        self, param_name: str, tensor: CheckpointTensor, split: LayerSplit
    ) -> TensorSplit | None:
        spec = self._specs.get(param_name)
        if spec is None:
            return super().checkpoint_split(param_name, tensor, split)  # bias
        return spec.split(split.parallel)

    def _check_ct_shapes(self, shapes: torch.Tensor, sizes: list[int]) -> None:
        # The checkpoint states the whole layer's shape, whatever part a rank reads.
        split = self._split
        full = (split.full_in_features, split.full_output_sizes) if split else None
        k, parts = full if full else (self._in_features, tuple(sizes))
        expected = [[size, k] for size in parts]
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
