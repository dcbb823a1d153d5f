"""fp8 checkpoints split over two tensor-parallel ranks on the CPU: each rank's float8 weights and
scales (per tensor, per channel, 128x128 blocks; per-part scales of fused layers; static input
scales) are its slice of the one-rank model's, and two gloo ranks decode as one rank does.

The ranks of the slice checks are built one after the other in this process
(`tensor_parallel.as_rank`); the decoding runs two spawned processes. Activations quantized per
token or per tensor at run time (FP8_DYNAMIC) get a scale from each rank's slice of the input in
a row-parallel layer, so that scheme is not compared token for token: static scales and 128-wide
groups (blocks) are the same on every rank as on one."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import compressed_tensors_checkpoint, fp8_config_checkpoint, tiny_llama
from pagellm_fp8.quant_ops import dequantize_weight

from pagellm import LLM, SamplingParams
from pagellm.engine.args import EngineArgs
from pagellm.layers.parallel_linear import QKVParallelLinear, TensorParallelError
from pagellm.quantization.registry import quantization_methods
from tensor_parallel import (
    as_rank,
    assert_same_greedy,
    greedy_record,
    linears,
    load_model_as_rank,
    rank_product_errors,
    rank_slice,
    run_ranks,
)

ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory=8 << 20, seed=0)
PROMPTS = [[5, 6, 7, 8, 9], [700, 3, 18, 19, 20, 21]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
DECODED = ("ct_fp8", "fp8_config_block")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    """Heads of 128: each rank's k and v rows (one head of two) are whole 128-row blocks."""
    root = tmp_path_factory.mktemp("fp8_tp")
    float_model = tiny_llama(root / "float", smollm2_tokenizer_dir, head_dim=128)
    paths = {
        "ct_fp8": compressed_tensors_checkpoint(float_model, root / "ct_fp8", "FP8"),
        "ct_fp8_dynamic": compressed_tensors_checkpoint(
            float_model, root / "ct_dyn", "FP8_DYNAMIC"
        ),
        "fp8_config_block": fp8_config_checkpoint(float_model, root / "block", block=True),
        "fp8_config_static": fp8_config_checkpoint(float_model, root / "static", block=False),
    }
    return {name: str(path) for name, path in paths.items()}


def _dequantized(layer) -> torch.Tensor:
    scheme = layer.linear_method.scheme
    return dequantize_weight(layer.weight, layer.weight_scale, scheme.weights)


@pytest.mark.parametrize(
    "case", ["ct_fp8", "ct_fp8_dynamic", "fp8_config_block", "fp8_config_static"]
)
def test_each_rank_holds_its_slice_of_the_float8_weights_and_their_scales(case, checkpoints):
    whole = linears(load_model_as_rank(checkpoints[case], 0, 1, **ENGINE))
    for rank in (0, 1):
        for name, layer in linears(
            load_model_as_rank(checkpoints[case], rank, 2, **ENGINE)
        ).items():
            full = whole[name]
            assert layer.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(_dequantized(layer), rank_slice(_dequantized(full), layer)), name
            if full.input_scale is not None:  # static: the same on every rank
                assert torch.equal(layer.input_scale, full.input_scale), name


def _generate(rank: int, paths: list[str]) -> list[dict]:
    return [
        greedy_record(LLM(path, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False))
        for path in paths
    ]


def test_two_gloo_ranks_decode_fp8_checkpoints_as_one_rank(checkpoints):
    paths = [checkpoints[name] for name in DECODED]
    by_rank = run_ranks(_generate, paths)
    for i, one in enumerate(_generate(0, paths)):
        for rank in (0, 1):
            assert_same_greedy(by_rank[rank][i], one, 1e-4, (DECODED[i], rank))


def test_fp8_checkpoints_pass_the_config_time_tensor_parallel_check(checkpoints):
    for name in ("ct_fp8", "fp8_config_block"):
        config = EngineArgs(checkpoints[name], tensor_parallel_size=2).create_engine_config()
        assert config.parallel.tensor_parallel_size == 2


def test_a_rank_part_that_is_not_whole_blocks_is_refused_with_the_layer():
    """64-row heads: a rank's k part (one of two heads) is half a 128-row block."""
    config = quantization_methods.get("fp8_per_block").from_config(
        {"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    prefix = "model.layers.0.self_attn.qkv_proj"
    with as_rank(1, 2), pytest.raises(TensorParallelError) as refused:
        QKVParallelLinear(256, 64, 4, 2, quant_config=config, prefix=prefix)
    assert str(refused.value) == (
        f"{prefix}: split over tensor_parallel_size 2, rank 1's part of the weight (output parts "
        "[128, 64, 64], input 256) is not whole fp8 blocks of [128, 128]; choose a "
        "tensor_parallel_size that leaves every rank multiples of 128, or fp8_per_channel / "
        "fp8_per_tensor."
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["ct_fp8", "fp8_config_block"])
def test_rank_products_through_the_gpu_gemms_add_up_to_the_whole_layers(case, checkpoints):
    """The ranks built one after the other on one GPU (one GPU cannot run an NCCL group of two:
    the collectives are not covered), each layer's product through its fp8 GEMM in bfloat16."""
    engine = {**ENGINE, "dtype": "bfloat16"}
    whole = linears(load_model_as_rank(checkpoints[case], 0, 1, "cuda", **engine))
    ranks = [linears(load_model_as_rank(checkpoints[case], r, 2, "cuda", **engine)) for r in (0, 1)]
    assert {m.linear_method.gemm_path for m in ranks[0].values()} != {"reference"}
    errors = rank_product_errors(whole, ranks, torch.bfloat16)
    assert max(errors.values()) < 2e-2, errors
