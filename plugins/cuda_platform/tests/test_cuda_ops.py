"""The CUDA platform's Triton kernels (`pagellm_cuda.ops`) against the torch code of the layers
they replace, run on the CPU by the Triton interpreter (also under the oldest and the newest Triton
the package admits, by `make test`).

The interpreter stands in for the GPU, which CI lacks. Two things about it shape this module:

- Triton picks interpreter mode when it is imported (its own ``tl.sum`` & co. are decorated then),
  and a process whose triton interprets cannot compile GPU kernels. So the checks run in a child
  pytest process started with ``TRITON_INTERPRET=1``: in any other process this module collects
  one test, which runs this file in such a child and fails with the child's report.
- It truncates float32 -> bfloat16 casts where the GPU rounds to nearest even
  (``cvt.rn.bf16.f32``), so the checks give it the GPU's rounding
  (`interpreter_with_gpu_rounding`).

The GPU itself is tested by test_cuda_ops_gpu.py, beside this module.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm.layers import activation, layernorm, rotary_embedding
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.custom_ops import OP_NAMES
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.rotary_embedding import RotaryEmbedding
from pagellm.testing.triton_interpreter import gpu_bfloat16_rounding

REPO = Path(__file__).resolve().parents[3]
OPS_DIR = Path(__file__).resolve().parents[1] / "pagellm_cuda" / "ops"
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6
ROPE = {"rope_type": "default", "rope_theta": 10000.0}

Ops = dict[str, Callable[..., Any]]


@pytest.mark.skipif(IN_INTERPRETER, reason="this is the interpreter process: the checks run here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_torch_layers_in_interpreter_process() -> None:
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = f"{child.stdout}\n{child.stderr}"
    assert child.returncode == 0, f"Interpreter checks failed:\n{report}"
    assert " passed" in child.stdout, f"No interpreter check ran:\n{report}"


def _load_ops() -> Ops:
    """The ops package by path, under a private name: the checks need neither the rest of
    pagellm_cuda nor its installation."""
    spec = importlib.util.spec_from_file_location(
        "_pagellm_cuda_ops", OPS_DIR / "__init__.py", submodule_search_locations=[str(OPS_DIR)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.CUSTOM_OPS


@pytest.fixture(scope="module")
def interpreter_with_gpu_rounding() -> Iterator[None]:
    with gpu_bfloat16_rounding():
        yield


@pytest.fixture(scope="module")
def ops(interpreter_with_gpu_rounding: None) -> Ops:
    return _load_ops()


@pytest.fixture
def torch_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers built under this fixture run their torch code, whatever platform is current."""
    torch.manual_seed(0)
    for module in (layernorm, rotary_embedding, activation):
        monkeypatch.setattr(module, "get_custom_op", lambda name: None)


def _strided_rows(tokens: int, width: int, dtype: torch.dtype, pad: int = 24) -> torch.Tensor:
    """Random [tokens, width] rows inside a NaN-padded buffer (row stride width + pad)."""
    buffer = torch.full((tokens, width + pad), float("nan"), dtype=dtype)
    rows = buffer[:, :width]
    rows.normal_()
    return rows


def _padding(rows: torch.Tensor) -> torch.Tensor:
    """The buffer columns between the rows of a `_strided_rows` view."""
    width = rows.shape[1]
    return rows.as_strided(
        (rows.shape[0], rows.stride(0) - width), rows.stride(), rows.storage_offset() + width
    )


def assert_matches(
    actual: torch.Tensor,
    expected: torch.Tensor,
    max_ulps: int = 1,
    atol: float | torch.Tensor = 1e-6,
) -> None:
    """float32: close. bf16/fp16: bit-equal almost everywhere, and elsewhere at most ``max_ulps``
    apart or closer than float32 rounding of the operands (``atol``: a result cancelled to near
    zero has ulps far below that).

    Float32 intermediates may differ in their last bit (the order of a sum, ``exp``, an FMA);
    where the torch path rounds an intermediate to the dtype (RMSNorm's normalised row, silu
    before the product) that can flip the rounding and move the product by two ulps, or an
    operand by its ulp (``atol``, `rotated_norm_ulps`)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return

    def ordered(t: torch.Tensor) -> torch.Tensor:  # bit patterns in the order of their values
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    assert torch.isfinite(actual).all(), "NaN or inf in the kernel's output"
    ulps = (ordered(actual) - ordered(expected)).abs()
    off = (ulps > max_ulps) & ((actual.float() - expected.float()).abs() > atol)
    assert not off.any(), f"{off.sum().item()} elements over {max_ulps} ulps apart"
    assert (ulps == 0).float().mean().item() >= 0.99


def rotated_norm_ulps(rotated: torch.Tensor, head_size: int) -> torch.Tensor:
    """Two ulps of each rotated pair's radius, an ``atol`` for rotations of RMSNorm outputs: a
    norm output rounded the other way moves both its rotations by its ulp, many ulps of a result
    cancelled towards zero (the rotation keeps the radius of the pair, so this bounds it)."""
    pairs = rotated.float().unflatten(-1, (-1, 2, head_size // 2))
    radius = torch.hypot(pairs[..., :1, :], pairs[..., 1:, :]).expand_as(pairs)
    return (2 * torch.finfo(rotated.dtype).eps * radius).reshape(rotated.shape)


def _rms_norm_layer(hidden: int, dtype: torch.dtype) -> RMSNorm:
    layer = RMSNorm(hidden, EPS).to(dtype)
    with torch.no_grad():
        layer.weight.normal_(1.0, 0.5)
    return layer


class TestInInterpreter:
    """The checks; collected only in the interpreter process (see the module's docstring)."""

    __test__ = IN_INTERPRETER

    def test_custom_ops_cover_every_contract_op(self, ops: Ops) -> None:
        assert sorted(ops) == sorted(OP_NAMES)

    @pytest.mark.parametrize("hidden", [64, 128, 1024, 4096])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_rms_norm_of_strided_rows_matches_torch_layer(
        self, ops: Ops, torch_layers: None, dtype: torch.dtype, hidden: int
    ) -> None:
        tokens = 3 if hidden == 4096 else 37
        layer = _rms_norm_layer(hidden, dtype)
        x = _strided_rows(tokens, hidden, dtype)
        x_before = x.clone()
        out = torch.full((tokens, hidden), float("nan"), dtype=dtype)

        result = ops["rms_norm"](x, layer.weight, EPS, out=out)

        assert result is out
        assert_matches(out, layer(x), max_ulps=2)
        assert torch.equal(x, x_before)

    @pytest.mark.parametrize("heads,head_size", [(16, 128), (3, 64)])
    def test_rms_norm_of_a_strided_heads_view_matches_torch_layer(
        self, ops: Ops, torch_layers: None, heads: int, head_size: int
    ) -> None:
        """Per-head q/k norms over a [tokens, heads, head_size] view of a fused QKV row, whose
        tokens and heads cannot be one strided 2-D view: read in place, not copied."""
        tokens = 5
        layer = _rms_norm_layer(head_size, torch.bfloat16)
        fused = _strided_rows(tokens, 3 * heads * head_size, torch.bfloat16)
        view = fused[:, heads * head_size : 2 * heads * head_size].view(tokens, heads, head_size)
        assert view.reshape(-1, head_size).data_ptr() != view.data_ptr()  # reshape would copy
        out = ops["rms_norm"](view, layer.weight, EPS)
        assert out.shape == view.shape and out.is_contiguous()
        assert_matches(out, layer(view), max_ulps=2)

    @pytest.mark.parametrize("hidden", [64, 128, 1024, 4096])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_fused_add_rms_norm_writes_torch_layer_results_in_place(
        self, ops: Ops, torch_layers: None, dtype: torch.dtype, hidden: int
    ) -> None:
        tokens = 3 if hidden == 4096 else 21
        layer = _rms_norm_layer(hidden, dtype)
        x, residual = _strided_rows(tokens, hidden, dtype), _strided_rows(tokens, hidden, dtype)
        expected_out, expected_residual = layer(x.clone(), residual.clone())

        out, new_residual = ops["fused_add_rms_norm"](x, residual, layer.weight, EPS)

        assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
        assert torch.equal(new_residual, expected_residual)  # one rounding of an exact sum
        assert_matches(out, expected_out, max_ulps=2)
        assert _padding(x).isnan().all() and _padding(residual).isnan().all()

    @pytest.mark.parametrize(
        ("q_heads", "kv_heads", "head_size"), [(4, 2, 64), (3, 1, 80), (8, 2, 128), (32, 8, 128)]
    )
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_rotary_embedding_rotates_q_k_views_of_fused_qkv_in_place(
        self,
        ops: Ops,
        torch_layers: None,
        dtype: torch.dtype,
        q_heads: int,
        kv_heads: int,
        head_size: int,
    ) -> None:
        tokens, max_position = 5, 4096
        layer = RotaryEmbedding(head_size, max_position, ROPE)
        qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_size, dtype=dtype)
        q, k, v = qkv.split([q_heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
        v_before = v.clone()
        positions = torch.randint(0, max_position, (tokens,))
        layer.set_positions(positions)
        expected_q, expected_k = layer(positions, q, k)

        ops["rotary_embedding"](positions, q, k, head_size, layer.cos_sin_cache)

        assert_matches(q, expected_q)
        assert_matches(k, expected_k)
        assert torch.equal(v, v_before)

    @pytest.mark.parametrize(
        ("q_heads", "kv_heads", "head_size"), [(16, 8, 128), (8, 2, 64), (3, 1, 80)]
    )
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_qk_norm_rotary_writes_per_head_norms_then_rotary_into_q_k_views(
        self,
        ops: Ops,
        torch_layers: None,
        dtype: torch.dtype,
        q_heads: int,
        kv_heads: int,
        head_size: int,
    ) -> None:
        """The fused op against the unfused torch layers (RMSNorm of each head, then the
        rotation) on q/k views of a fused qkv, at unsorted positions; v stays as it was."""
        tokens, max_position = 6, 4096
        q_norm, k_norm = _rms_norm_layer(head_size, dtype), _rms_norm_layer(head_size, dtype)
        rope = RotaryEmbedding(head_size, max_position, ROPE)
        qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_size, dtype=dtype) * 3
        q, k, v = qkv.split([q_heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
        v_before = v.clone()
        positions = torch.randperm(max_position)[:tokens]
        rope.set_positions(positions)
        expected_q, expected_k = rope(
            positions,
            q_norm(q.reshape(tokens, -1, head_size)).reshape(tokens, -1),
            k_norm(k.reshape(tokens, -1, head_size)).reshape(tokens, -1),
        )

        ops["qk_norm_rotary"](
            positions, q, k, q_norm.weight, k_norm.weight, EPS, head_size, rope.cos_sin_cache
        )

        assert_matches(q, expected_q, 2, rotated_norm_ulps(expected_q, head_size))
        assert_matches(k, expected_k, 2, rotated_norm_ulps(expected_k, head_size))
        assert torch.equal(v, v_before)

    @pytest.mark.parametrize("d", [64, 128, 1024, 4096])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_silu_and_mul_of_strided_rows_matches_torch_layer(
        self, ops: Ops, torch_layers: None, dtype: torch.dtype, d: int
    ) -> None:
        tokens = 3 if d == 4096 else 19
        x = _strided_rows(tokens, 2 * d, dtype).mul_(3)  # reach silu's flat and linear parts
        out = torch.full((tokens, d), float("nan"), dtype=dtype)

        result = ops["silu_and_mul"](x, out=out)

        assert result is out
        assert_matches(out, SiluAndMul()(x), max_ulps=2)

    @pytest.mark.parametrize("heads,head_size", [(8, 128), (3, 80), (1, 64)])
    def test_write_paged_kv_matches_the_torch_version(
        self, ops: Ops, heads: int, head_size: int
    ) -> None:
        """Token-major pages of a [2, blocks, block_size, heads, head_size] cache, the new keys
        and values strided views of a fused projection, padding slots (-1) written nowhere."""
        from pagellm.layers.custom_ops import write_paged_kv

        gen = torch.Generator().manual_seed(heads)
        blocks, block_size, tokens = 7, 16, 21
        fused = torch.randn(tokens, 3 * heads * head_size, generator=gen).bfloat16()
        key = fused[:, heads * head_size : 2 * heads * head_size].view(tokens, heads, head_size)
        value = fused[:, 2 * heads * head_size :].view(tokens, heads, head_size)
        slots = torch.randperm(blocks * block_size - block_size, generator=gen)[:tokens] + 16
        slots[[4, 11]] = -1
        caches = []
        for op in (ops["write_paged_kv"], write_paged_kv):
            cache = torch.full((2, blocks, block_size, heads, head_size), 7.0).bfloat16()
            op(key, value, cache[0], cache[1], slots)
            caches.append(cache)
        assert torch.equal(caches[0], caches[1])
        flat = caches[0].view(2, -1, heads, head_size)
        written = slots >= 0
        assert torch.equal(flat[0, slots[written]], key[written])
        assert torch.equal(flat[1, slots[written]], value[written])
        assert (flat[:, :block_size] == 7.0).all()  # the null block: padding went nowhere

    @pytest.mark.parametrize("fused", [True, False], ids=["qk_norm_rotary", "unfused_ops"])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_qwen3_attention_gives_attention_the_q_k_v_of_torch_layers(
        self, ops: Ops, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, fused: bool
    ) -> None:
        """Qwen3's LlamaAttention (per-head q/k norms, then rotary, on views of the fused qkv)
        built with the Triton ops (the fused `qk_norm_rotary`, or `rms_norm` on each head and
        `rotary_embedding`) and with the torch code: attention gets the same q, k and v."""
        from transformers import Qwen3Config

        from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
        from pagellm.models import llama

        cfg = Qwen3Config(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64
        )
        tokens = 7
        torch.manual_seed(0)
        hidden_states = torch.randn(tokens, cfg.hidden_size, dtype=dtype)
        positions = torch.randperm(256)[:tokens]
        table = ops if fused else {n: op for n, op in ops.items() if n != "qk_norm_rotary"}

        def attention_inputs(op_table: Ops) -> list[torch.Tensor]:
            for module in (layernorm, rotary_embedding, llama):
                monkeypatch.setattr(module, "get_custom_op", op_table.get)
            rope = RotaryEmbedding(64, 256, ROPE)
            ctx = llama.LayerContext(cfg, None, TorchSDPABackend, None, rope, False, True)
            torch.set_default_dtype(dtype)  # as the model loader builds models
            try:
                layer = llama.LlamaAttention(ctx, "self_attn")
            finally:
                torch.set_default_dtype(torch.float32)
            assert (layer._qk_norm_rotary_op is not None) == ("qk_norm_rotary" in op_table)
            torch.manual_seed(1)
            for param in layer.parameters():  # the norms' weights around 1, the projections' 0
                param.data.normal_(float(param.dim() == 1), 0.5 if param.dim() == 1 else 0.1)
            rope.set_positions(positions)
            return list(layer.project_qkv(positions, hidden_states))

        for actual, expected in zip(attention_inputs(table), attention_inputs({}), strict=True):
            assert_matches(actual, expected, 2, rotated_norm_ulps(expected, 64))
