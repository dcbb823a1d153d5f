"""int4 checkpoints (GPTQ, AWQ, compressed-tensors) split over two tensor-parallel ranks on the
CPU: each rank's 4-bit weights, scales and zeros dequantize to its slice of the one-rank
model's weights, two gloo ranks decode as one rank does, and what cannot split is refused:
groups cut by a rank's inputs, act-order groups scattered over them.

The ranks of the slice checks are built one after the other in this process
(`tensor_parallel.as_rank`); the decoding runs two spawned processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from int4_checkpoints import tiny_llama
from pagellm_int4.kernel_layout import dequantize
from pagellm_int4.rtn import write_checkpoint
from pagellm_int4.scheme import Int4Scheme

from pagellm import LLM, SamplingParams
from pagellm.config import ConfigError
from pagellm.engine.args import EngineArgs
from pagellm.layers.parallel_linear import RowParallelLinear, TensorParallelError
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
SCHEMES = {
    "gptq_sym_g128_v1": Int4Scheme("gptq", 128),
    "gptq_asym_g32_v2": Int4Scheme("gptq", 32, sym=False, gptq_v1=False),
    "gptq_channel": Int4Scheme("gptq", -1, sym=False),
    "awq_asym_g64": Int4Scheme("awq", 64, sym=False),
    "ct_asym_g128": Int4Scheme("compressed-tensors", 128, sym=False),
    "ct_sym_channel": Int4Scheme("compressed-tensors", -1),
}
DECODED = ("gptq_asym_g32_v2", "awq_asym_g64")


def _with_config(path: Path, change: dict) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **change}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("int4_tp")
    float_model = tiny_llama(root / "float", smollm2_tokenizer_dir)
    paths = {name: write_checkpoint(float_model, root / name, s) for name, s in SCHEMES.items()}
    # Act-order with static groups: g_idx in order (what GPTQ's static_groups writes), every
    # rank's inputs whole groups, read through the act-order path (scales kept whole).
    static = write_checkpoint(float_model, root / "static", Int4Scheme("gptq", 64, sym=False))
    paths["gptq_desc_act_static_groups"] = _with_config(
        static, {"desc_act": True, "static_groups": True}
    )
    scattered = Int4Scheme("gptq", 32, sym=False, desc_act=True)
    paths["gptq_desc_act"] = write_checkpoint(float_model, root / "desc_act", scattered)
    return {name: str(path) for name, path in paths.items()}


def _weight(layer) -> torch.Tensor:
    """The layer's dequantized weight [N, K] in the checkpoint's input order."""
    layout = layer.linear_method._layout
    rows = dequantize(layout, torch.float32)  # [K, N], inputs in kernel order
    if layout.perm is not None:
        rows = torch.empty_like(rows).index_copy_(0, layout.perm, rows)
    return rows.t()


@pytest.mark.parametrize("case", [*SCHEMES, "gptq_desc_act_static_groups"])
def test_each_rank_dequantizes_to_its_slice_of_the_whole_weight(case, checkpoints):
    whole = linears(load_model_as_rank(checkpoints[case], 0, 1, **ENGINE))
    for rank in (0, 1):
        for name, layer in linears(
            load_model_as_rank(checkpoints[case], rank, 2, **ENGINE)
        ).items():
            assert layer.linear_method.gemm_path == "reference"
            expected = rank_slice(_weight(whole[name]), layer)
            assert torch.equal(_weight(layer), expected), (case, name, rank)


def _generate(rank: int, paths: list[str]) -> list[dict]:
    return [
        greedy_record(LLM(path, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False))
        for path in paths
    ]


def test_two_gloo_ranks_decode_int4_checkpoints_as_one_rank(checkpoints):
    paths = [checkpoints[name] for name in DECODED]
    by_rank = run_ranks(_generate, paths)
    for i, one in enumerate(_generate(0, paths)):
        for rank in (0, 1):
            assert_same_greedy(by_rank[rank][i], one, 1e-4, (DECODED[i], rank))


def test_act_order_without_static_groups_is_refused_at_config_time(checkpoints):
    with pytest.raises(ConfigError) as refused:
        EngineArgs(checkpoints["gptq_desc_act"], tensor_parallel_size=2).create_engine_config()
    assert str(refused.value).startswith(
        "quantization gptq does not support tensor_parallel_size 2 with an act-order checkpoint "
        "(desc_act, without static_groups): its g_idx scatters each quantization group"
    )
    config = EngineArgs(checkpoints["gptq_desc_act_static_groups"], tensor_parallel_size=2)
    assert config.create_engine_config().quantization == "gptq"


def test_scattered_groups_of_a_checkpoint_claiming_static_groups_are_refused_at_load(
    checkpoints, tmp_path
):
    import shutil

    path = Path(shutil.copytree(checkpoints["gptq_desc_act"], tmp_path / "claims_static"))
    _with_config(path, {"static_groups": True})
    with pytest.raises(TensorParallelError) as refused:
        load_model_as_rank(str(path), 1, 2, **ENGINE)
    assert re.match(
        r"model\.layers\.0\.self_attn\.o_proj: act-order g_idx scatters quantization groups over "
        r"the input features, so rank 1's input features \[128, 256\) of 256 hold only part of "
        r"\d+ of the \d+ groups they use; .* serve this checkpoint with tensor_parallel_size 1",
        str(refused.value),
    ), refused.value


def test_a_group_cut_by_a_ranks_inputs_is_refused_with_the_layer():
    config = quantization_methods.get("gptq").from_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 256}
    )
    prefix = "model.layers.0.self_attn.o_proj"
    with as_rank(0, 2), pytest.raises(TensorParallelError) as refused:
        RowParallelLinear(256, 256, quant_config=config, prefix=prefix)
    assert str(refused.value) == (
        f"{prefix}: split over tensor_parallel_size 2, rank 0's part of the layer cuts its packed "
        "words or groups: gptq group_size 256 does not divide the layer's 128 input features; "
        "choose a tensor_parallel_size that leaves every rank whole groups and words."
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "case", ["gptq_asym_g32_v2", "awq_asym_g64", "gptq_desc_act_static_groups"]
)
def test_rank_products_through_the_triton_gemm_add_up_to_the_whole_layers(case, checkpoints):
    """The ranks built one after the other on one GPU (one GPU cannot run an NCCL group of two:
    the collectives are not covered), each layer's product through the W4A16 Triton GEMM."""
    engine = {**ENGINE, "dtype": "bfloat16"}
    whole = linears(load_model_as_rank(checkpoints[case], 0, 1, "cuda", **engine))
    ranks = [linears(load_model_as_rank(checkpoints[case], r, 2, "cuda", **engine)) for r in (0, 1)]
    assert {m.linear_method.gemm_path for m in ranks[0].values()} == {"triton_w4a16"}
    errors = rank_product_errors(whole, ranks, torch.bfloat16)
    assert max(errors.values()) < 2e-2, errors
