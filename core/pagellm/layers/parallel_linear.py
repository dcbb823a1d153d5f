"""Tensor-parallel linear layers: each rank of the tensor-parallel group holds one slice of the
weight, and loads only that slice of the full checkpoint tensor (`rank_part`).

- `ColumnParallelLinear` splits the output features: rank r computes its slice of the output
  (gathered on request). `MergedColumnParallelLinear` (gate/up) and `QKVParallelLinear` split each
  fused part on its own, so a rank's slice of the fused output is [its gate | its up].
- `RowParallelLinear` splits the input features (the column-parallel layer's output slice feeds
  it as is) and sums the partial outputs over the group with one all-reduce.

Where each checkpoint tensor is cut is the linear method's to say (its shard hook,
`LinearMethodBase.checkpoint_split`: float weights along their rows or columns, a packed or
grouped tensor by whole words, groups or blocks, a per-tensor scale whole); the layer knows the
rank's range of features and reads only the matching entries (`_cut`), refusing a range that
would cut a packing word, a quantization group or a block. With one rank every layer is the
plain `Linear`: nothing is split and nothing is reduced.
"""

from __future__ import annotations

import torch

from pagellm.distributed import get_tp_group
from pagellm.layers.linear import CheckpointTensor, Linear, checkpoint_shape, materialize
from pagellm.quantization.base import (
    LayerSplit,
    ParallelKind,
    QuantizationConfig,
    QuantizedActivation,
)


class TensorParallelError(ValueError):
    """A model's shapes cannot be split over the tensor-parallel group."""


def _split(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise TensorParallelError(
            f"{what} {size} is not divisible by tensor_parallel_size {tp}; choose a "
            "tensor_parallel_size that divides it."
        )
    return size // tp


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """The KV heads each rank holds: its share, or one replicated head when there are fewer KV
    heads than ranks (the head its query heads attend with)."""
    if num_kv_heads >= tp:
        return _split(num_kv_heads, tp, "num_key_value_heads")
    if tp % num_kv_heads:
        raise TensorParallelError(
            f"num_key_value_heads {num_kv_heads} does not divide tensor_parallel_size {tp}, so "
            "ranks cannot share the KV heads evenly; choose a tensor_parallel_size that is a "
            "multiple or a divisor of it."
        )
    return 1


def _layer_split(
    parallel: ParallelKind, in_features: int, output_sizes: list[int]
) -> LayerSplit | None:
    tp = get_tp_group()
    if tp.world_size == 1:
        return None
    return LayerSplit(parallel, tp.world_size, tp.rank_in_group, in_features, tuple(output_sizes))


def _cut(
    layer: Linear,
    param_name: str,
    tensor: CheckpointTensor,
    name: str,
    features: tuple[int, int, int],
    what: str,
) -> torch.Tensor:
    """This rank's entries of checkpoint tensor ``name``, where the layer's linear method says
    they lie for the rank's ``features`` = (first, count, of the whole's) of ``what``."""
    split = layer.tp_split
    hook = layer.linear_method.checkpoint_split(param_name, tensor, split) if split else None
    if split is None or hook is None:
        return materialize(tensor)
    start, count, full = features
    if start % hook.features or count % hook.features:
        raise TensorParallelError(
            f"Checkpoint tensor {name!r} cannot be split over tensor_parallel_size "
            f"{split.tp_size}: rank {split.rank} holds {what} [{start}, {start + count}) of "
            f"{full}, which do not start and end on whole {hook.unit}s ({hook.features} "
            "features each); choose a tensor_parallel_size that splits them on those "
            "boundaries, or 1."
        )
    shape = checkpoint_shape(tensor)
    expected = full // hook.features * hook.entries
    if hook.dim >= len(shape) or shape[hook.dim] != expected:
        raise ValueError(
            f"Checkpoint tensor {name!r} has shape {shape}; split along dimension {hook.dim} "
            f"it should have {expected} entries there for {full} {what}."
        )
    first = start // hook.features * hook.entries
    index = (slice(None),) * hook.dim + (
        slice(first, first + count // hook.features * hook.entries),
    )
    return tensor[index]


class ColumnParallelLinear(Linear):
    """``out_features`` split over the ranks, each fused part (``output_sizes``) on its own; with
    ``gather_output`` every rank gets the whole output (an all-gather), else its slice."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        output_sizes: list[int] | None = None,
        gather_output: bool = False,
    ) -> None:
        self.tp = get_tp_group()
        self.full_output_sizes = output_sizes or [out_features]
        # This rank's rows of each part, and where they start in the checkpoint's tensor of it.
        local_sizes, self.part_starts = self._rank_rows(prefix)
        self.gather_output = gather_output
        super().__init__(
            in_features,
            sum(local_sizes),
            bias,
            quant_config,
            prefix,
            output_sizes=local_sizes,
            tp_split=_layer_split("column", in_features, self.full_output_sizes),
        )

    def _rank_rows(self, prefix: str) -> tuple[list[int], list[int]]:
        tp, rank = self.tp.world_size, self.tp.rank_in_group
        sizes = [_split(s, tp, f"{prefix} output size") for s in self.full_output_sizes]
        return sizes, [rank * s for s in sizes]

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        out = self.matmul(x)
        if not self.gather_output or self.tp.world_size == 1:
            return out
        if len(self.output_sizes) == 1:
            return self.tp.all_gather(out, dim=-1)
        # [r0's parts | r1's parts] -> [part 0 of every rank | part 1 of every rank | ...]
        ranks = self.tp.all_gather(out, dim=-1).split(out.shape[-1], dim=-1)
        pieces = [r.split(self.output_sizes, dim=-1) for r in ranks]
        return torch.cat([p[i] for i in range(len(self.output_sizes)) for p in pieces], dim=-1)

    def rank_part(
        self, param_name: str, tensor: CheckpointTensor, name: str, shard: int | None
    ) -> torch.Tensor:
        part = shard or 0
        rows = (self.part_starts[part], self.output_sizes[part], self.full_output_sizes[part])
        what = "output features" if shard is None else f"output features of part {shard}"
        return _cut(self, param_name, tensor, name, rows, what)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Fused column-parallel parts of one input (gate and up of the MLP), split part by part."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(
            in_features, sum(output_sizes), bias, quant_config, prefix, output_sizes=output_sizes
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v: each rank gets ``num_heads / tp`` query heads and their KV heads. With fewer
    KV heads than ranks, each KV head is replicated on the ``tp / num_kv_heads`` consecutive
    ranks whose query heads use it (query head h attends with KV head h // (heads / kv_heads))."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        self.head_size = head_size
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        super().__init__(
            hidden_size,
            q_size + 2 * kv_size,
            bias,
            quant_config,
            prefix,
            output_sizes=[q_size, kv_size, kv_size],
        )
        # This rank's heads.
        self.num_heads = self.output_sizes[0] // head_size
        self.num_kv_heads = self.output_sizes[1] // head_size

    def _rank_rows(self, prefix: str) -> tuple[list[int], list[int]]:
        tp, rank = self.tp.world_size, self.tp.rank_in_group
        q_size = _split(self.total_num_heads, tp, f"{prefix} num_attention_heads") * self.head_size
        kv_heads = kv_heads_per_rank(self.total_num_kv_heads, tp)
        if self.total_num_kv_heads >= tp:
            first_kv = rank * kv_heads
        else:  # replicated: ranks [i * tp / kv_heads, (i + 1) * tp / kv_heads) hold KV head i
            first_kv = rank // (tp // self.total_num_kv_heads)
        kv_size = kv_heads * self.head_size
        kv_start = first_kv * self.head_size
        return [q_size, kv_size, kv_size], [rank * q_size, kv_start, kv_start]


class RowParallelLinear(Linear):
    """``in_features`` split over the ranks (each takes its slice of the input, as the
    column-parallel layer before it left it) and the partial outputs summed with one
    all-reduce. The bias is loaded on the first rank only (zeros elsewhere), so the sum holds
    it exactly once and any linear method's own bias handling stays right."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        self.tp = get_tp_group()
        self.full_in_features = in_features
        local_in = _split(in_features, self.tp.world_size, f"{prefix} input size")
        self.input_start = self.tp.rank_in_group * local_in
        self.local_in_features = local_in
        super().__init__(
            local_in,
            out_features,
            bias,
            quant_config,
            prefix,
            tp_split=_layer_split("row", in_features, [out_features]),
        )

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.tp.all_reduce(self.matmul(x))

    def rank_part(
        self, param_name: str, tensor: CheckpointTensor, name: str, shard: int | None
    ) -> torch.Tensor:
        columns = (self.input_start, self.local_in_features, self.full_in_features)
        return _cut(self, param_name, tensor, name, columns, "input features")

    def load_checkpoint_tensor(
        self, param_name: str, tensor: CheckpointTensor, name: str, shard: int | None
    ) -> None:
        if param_name == "bias" and not self.tp.is_first_rank:
            self.get_parameter("bias").data.zero_()
            return
        super().load_checkpoint_tensor(param_name, tensor, name, shard)
