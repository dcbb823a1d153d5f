"""The CUDA platform's Triton kernels on a GPU, at the sizes models run them: against the torch code
of the layers they replace (bf16, and fp16/fp32 at one size), replayed from a CUDA graph, and timed
against that torch code (printed, not asserted: speed belongs to benchmarks).

Run on the device machine with ``pytest -m gpu plugins/cuda_platform/tests``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm.layers import activation, layernorm, rotary_embedding
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.rotary_embedding import RotaryEmbedding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PLUGIN_DIR = Path(__file__).resolve().parents[1]
TOKENS = [1, 7, 256, 8192]
EPS = 1e-6
ROPE = {"rope_type": "default", "rope_theta": 500000.0}
MAX_POSITION = 8192
HEAD_SIZE = 128

Ops = dict[str, Callable[..., Any]]


@pytest.fixture(scope="module")
def ops() -> Iterator[Ops]:
    """The package's kernels, importable whether or not pagellm_cuda is pip-installed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(PLUGIN_DIR))
        from pagellm_cuda.ops import CUSTOM_OPS

        yield CUSTOM_OPS


@pytest.fixture
def torch_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers built under this fixture run their torch code, even with the CUDA platform
    current (whose custom ops are the kernels under test)."""
    torch.manual_seed(0)
    for module in (layernorm, rotary_embedding, activation):
        monkeypatch.setattr(module, "get_custom_op", lambda name: None)


def _strided_rows(
    tokens: int, width: int, dtype: torch.dtype = torch.bfloat16, pad: int = 64
) -> torch.Tensor:
    """Random [tokens, width] rows inside a NaN-padded buffer (row stride width + pad)."""
    buffer = torch.full((tokens, width + pad), float("nan"), dtype=dtype, device="cuda")
    rows = buffer[:, :width]
    rows.normal_()
    return rows


def assert_matches(
    actual: torch.Tensor,
    expected: torch.Tensor,
    max_ulps: int = 1,
    atol: float | torch.Tensor = 1e-6,
) -> None:
    """float32: close. bf16/fp16: bit-equal almost everywhere, and elsewhere at most ``max_ulps``
    apart or closer than float32 rounding of the operands (``atol``: a result cancelled to near
    zero has ulps far below that).

    Float32 intermediates differ in their last bits (the order of a sum, approximate ``exp`` and
    ``rsqrt``, FMAs); where the torch path rounds an intermediate to the dtype (RMSNorm's
    normalised row, silu before the product) that can flip the rounding and move the product by
    two ulps, or an operand by its ulp (``atol``, `rotated_norm_ulps`)."""
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


def _rms_norm_layer(hidden: int, dtype: torch.dtype = torch.bfloat16) -> RMSNorm:
    layer = RMSNorm(hidden, EPS).to("cuda", dtype)
    with torch.no_grad():
        layer.weight.normal_(1.0, 0.5)
    return layer


def _qkv(
    tokens: int, q_heads: int, kv_heads: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused qkv projection output and its q, k, v column views."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * HEAD_SIZE, dtype=dtype, device="cuda")
    sizes = [q_heads * HEAD_SIZE, kv_heads * HEAD_SIZE, kv_heads * HEAD_SIZE]
    q, k, v = qkv.split(sizes, -1)
    return qkv, q, k, v


@pytest.mark.parametrize("hidden", [1024, 4096])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_torch_layer(
    ops: Ops, torch_layers: None, tokens: int, hidden: int
) -> None:
    layer = _rms_norm_layer(hidden)
    x = _strided_rows(tokens, hidden)
    out = torch.full((tokens, hidden), float("nan"), dtype=x.dtype, device="cuda")

    ops["rms_norm"](x, layer.weight, EPS, out=out)

    assert_matches(out, layer(x), max_ulps=2)


@pytest.mark.parametrize("tokens", TOKENS)
def test_per_head_rms_norm_of_q_view_matches_torch_layer(
    ops: Ops, torch_layers: None, tokens: int
) -> None:
    """Qwen3's q_norm: [tokens * heads, head_size] rows, as a copy and as a strided view."""
    layer = _rms_norm_layer(HEAD_SIZE)
    _, q, _, _ = _qkv(tokens, 16, 8)
    heads = q.reshape(tokens, -1, HEAD_SIZE)
    expected = layer(heads)

    rows = ops["rms_norm"](heads.reshape(-1, HEAD_SIZE), layer.weight, EPS)
    assert_matches(rows.view(heads.shape), expected, max_ulps=2)
    first_head = heads[:, 0]  # [tokens, head_size], row stride of the whole qkv row
    assert_matches(ops["rms_norm"](first_head, layer.weight, EPS), expected[:, 0], max_ulps=2)
    # The [tokens, heads, head_size] view itself, read in place (the layer's path).
    assert_matches(ops["rms_norm"](heads, layer.weight, EPS), expected, max_ulps=2)


@pytest.mark.parametrize("hidden", [1024, 4096])
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm_matches_torch_layer_in_place(
    ops: Ops, torch_layers: None, tokens: int, hidden: int
) -> None:
    layer = _rms_norm_layer(hidden)
    x, residual = _strided_rows(tokens, hidden), _strided_rows(tokens, hidden)
    expected_out, expected_residual = layer(x.clone(), residual.clone())

    out, new_residual = ops["fused_add_rms_norm"](x, residual, layer.weight, EPS)

    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, expected_residual)
    assert_matches(out, expected_out, max_ulps=2)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(16, 8), (32, 8)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_embedding_matches_torch_layer_in_place(
    ops: Ops, torch_layers: None, tokens: int, q_heads: int, kv_heads: int
) -> None:
    rope = RotaryEmbedding(HEAD_SIZE, MAX_POSITION, ROPE).cuda()
    _, q, k, v = _qkv(tokens, q_heads, kv_heads)
    v_before = v.clone()
    positions = torch.randint(0, MAX_POSITION, (tokens,), device="cuda")
    rope.set_positions(positions)
    expected_q, expected_k = rope(positions, q, k)

    ops["rotary_embedding"](positions, q, k, HEAD_SIZE, rope.cos_sin_cache)

    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert torch.equal(v, v_before)


def check_qk_norm_rotary(
    ops: Ops, tokens: int, q_heads: int, kv_heads: int, dtype: torch.dtype = torch.bfloat16
) -> None:
    """``qk_norm_rotary`` on q/k views of a fused qkv at unsorted positions against the unfused
    torch layers (RMSNorm of each head, then the rotation); v stays as it was."""
    q_norm, k_norm = _rms_norm_layer(HEAD_SIZE, dtype), _rms_norm_layer(HEAD_SIZE, dtype)
    rope = RotaryEmbedding(HEAD_SIZE, MAX_POSITION, ROPE).cuda()
    _, q, k, v = _qkv(tokens, q_heads, kv_heads, dtype)
    v_before = v.clone()
    positions = torch.randperm(MAX_POSITION, device="cuda")[:tokens]
    rope.set_positions(positions)
    expected_q, expected_k = rope(
        positions,
        q_norm(q.reshape(tokens, -1, HEAD_SIZE)).reshape(tokens, -1),
        k_norm(k.reshape(tokens, -1, HEAD_SIZE)).reshape(tokens, -1),
    )
    ops["qk_norm_rotary"](
        positions, q, k, q_norm.weight, k_norm.weight, EPS, HEAD_SIZE, rope.cos_sin_cache
    )
    assert_matches(q, expected_q, 2, rotated_norm_ulps(expected_q, HEAD_SIZE))
    assert_matches(k, expected_k, 2, rotated_norm_ulps(expected_k, HEAD_SIZE))
    assert torch.equal(v, v_before)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(16, 8), (64, 8)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_qk_norm_rotary_matches_torch_layers_in_place(
    ops: Ops, torch_layers: None, tokens: int, q_heads: int, kv_heads: int
) -> None:
    """Qwen3-0.6B's heads (16 q, 8 kv) and Qwen3-32B's (64 q, 8 kv)."""
    check_qk_norm_rotary(ops, tokens, q_heads, kv_heads)


@pytest.mark.parametrize("d", [3072, 14336])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_matches_torch_layer(
    ops: Ops, torch_layers: None, tokens: int, d: int
) -> None:
    x = _strided_rows(tokens, 2 * d).mul_(3)
    out = torch.full((tokens, d), float("nan"), dtype=x.dtype, device="cuda")

    ops["silu_and_mul"](x, out=out)

    assert_matches(out, SiluAndMul()(x), max_ulps=2)


@pytest.mark.parametrize("tokens", TOKENS)
def test_write_paged_kv_matches_the_torch_version(ops: Ops, tokens: int) -> None:
    from pagellm.layers.custom_ops import write_paged_kv

    heads, block_size = 8, 16
    blocks = tokens // block_size + 2
    fused = torch.randn(tokens, 3 * heads * HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    key = fused[:, heads * HEAD_SIZE : 2 * heads * HEAD_SIZE].view(tokens, heads, HEAD_SIZE)
    value = fused[:, 2 * heads * HEAD_SIZE :].view(tokens, heads, HEAD_SIZE)
    slots = torch.randperm((blocks - 1) * block_size, device="cuda")[:tokens] + block_size
    slots[::5] = -1
    caches = []
    for op in (ops["write_paged_kv"], write_paged_kv):
        cache = torch.zeros(2, blocks, block_size, heads, HEAD_SIZE, device="cuda").bfloat16()
        op(key, value, cache[0], cache[1], slots)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_every_op_matches_torch_layers_in_other_dtypes(
    ops: Ops, torch_layers: None, dtype: torch.dtype
) -> None:
    tokens, hidden = 255, 4096
    norm = _rms_norm_layer(hidden, dtype)
    x, residual = _strided_rows(tokens, hidden, dtype), _strided_rows(tokens, hidden, dtype)
    assert_matches(ops["rms_norm"](x, norm.weight, EPS), norm(x), max_ulps=2)
    expected_out, expected_residual = norm(x.clone(), residual.clone())
    out, new_residual = ops["fused_add_rms_norm"](x, residual, norm.weight, EPS)
    assert_matches(out, expected_out, max_ulps=2)
    assert_matches(new_residual, expected_residual)

    rope = RotaryEmbedding(HEAD_SIZE, MAX_POSITION, ROPE).cuda()
    _, q, k, _ = _qkv(tokens, 32, 8, dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device="cuda")
    rope.set_positions(positions)
    expected_q, expected_k = rope(positions, q, k)
    ops["rotary_embedding"](positions, q, k, HEAD_SIZE, rope.cos_sin_cache)
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    check_qk_norm_rotary(ops, tokens, 16, 8, dtype)

    gate_up = _strided_rows(tokens, 2 * 14336, dtype).mul_(3)
    assert_matches(ops["silu_and_mul"](gate_up), SiluAndMul()(gate_up), max_ulps=2)


def test_ops_replayed_from_a_cuda_graph_match_torch_layers(ops: Ops, torch_layers: None) -> None:
    """One capture, then replays on new inputs copied into the captured buffers: the kernels
    neither sync with the host nor bake values of a call into the graph."""
    tokens, hidden, inter, q_heads, kv_heads = 64, 1024, 3072, 16, 8
    norm, post_norm = _rms_norm_layer(hidden), _rms_norm_layer(hidden)
    rope = RotaryEmbedding(HEAD_SIZE, MAX_POSITION, ROPE).cuda()
    hidden_states = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    residual, attn_out = torch.empty_like(hidden_states), torch.empty_like(hidden_states)
    qkv, q, k, _ = _qkv(tokens, q_heads, kv_heads)
    gate_up = torch.empty(tokens, 2 * inter, dtype=torch.bfloat16, device="cuda")
    positions = torch.zeros(tokens, dtype=torch.long, device="cuda")

    def step() -> tuple[torch.Tensor, ...]:
        normed = ops["rms_norm"](hidden_states, norm.weight, EPS)
        ops["rotary_embedding"](positions, q, k, HEAD_SIZE, rope.cos_sin_cache)
        out, new_residual = ops["fused_add_rms_norm"](attn_out, residual, post_norm.weight, EPS)
        return normed, out, new_residual, ops["silu_and_mul"](gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels, which must not happen during capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outputs = step()

    for _ in range(2):
        for buffer in (hidden_states, residual, attn_out, qkv, gate_up):
            buffer.normal_()
        positions.random_(0, MAX_POSITION)
        expected_normed = norm(hidden_states)
        expected_out, expected_residual = post_norm(attn_out.clone(), residual.clone())
        rope.set_positions(positions)
        expected_q, expected_k = rope(positions, q, k)
        expected_act = SiluAndMul()(gate_up)

        graph.replay()

        normed, out, new_residual, act = graph_outputs
        assert_matches(normed, expected_normed, max_ulps=2)
        assert_matches(out, expected_out, max_ulps=2)
        assert_matches(new_residual, expected_residual)
        assert_matches(q, expected_q)
        assert_matches(k, expected_k)
        assert_matches(act, expected_act, max_ulps=2)


Case = tuple[str, int, Callable[[], object], Callable[[], object]]


def _timing_cases(ops: Ops, tokens: int) -> list[Case]:
    """(op, bytes it moves, kernel call, torch layer call) at Llama-3-8B's shapes, bf16."""
    hidden, inter, q_heads, kv_heads, size = 4096, 14336, 32, 8, 2
    norm = _rms_norm_layer(hidden)
    rope = RotaryEmbedding(HEAD_SIZE, MAX_POSITION, ROPE).cuda()
    act = SiluAndMul()
    x, residual = _strided_rows(tokens, hidden), _strided_rows(tokens, hidden)
    _, q, k, _ = _qkv(tokens, q_heads, kv_heads)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device="cuda")
    rope.set_positions(positions)  # the torch path gathers cos/sin once per step, for all layers
    gate_up = _strided_rows(tokens, 2 * inter)
    q_norm = _rms_norm_layer(HEAD_SIZE)

    def unfused_qk_norm_rotary() -> object:  # the torch layers Qwen3's attention runs without it
        heads = q_norm(q.reshape(tokens, -1, HEAD_SIZE)), q_norm(k.reshape(tokens, -1, HEAD_SIZE))
        return rope(positions, *(h.reshape(tokens, -1) for h in heads))

    return [
        (
            "rms_norm",
            2 * tokens * hidden * size,
            lambda: ops["rms_norm"](x, norm.weight, EPS),
            lambda: norm(x),
        ),
        (
            "fused_add_rms_norm",
            4 * tokens * hidden * size,
            lambda: ops["fused_add_rms_norm"](x, residual, norm.weight, EPS),
            lambda: norm(x, residual),
        ),
        (
            "rotary_embedding",
            2 * tokens * (q_heads + kv_heads) * HEAD_SIZE * size,
            lambda: ops["rotary_embedding"](positions, q, k, HEAD_SIZE, rope.cos_sin_cache),
            lambda: rope(positions, q, k),
        ),
        (
            "qk_norm_rotary",
            2 * tokens * (q_heads + kv_heads) * HEAD_SIZE * size,
            lambda: ops["qk_norm_rotary"](
                positions, q, k, q_norm.weight, q_norm.weight, EPS, HEAD_SIZE, rope.cos_sin_cache
            ),
            unfused_qk_norm_rotary,
        ),
        (
            "silu_and_mul",
            3 * tokens * inter * size,
            lambda: ops["silu_and_mul"](gate_up),
            lambda: act(gate_up),
        ),
    ]


def test_print_kernel_timings_against_torch_layers(
    ops: Ops, torch_layers: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from triton.testing import do_bench

    lines = [f"{torch.cuda.get_device_name()}, bf16, do_bench medians; GB/s moved by the kernel"]
    for tokens in (1, 256, 8192):
        for name, moved_bytes, kernel, reference in _timing_cases(ops, tokens):
            kernel_ms = do_bench(kernel, return_mode="median")
            torch_ms = do_bench(reference, return_mode="median")
            lines.append(
                f"{name:<19} tokens={tokens:<5} triton {kernel_ms * 1e3:9.1f} us "
                f"({moved_bytes / kernel_ms / 1e6:6.0f} GB/s)   torch {torch_ms * 1e3:9.1f} us"
            )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
