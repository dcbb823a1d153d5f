"""The shard hook (`LinearMethodBase.checkpoint_split`): each rank's layer reads the part of each
checkpoint tensor its linear method points to, lazy safetensors slices included, and a range
that would cut a packing unit is refused. Ranks are built one after the other in this process
(`tensor_parallel.as_rank`): loading uses no collective."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pagellm.layers.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelError,
)
from pagellm.quantization import LayerSplit, LinearMethodBase, QuantizationConfig, TensorSplit
from tensor_parallel import as_rank, linears, load_model_as_rank, rank_slice

ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)


class _FourRowsAWord(LinearMethodBase):
    """A toy packed method: ``packed`` [N/4, K] holds four output rows an entry, ``scale`` [1]
    one value for the layer."""

    def create_weights(self, layer, in_features, out_features, bias, params_dtype) -> None:
        packed = torch.zeros(out_features // 4, in_features)
        layer.register_parameter("packed", nn.Parameter(packed, requires_grad=False))
        layer.register_parameter("scale", nn.Parameter(torch.zeros(1), requires_grad=False))
        layer.register_parameter("bias", None)

    def checkpoint_split(
        self, param_name: str, tensor: Any, split: LayerSplit
    ) -> TensorSplit | None:
        if param_name == "packed":
            if split.parallel == "column":
                return TensorSplit(0, 4, unit="packed row")
            return TensorSplit(1)
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("loading only")


class _FourRowsConfig(QuantizationConfig):
    name = "four_rows"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        return cls()

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        return _FourRowsAWord()


def test_each_rank_reads_the_entries_its_method_points_to_and_whole_tensors_whole():
    packed = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)  # 16 outputs, 8 inputs
    for rank in (0, 1):
        with as_rank(rank, 2):
            column = ColumnParallelLinear(8, 16, quant_config=_FourRowsConfig())
            row = RowParallelLinear(8, 16, quant_config=_FourRowsConfig())
        for layer in (column, row):
            layer.load_checkpoint_tensor("packed", packed, "packed", None)
            layer.load_checkpoint_tensor("scale", torch.tensor([3.0]), "scale", None)
            assert layer.get_parameter("scale").item() == 3.0
        assert torch.equal(column.get_parameter("packed"), packed[2 * rank : 2 * rank + 2])
        assert torch.equal(row.get_parameter("packed"), packed[:, 4 * rank : 4 * rank + 4])
        assert column.tp_split == LayerSplit("column", 2, rank, 8, (16,))


def test_a_range_that_cuts_a_packing_unit_is_refused_with_the_rank_and_the_unit():
    with as_rank(1, 2):
        layer = ColumnParallelLinear(8, 20, quant_config=_FourRowsConfig())  # 10 rows a rank
    with pytest.raises(TensorParallelError) as refused:
        layer.load_checkpoint_tensor("packed", torch.zeros(5, 8), "l.packed", None)
    assert str(refused.value) == (
        "Checkpoint tensor 'l.packed' cannot be split over tensor_parallel_size 2: rank 1 holds "
        "output features [10, 20) of 20, which do not start and end on whole packed rows (4 "
        "features each); choose a tensor_parallel_size that splits them on those boundaries, "
        "or 1."
    )
    with as_rank(0, 2):
        layer = ColumnParallelLinear(8, 16, quant_config=_FourRowsConfig())
    with pytest.raises(ValueError, match=r"should have 4 entries there for 16 output features"):
        layer.load_checkpoint_tensor("packed", torch.zeros(5, 8), "l.packed", None)


@pytest.mark.parametrize("kind", ["qwen2", "llama3_one_kv_head"])
def test_each_rank_of_a_float_model_loads_its_slice_of_every_linear_weight(
    kind, tiny_models, tiny_one_kv_head_models
):
    """Lazy safetensors slices through the default hook: q/k/v biases (qwen2), one KV head
    replicated on both ranks (llama3)."""
    path = tiny_one_kv_head_models["llama3"] if kind.endswith("kv_head") else tiny_models[kind]
    whole = linears(load_model_as_rank(path, 0, 1, **ENGINE))
    for rank in (0, 1):
        for name, layer in linears(load_model_as_rank(path, rank, 2, **ENGINE)).items():
            full = whole[name]
            assert torch.equal(layer.weight, rank_slice(full.weight, layer)), (name, rank)
            if layer.bias is None:
                continue
            if layer.tp_split.parallel == "column":
                expected = rank_slice(full.bias[:, None], layer)[:, 0]
            else:  # the first rank adds the bias, the others zeros
                expected = full.bias if rank == 0 else torch.zeros_like(full.bias)
            assert torch.equal(layer.bias, expected), (name, rank)
