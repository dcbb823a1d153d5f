"""GGUF files split over two tensor-parallel ranks: the file's tensors read only in the part a
rank asks for (`GGUFTensor`), a rank of the dequantized-at-load model (the CPU's) holding its
slice of every weight and two gloo ranks decoding as one rank does, and the kept-quantized
method (the GPU's) getting each rank's rows of blocks or run of whole blocks, refusing inputs
that cut a block.

The kept-quantized kernels run on CUDA only: on the CPU its ranks are checked on what they load
and repack; `test_kept_quantized_rank_products_add_up_on_the_gpu` (``-m gpu``) runs their
products on one GPU, the ranks built one after the other in one process: one GPU cannot run an
NCCL group of two, so the collectives under NCCL are not covered here."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import random_blocks, write_tiny_gguf
from pagellm_gguf.block_types import block_shape
from pagellm_gguf.method import GGUFConfig
from pagellm_gguf.reader import gguf_tensors
from pagellm_gguf.tensor_slices import GGUFTensor

from pagellm import LLM, SamplingParams
from pagellm.layers.linear import Linear
from pagellm.layers.parallel_linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorParallelError,
)
from tensor_parallel import (
    as_rank,
    assert_same_greedy,
    greedy_record,
    linears,
    load_model_as_rank,
    rank_slice,
    run_ranks,
)

TYPES = {
    "attn_q": T.Q8_0,
    "attn_k": T.Q8_0,
    "attn_v": T.Q4_0,
    "attn_output": T.Q8_0,
    "ffn_gate": T.Q4_0,
    "ffn_up": T.Q4_1,
    "ffn_down": T.Q4_1,
}
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    head_dim=128,
)
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
PROMPTS = [[104, 101, 108, 108, 111], [32, 119, 200, 7, 77, 13, 250]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gguf_tp") / "qwen3.gguf"
    write_tiny_gguf("qwen3", str(path), TYPES, **TINY)
    return str(path)


def test_a_slice_of_a_file_tensor_reads_as_that_slice_of_the_whole(tmp_path):
    """A Llama file (q/k rows permuted within each head of 16 rows), Q4_1 q (blocks of 32)."""
    path = str(tmp_path / "llama.gguf")
    write_tiny_gguf("llama", path, {"attn_q": T.Q4_1}, **{**TINY, "head_dim": 16})
    q = dict(gguf_tensors(path, torch.float32))["model.layers.0.self_attn.q_proj.weight"]
    whole = q[:]
    assert whole.shape == (64, 64)
    for rows in (slice(16, 48), slice(5, 40)):  # whole heads; rows cutting heads
        assert torch.equal(q[rows], whole[rows])
    assert torch.equal(q[:, 8:40], whole[:, 8:40])  # inside two 32-weight blocks
    assert torch.equal(q[16:32, 32:64], whole[16:32, 32:64])
    assert torch.equal(q[...], whole)
    raw = dict(gguf_tensors(path, torch.float32, keep_quantized=True))
    blocks = raw["model.layers.0.self_attn.q_proj.weight"]
    assert blocks.gguf_type == int(T.Q4_1) and blocks.get_shape() == [64, 2 * 20]
    part = blocks[16:48, 20:40]  # output rows 16..47, input block 1 (20 bytes)
    assert part.gguf_type == int(T.Q4_1) and blocks[...].gguf_type == int(T.Q4_1)
    dense = gguf.quants.dequantize(part.numpy(), T.Q4_1)
    np.testing.assert_array_equal(dense, whole[16:48, 32:64].numpy())


def test_each_rank_of_a_dequantized_model_holds_its_slice_of_every_weight(qwen3_gguf):
    whole = linears(load_model_as_rank(qwen3_gguf, 0, 1, **ENGINE))
    for rank in (0, 1):
        for name, layer in linears(load_model_as_rank(qwen3_gguf, rank, 2, **ENGINE)).items():
            assert torch.equal(layer.weight, rank_slice(whole[name].weight, layer)), (name, rank)


def _generate(rank: int, path: str) -> dict:
    return greedy_record(LLM(path, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False))


def test_two_gloo_ranks_decode_a_gguf_file_as_one_rank(qwen3_gguf):
    by_rank = run_ranks(_generate, qwen3_gguf)
    one = _generate(0, qwen3_gguf)
    for rank in (0, 1):
        assert_same_greedy(by_rank[rank], one, 1e-5, rank)


def _raw(qtype: T, rows: int, cols: int, seed: int) -> GGUFTensor:
    """Random blocks as the reader yields them for the kept-quantized method."""
    data = random_blocks(qtype, rows, cols, seed=seed)
    return GGUFTensor(data, qtype, (rows, cols), torch.float32, raw=True, heads=None)


def _dense(tensor: GGUFTensor) -> torch.Tensor:
    blocks = tensor[:]
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), T(blocks.gguf_type)).copy())


def _kept_quantized_layers(
    rank: int, tp: int, device: str = "cpu"
) -> tuple[Linear, Linear, list[torch.Tensor]]:
    """gate_up (Q4_K, Q8_0 parts) and down (Q6_K) with every input of 512 and 256 whole blocks
    per rank, loaded as rank ``rank`` of ``tp`` and repacked; with the whole dense weights."""
    gate, up, down = _raw(T.Q4_K, 512, 256, 1), _raw(T.Q8_0, 512, 256, 2), _raw(T.Q6_K, 256, 512, 3)
    with as_rank(rank, tp), torch.device(device):
        merged = MergedColumnParallelLinear(256, [512, 512], quant_config=GGUFConfig())
        row = RowParallelLinear(512, 256, quant_config=GGUFConfig())
    for shard, part in enumerate((gate, up)):
        merged.load_checkpoint_tensor("weight", part, f"up_gate.{shard}", shard)
    row.load_checkpoint_tensor("weight", down, "down", None)
    parts = merged.linear_method.parts
    for shard, part in enumerate((gate, up)):  # the rank's rows of blocks
        assert torch.equal(parts[shard][1].cpu(), part[:][rank * 512 // tp :][: 512 // tp])
    qtype, blocks = row.linear_method.parts[0]
    assert qtype == int(T.Q6_K)
    dense = torch.from_numpy(gguf.quants.dequantize(blocks.cpu().numpy(), T.Q6_K).copy())
    assert torch.equal(dense, rank_slice(_dense(down), row))  # the rank's whole blocks
    for layer in (merged, row):
        layer.linear_method.process_weights_after_loading(layer)
    dense_gate_up = torch.cat([_dense(gate), _dense(up)])
    return merged, row, [dense_gate_up, _dense(down)]


def test_kept_quantized_ranks_load_their_rows_of_blocks_and_their_whole_blocks():
    for rank in (0, 1):
        merged, row, _ = _kept_quantized_layers(rank, 2)
        assert merged.linear_method.types == [int(T.Q4_K), int(T.Q8_0)]
        assert [s.in_features for s in row.linear_method.segments] == [256]
        assert [s.out_features for s in merged.linear_method.segments] == [256, 256]


def test_inputs_that_cut_a_block_are_refused_with_the_type_and_its_block():
    with as_rank(1, 2):
        row = RowParallelLinear(256, 64, quant_config=GGUFConfig())
    with pytest.raises(TensorParallelError) as refused:
        row.load_checkpoint_tensor("weight", _raw(T.Q4_K, 64, 256, 0), "blk.0.ffn_down", None)
    assert str(refused.value) == (
        "Checkpoint tensor 'blk.0.ffn_down' cannot be split over tensor_parallel_size 2: rank 1 "
        "holds input features [128, 256) of 256, which do not start and end on whole Q4_K "
        "blocks (256 features each); choose a tensor_parallel_size that splits them on those "
        "boundaries, or 1."
    )
    assert block_shape(T.Q4_K) == (256, 144)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kept_quantized_rank_products_add_up_on_the_gpu():
    """The ranks' products through the Triton kernels: column-parallel outputs are the rank's
    columns of the whole product, row-parallel partial products add up to it."""
    torch.manual_seed(0)
    x = torch.randn(5, 256, device="cuda")
    y = torch.randn(5, 512, device="cuda")
    column_parts, row_sum = [], torch.zeros(5, 256, device="cuda")
    for rank in (0, 1):
        merged, row, (gate_up, down) = _kept_quantized_layers(rank, 2, "cuda")
        column_parts.append(merged.linear_method.apply(merged, x).cpu())
        row_sum += row.linear_method.apply(row, y[:, 256 * rank : 256 * (rank + 1)])
    expected = (x.double().cpu() @ gate_up.double().t()).float()
    halves = [expected[:, i * 256 : (i + 1) * 256] for i in range(4)]  # gate r0, r1, up r0, r1
    ranked = torch.cat(
        [torch.cat([halves[0], halves[2]], 1), torch.cat([halves[1], halves[3]], 1)], 1
    )
    torch.testing.assert_close(torch.cat(column_parts, 1), ranked, rtol=1e-4, atol=1e-3)
    expected_down = (y.double().cpu() @ down.double().t()).float()
    torch.testing.assert_close(row_sum.cpu(), expected_down, rtol=1e-4, atol=1e-3)
