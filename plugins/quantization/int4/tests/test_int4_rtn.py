"""The round-to-nearest writer's tensors in each format, read back by the tests' own unpackers
(written from the formats' definitions) and, for compressed-tensors, compared with
compressed-tensors' own packer; the packing's nibble order on hand-checked words."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int4_checkpoints import awq_unpack, gptq_unpack
from pagellm_int4.checkpoint_tensors import read_layer, write_layer
from pagellm_int4.packing import AWQ_ORDER, pack_cols, pack_rows
from pagellm_int4.rtn import act_order, quantize_rtn
from pagellm_int4.scheme import Int4Scheme

SCALES = torch.float16


def _weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05


def test_nibbles_sit_where_each_format_puts_them():
    values = torch.arange(8, dtype=torch.uint8)
    assert pack_cols(values[None, :]).item() == 0x76543210  # GPTQ / CT: low nibble first
    assert pack_rows(values[:, None]).item() == 0x76543210
    assert pack_cols(values[None, :], AWQ_ORDER).item() == 0x75316420  # AWQ: 0,2,4,6,1,3,5,7
    top = torch.full((1, 8), 15, dtype=torch.uint8)
    assert pack_cols(top).item() == -1  # bit 31 is the sign of the int32 word


@pytest.mark.parametrize(
    "scheme",
    [
        Int4Scheme("gptq", 128),
        Int4Scheme("gptq", 32, sym=False),
        Int4Scheme("gptq", 64, sym=False, gptq_v1=False),
        Int4Scheme("gptq", -1, sym=False, desc_act=True),
    ],
    ids=["sym_g128_v1", "asym_g32_v1", "asym_g64_v2", "asym_channel_desc_act"],
)
def test_gptq_tensors_unpack_to_the_quantized_weight(scheme):
    w = _weight(48, 256)
    order = act_order("model.layers.0.mlp.up_proj.weight", 256) if scheme.desc_act else None
    values = quantize_rtn(w, scheme.group_size, scheme.sym, order, 1 if scheme.gptq_v1 else 0)
    tensors = write_layer(scheme, values, SCALES)
    assert tensors["qweight"].shape == (32, 48) and tensors["qweight"].dtype == torch.int32
    groups = 1 if scheme.group_size == -1 else 256 // scheme.group_size
    assert tensors["qzeros"].shape == (groups, 6) and tensors["scales"].shape == (groups, 48)
    unpacked = gptq_unpack(tensors, scheme.gptq_v1)
    np.testing.assert_array_equal(unpacked, values.dequantize().numpy())
    # Round to nearest: within half a step (the largest scale) of the float weight.
    step = values.scales.max().item()
    assert np.abs(unpacked - w.numpy()).max() <= step / 2 + 1e-6
    again = read_layer(scheme, tensors, 256, 48)
    assert torch.equal(again.dequantize(), values.dequantize())


def test_gptq_v1_stores_zero_minus_one():
    scheme = Int4Scheme("gptq", 128)  # symmetric: zero 8, stored 7 in every nibble
    values = quantize_rtn(_weight(8, 128), 128, sym=True)
    assert write_layer(scheme, values, SCALES)["qzeros"].item() == 0x77777777
    v2 = Int4Scheme("gptq", 128, gptq_v1=False)
    assert write_layer(v2, values, SCALES)["qzeros"].item() == -0x77777778  # 0x88888888


def test_desc_act_g_idx_gives_every_group_its_size_in_a_shuffled_order():
    order = act_order("model.layers.0.self_attn.q_proj.weight", 256)
    assert torch.equal(order, act_order("model.layers.0.self_attn.k_proj.weight", 256))
    values = quantize_rtn(_weight(16, 256), 64, sym=True, order=order)
    assert torch.bincount(values.g_idx).tolist() == [64] * 4
    assert not torch.equal(values.g_idx, torch.arange(256) // 64)


@pytest.mark.parametrize("sym", [True, False])
def test_awq_tensors_unpack_to_the_quantized_weight(sym):
    scheme = Int4Scheme("awq", 64, sym=sym)
    w = _weight(40, 128)
    values = quantize_rtn(w, 64, sym)
    tensors = write_layer(scheme, values, SCALES)
    assert tensors["qweight"].shape == (128, 5) and tensors["qzeros"].shape == (2, 5)
    unpacked = awq_unpack(tensors, 64)
    np.testing.assert_array_equal(unpacked, values.dequantize().numpy())
    assert torch.equal(read_layer(scheme, tensors, 128, 40).dequantize(), values.dequantize())


@pytest.mark.parametrize(("n", "k", "group", "sym"), [(40, 256, 128, True), (24, 200, 40, False)])
def test_compressed_tensors_tensors_are_what_its_packer_writes(n, k, group, sym):
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    scheme = Int4Scheme("compressed-tensors", group, sym=sym)
    values = quantize_rtn(_weight(n, k), group, sym)
    tensors = write_layer(scheme, values, SCALES)
    signed_q = (values.q.t().to(torch.int16) - 8).to(torch.int8)  # [N, K], -8..7
    assert torch.equal(tensors["weight_packed"], pack_to_int32(signed_q, 4))
    assert tensors["weight_shape"].tolist() == [n, k]
    assert tensors["weight_scale"].shape == (n, k // group)
    if sym:
        assert "weight_zero_point" not in tensors
    else:
        signed_zero = (values.zeros.t().to(torch.int16) - 8).to(torch.int8)  # [N, G]
        assert torch.equal(
            tensors["weight_zero_point"], pack_to_int32(signed_zero, 4, packed_dim=0)
        )
        unpacked = unpack_from_int32(
            tensors["weight_zero_point"], 4, torch.Size([n, k // group]), packed_dim=0
        )
        assert torch.equal(unpacked, signed_zero)
    assert torch.equal(unpack_from_int32(tensors["weight_packed"], 4, torch.Size([n, k])), signed_q)
    assert torch.equal(read_layer(scheme, tensors, k, n).dequantize(), values.dequantize())


def test_a_group_that_does_not_divide_the_input_is_refused():
    with pytest.raises(ValueError, match="group_size 96 does not divide the weight's 256 input"):
        quantize_rtn(_weight(8, 256), 96, sym=True)
