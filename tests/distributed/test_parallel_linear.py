"""The tensor-parallel linear layers against a plain ``nn.Linear`` holding the whole weight: two
real gloo ranks (spawned, TCP on 127.0.0.1), each loading its part of the full tensors."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pagellm.distributed import destroy_distributed, init_distributed
from pagellm.layers.linear import Linear
from pagellm.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelError,
    kv_heads_per_rank,
)
from pagellm.quantization import LinearMethodBase, QuantizationConfig
from pagellm.quantization.registry import quantization_methods

HIDDEN, HEAD, HEADS = 16, 4, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(in_features: int, out_features: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=True)


def _layers(rank: int, port: int, results: dict) -> None:
    init_distributed(
        world_size=2,
        rank=rank,
        tensor_parallel_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    torch.manual_seed(100)
    x = torch.randn(3, HIDDEN)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        ref = _reference(HIDDEN, 8, 0)
        col = ColumnParallelLinear(HIDDEN, 8, bias=True, gather_output=True)
        for name in ("weight", "bias"):
            col.load_checkpoint_tensor(name, getattr(ref, name), name, None)
        out["column_gathered"] = col(x)

        gate, up = _reference(HIDDEN, 6, 1), _reference(HIDDEN, 6, 2)
        merged = MergedColumnParallelLinear(HIDDEN, [6, 6], bias=True)
        for shard, part in enumerate((gate, up)):
            for name in ("weight", "bias"):
                merged.load_checkpoint_tensor(name, getattr(part, name), name, shard)
        out["merged_local"] = merged(x)

        # Four query heads, one KV head: both ranks hold KV head 0.
        q, k, v = (_reference(HIDDEN, n * HEAD, 3 + i) for i, n in enumerate((HEADS, 1, 1)))
        qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, 1, bias=True)
        for shard, part in enumerate((q, k, v)):
            for name in ("weight", "bias"):
                qkv.load_checkpoint_tensor(name, getattr(part, name), name, shard)
        out["qkv_local"] = qkv(x)
        out["qkv_heads"] = torch.tensor([qkv.num_heads, qkv.num_kv_heads])

        down = _reference(8, HIDDEN, 6)
        row = RowParallelLinear(8, HIDDEN, bias=True)
        for name in ("weight", "bias"):
            row.load_checkpoint_tensor(name, getattr(down, name), name, None)
        rank_input = x[:, :8].narrow(-1, rank * 4, 4)  # the rank's slice of the 8 inputs
        out["row_reduced"] = row(rank_input)

        # fp8 quantized online, after loading: a rank's rows get the scales the whole layer's get.
        fp8 = quantization_methods.get("fp8_per_channel").from_config({})
        whole = Linear(HIDDEN, 8, quant_config=fp8, output_sizes=[4, 4])
        split = MergedColumnParallelLinear(HIDDEN, [4, 4], quant_config=fp8)
        for layer in (whole, split):
            for shard in (0, 1):
                layer.load_checkpoint_tensor("weight", ref.weight[shard * 4 :][:4], "w", shard)
            layer.linear_method.process_weights_after_loading(layer)
        mine = [rank * 2, rank * 2 + 1, 4 + rank * 2, 5 + rank * 2]
        for name in ("weight", "weight_scale"):
            out[f"fp8_{name}"] = split.get_parameter(name).float()
            out[f"fp8_whole_{name}"] = whole.get_parameter(name).float()[mine]
    destroy_distributed()
    results[rank] = out


@pytest.fixture(scope="module")
def rank_outputs() -> dict[int, dict[str, torch.Tensor]]:
    port = _free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_layers, args=(port, results), nprocs=2, join=True)
        return dict(results)


def _x() -> torch.Tensor:
    torch.manual_seed(100)
    return torch.randn(3, HIDDEN)


def test_column_parallel_gathered_output_equals_the_whole_linear(rank_outputs):
    expected = _reference(HIDDEN, 8, 0)(_x()).detach()
    for rank in (0, 1):
        torch.testing.assert_close(rank_outputs[rank]["column_gathered"], expected)


def test_merged_column_parallel_rank_holds_its_slice_of_gate_and_of_up(rank_outputs):
    gate = _reference(HIDDEN, 6, 1)(_x()).detach()
    up = _reference(HIDDEN, 6, 2)(_x()).detach()
    for rank in (0, 1):
        rows = slice(rank * 3, rank * 3 + 3)
        expected = torch.cat([gate[:, rows], up[:, rows]], dim=-1)
        torch.testing.assert_close(rank_outputs[rank]["merged_local"], expected)


def test_qkv_splits_query_heads_and_replicates_the_single_kv_head(rank_outputs):
    x = _x()
    q, k, v = (_reference(HIDDEN, n * HEAD, 3 + i)(x).detach() for i, n in enumerate((HEADS, 1, 1)))
    for rank in (0, 1):
        half = HEADS // 2 * HEAD
        expected = torch.cat([q[:, rank * half : (rank + 1) * half], k, v], dim=-1)
        torch.testing.assert_close(rank_outputs[rank]["qkv_local"], expected)
        assert rank_outputs[rank]["qkv_heads"].tolist() == [2, 1]


def test_row_parallel_sums_partial_outputs_and_adds_the_bias_once(rank_outputs):
    expected = _reference(8, HIDDEN, 6)(_x()[:, :8]).detach()
    for rank in (0, 1):
        torch.testing.assert_close(rank_outputs[rank]["row_reduced"], expected)


def test_fp8_online_quantization_of_a_rank_slice_equals_that_slice_of_the_whole_layer(
    rank_outputs,
):
    for rank in (0, 1):
        for name in ("weight", "weight_scale"):
            out = rank_outputs[rank]
            torch.testing.assert_close(out[f"fp8_{name}"], out[f"fp8_whole_{name}"], rtol=0, atol=0)


def test_kv_heads_are_shared_or_replicated_and_uneven_layouts_are_refused():
    assert kv_heads_per_rank(8, 2) == 4
    assert kv_heads_per_rank(2, 4) == 1
    with pytest.raises(TensorParallelError, match="does not divide tensor_parallel_size 4"):
        kv_heads_per_rank(3, 4)
    with pytest.raises(TensorParallelError, match="not divisible by tensor_parallel_size 4"):
        kv_heads_per_rank(6, 4)


@pytest.mark.parametrize(
    ("method", "checkpoint"),
    [
        ("gguf", {}),
        ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128}),
        ("awq", {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}),
        ("fp8", {}),
        ("fp8", {"quant_method": "fp8", "activation_scheme": "static"}),
    ],
)
def test_first_party_quantization_methods_accept_tensor_parallelism(method, checkpoint):
    if method not in quantization_methods.names():
        pytest.skip(f"{method} is not installed")
    assert quantization_methods.get(method).tensor_parallel_refusal(2, checkpoint) is None


def test_a_quantization_method_refuses_tensor_parallelism_unless_it_says_it_splits():
    class Packed(QuantizationConfig):
        name = "packed"

        @classmethod
        def from_config(cls, config: dict) -> QuantizationConfig:
            return cls()

        def get_linear_method(self, prefix: str) -> LinearMethodBase:
            raise NotImplementedError

    assert Packed.tensor_parallel_refusal(2, {}) == (
        "quantization packed does not support tensor_parallel_size 2 yet; use "
        "tensor_parallel_size 1 or a float checkpoint."
    )
