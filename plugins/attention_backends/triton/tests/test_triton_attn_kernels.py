"""TRITON_ATTN's kernels on CPU, through Triton's interpreter, against a float64 reference.

These are the tests `make test` also runs under the oldest and the newest Triton the package
admits. GPU sizes and timing live in test_triton_attn_gpu.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from interpreted_package import interpreted
from paged_batches import (
    DTYPES,
    assert_close_to_reference,
    assert_new_kv_written,
    make_batch,
    reference,
    run_decode,
    run_mixed,
)

# Empty splits and padding rows take log2(0) = -inf on purpose; NumPy (the interpreter) warns.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    with interpreted("kernels") as module:
        yield module


# A prompt, a chunk after cached context, decodes (one a one-token prompt), a long chunk.
MIXED_ROWS = [(0, 37), (45, 20), (70, 1), (0, 1), (13, 1), (100, 40)]


@pytest.mark.parametrize(
    "dtype, head_size, num_heads, num_kv_heads, window, block_size",
    [
        ("fp32", 16, 4, 2, None, 16),
        ("bf16", 32, 8, 2, None, 16),
        ("fp16", 64, 4, 4, None, 32),
        ("fp32", 80, 6, 2, 24, 16),  # head size and group (3) not powers of two
        ("bf16", 16, 4, 2, 8, 32),
        ("fp16", 96, 2, 1, 50, 16),
        ("bf16", 128, 4, 2, None, 16),
        ("fp32", 256, 2, 1, 40, 16),
    ],
)
def test_mixed_batch_matches_float64_reference(
    kernels, dtype, head_size, num_heads, num_kv_heads, window, block_size
):
    batch = make_batch(
        MIXED_ROWS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        block_size=block_size,
        seed=head_size + num_heads,
    )
    scale = head_size**-0.5
    out = run_mixed(kernels, batch, scale, window)
    assert_new_kv_written(batch)
    assert_close_to_reference(out, batch, scale, window)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # 32- and 64-key tiles
@pytest.mark.parametrize("window", [None, 7, 33])
def test_contexts_around_key_tile_boundaries(kernels, dtype, window):
    """Contexts ending just before, on and after a key-tile boundary, where the unmasked middle
    of the key range meets the masked diagonal and window edges."""
    rows = [(ctx, new) for ctx in (29, 30, 31, 32, 61, 62, 63, 64) for new in (1, 3)]
    rng = random.Random(window)
    rows += [(rng.randrange(0, 150), rng.randrange(1, 40)) for _ in range(4)]
    batch = make_batch(rows, num_heads=2, num_kv_heads=1, head_size=16, dtype=DTYPES[dtype])
    out = run_mixed(kernels, batch, 0.25, window)
    assert_close_to_reference(out, batch, 0.25, window)

    decodes = [(ctx, 1) for ctx in dict.fromkeys(ctx for ctx, _ in rows)]  # each context once
    batch = make_batch(decodes, num_heads=2, num_kv_heads=1, head_size=16, dtype=DTYPES[dtype])
    out = run_decode(kernels, batch, 0.25, window, num_splits=3)
    assert_close_to_reference(out, batch, 0.25, window)


@pytest.mark.parametrize("window", [None, 20])
def test_mixed_kernel_alone_serves_a_decode_only_batch(kernels, window):
    # One-token tiles: a 16-row dot of which only the group's rows are real.
    rows = [(70, 1), (0, 1), (33, 1), (5, 1)]
    batch = make_batch(rows, num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    out = run_mixed(kernels, batch, 0.3, window)
    assert_close_to_reference(out, batch, 0.3, window)


def swapped_tiles(block_n: int, fp8_mma: bool = False):
    """`Tiles.swap_ab` (both decode products transposed), and optionally `Tiles.fp8_mma`."""
    from pagellm_triton_attn.kernels.launch import Tiles

    return Tiles(block_n=block_n, num_warps=4, num_stages=2, swap_ab=True, fp8_mma=fp8_mma)


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize(
    "dtype, head_size, num_heads, num_kv_heads, window, num_splits",
    [
        ("fp32", 16, 4, 2, None, 1),
        ("fp32", 16, 4, 2, None, 3),
        ("bf16", 32, 8, 2, None, 8),  # more splits than a short row has tiles: empty splits
        ("fp16", 64, 4, 1, 40, 4),  # sliding window: splits share only the window's tiles
        ("bf16", 128, 2, 2, None, 2),
        ("fp32", 80, 6, 2, 70, 5),
    ],
)
def test_decode_with_and_without_split_kv_matches_reference(
    kernels, dtype, head_size, num_heads, num_kv_heads, window, num_splits, swap_ab
):
    """The default kernel, and with `Tiles.swap_ab` both products transposed."""
    rows = [(300, 1), (0, 1), (63, 1), (129, 1), (16, 1)]
    batch = make_batch(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        padding_rows=2,
        seed=num_splits,
    )
    scale = head_size**-0.5
    tiles = swapped_tiles(32) if swap_ab else None
    out = run_decode(kernels, batch, scale, window, num_splits, tiles=tiles)
    assert_new_kv_written(batch)
    assert_close_to_reference(out, batch, scale, window)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:])), "padding rows must give zeros"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_swapped_decode_over_an_fp8_cache_matches_reference(kernels, num_splits):
    rows = [(130, 1), (0, 1), (47, 1), (300, 1)]
    batch = make_batch(
        rows, num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, padding_rows=1,
        seed=num_splits, fp8_scales=(0.8, 0.25),
    )  # fmt: skip
    out = run_decode(kernels, batch, 0.2, None, num_splits, tiles=swapped_tiles(32))
    assert_close_to_reference(out, batch, 0.2, None)
    assert torch.equal(out[-1:], torch.zeros_like(out[-1:])), "padding rows must give zeros"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_products_stay_within_e4m3_rounding_of_the_reference(kernels, num_splits):
    """`Tiles.fp8_mma`: the queries and the softmax weights rounded to e4m3 as well. With logits
    of order 1 (the batch's keys are about 300 * k_scale, so the softmax scale is chosen to
    undo that) the outputs stay within 3 % of the values' scale of the reference's, against
    about 0.3 % with the products in bfloat16."""
    rows = [(130, 1), (0, 1), (47, 1), (300, 1)]
    k_scale, v_scale, head_size = 0.8, 0.25, 32
    batch = make_batch(
        rows, num_heads=8, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16,
        padding_rows=1, seed=num_splits, fp8_scales=(k_scale, v_scale),
    )  # fmt: skip
    scale = 1 / (300 * k_scale * head_size**0.5)
    tiles = swapped_tiles(32, fp8_mma=True)
    out = run_decode(kernels, batch, scale, None, num_splits, tiles=tiles)
    expected = reference(batch, scale, None)
    values_scale = 300 * v_scale
    error = (out.double() - expected)[:-1].abs().max().item()
    assert error < 0.03 * values_scale, f"max error {error:.3f} (values' scale {values_scale})"
    assert torch.equal(out[-1:], torch.zeros_like(out[-1:])), "padding rows must give zeros"


def test_fp8_products_need_the_swapped_kernel_and_an_fp8_cache(kernels):
    from pagellm_triton_attn.kernels.launch import Tiles

    rows = [(20, 1)]
    bf16 = make_batch(rows, num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs swap_ab and an FP8 KV cache"):
        run_decode(kernels, bf16, 0.25, None, 1, tiles=swapped_tiles(16, fp8_mma=True))
    fp8 = make_batch(
        rows, num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.bfloat16,
        fp8_scales=(1.0, 1.0),
    )  # fmt: skip
    unswapped = Tiles(block_n=16, num_warps=4, num_stages=2, fp8_mma=True)
    with pytest.raises(ValueError, match="needs swap_ab and an FP8 KV cache"):
        run_decode(kernels, fp8, 0.25, None, 1, tiles=unswapped)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_mixed_batch_shared_between_the_two_kernels_matches_reference(kernels, num_splits):
    """Prompts and chunks in `paged_attention`, decode rows in `paged_decode`: each kernel
    leaves the other's rows alone (both write into one NaN-poisoned output)."""
    batch = make_batch(
        MIXED_ROWS, num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float16, seed=5
    )
    out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    decode_tokens = batch.query_start_loc[:-1][torch.tensor(batch.query_lens) == 1]
    run_mixed(kernels, batch, 0.2, 30, out=out, skip_decodes=True)
    assert out[decode_tokens].isnan().all(), "the mixed kernel wrote a decode row"
    run_decode(kernels, batch, 0.2, 30, num_splits, out=out)
    assert_close_to_reference(out, batch, 0.2, 30)


def test_split_kv_agrees_with_unsplit_decode(kernels):
    rows = [(500, 1), (200, 1), (31, 1)]
    kwargs = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=7)
    whole = run_decode(kernels, make_batch(rows, **kwargs), 0.125, None, 1)
    split = run_decode(kernels, make_batch(rows, **kwargs), 0.125, None, 6)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rows_taken_longest_first_give_the_same_outputs(kernels, num_splits):
    """The programs' row order (`rows_longest_first`) changes when each row runs, not what it
    computes: outputs equal the batch-order launch's, bit for bit, padding rows included."""
    rows = [(40, 1), (300, 1), (0, 1), (129, 1), (129, 1), (7, 1)]
    kwargs = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, seed=3)
    batch = make_batch(rows, padding_rows=2, **kwargs)
    order = torch.from_numpy(kernels.rows_longest_first(batch.seq_lens.numpy()))
    assert order.tolist()[:4] == [1, 3, 4, 0]  # 301, 130, 130 (row order on ties), 41 tokens
    assert sorted(order.tolist()) == list(range(len(rows) + 2))
    plain = run_decode(kernels, batch, 0.2, None, num_splits)
    ordered = run_decode(kernels, make_batch(rows, padding_rows=2, **kwargs), 0.2, None,
                         num_splits, row_order=order)  # fmt: skip
    assert torch.equal(ordered, plain)


# FP8 caches: scales of 1, powers of two and others; the contexts saturate at +-448 * scale.
# Block size 64 is the FP8 cache's default (`TritonAttentionBackend.fp8_default_block_size`).
@pytest.mark.parametrize(
    "dtype, head_size, num_heads, num_kv_heads, window, scales, block_size",
    [
        ("bf16", 32, 4, 2, None, (0.37, 1.3), 16),
        ("bf16", 32, 4, 2, None, (0.37, 1.3), 64),
        ("fp16", 64, 4, 1, 20, (1.0, 1.0), 64),
        ("fp32", 16, 2, 2, None, (2.0, 0.5), 16),
    ],
)
def test_fp8_cache_mixed_batch_matches_reference_on_the_quantized_values(
    kernels, dtype, head_size, num_heads, num_kv_heads, window, scales, block_size
):
    """The write kernel quantizes as `quantize_kv` (bit for bit, saturating), and the attention
    kernels dequantize what they read: the output is attention over the quantized K/V."""
    batch = make_batch(
        MIXED_ROWS[:4],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        block_size=block_size,
        seed=head_size,
        fp8_scales=scales,
    )
    scale = head_size**-0.5
    out = run_mixed(kernels, batch, scale, window)
    assert_new_kv_written(batch)
    assert_close_to_reference(out, batch, scale, window)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_cache_decode_with_and_without_split_kv_matches_reference(
    kernels, num_splits, block_size
):
    rows = [(130, 1), (0, 1), (47, 1)]
    batch = make_batch(
        rows,
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.bfloat16,
        block_size=block_size,
        padding_rows=1,
        seed=num_splits,
        fp8_scales=(0.8, 0.25),
    )
    out = run_decode(kernels, batch, 0.2, None, num_splits)
    assert_new_kv_written(batch)
    assert_close_to_reference(out, batch, 0.2, None)
    assert torch.equal(out[-1:], torch.zeros_like(out[-1:])), "padding rows must give zeros"


def test_kv_write_skips_padding_slots(kernels):
    batch = make_batch(
        [(20, 3)], num_heads=2, num_kv_heads=2, head_size=16, dtype=torch.float16, padding_rows=3
    )
    kernels.write_kv_cache(
        batch.key, batch.value, *kernels.split_kv_cache(batch.kv_cache), batch.slot_mapping
    )
    assert_new_kv_written(batch)


def test_num_decode_splits_fills_the_gpu_only_when_rows_are_few_and_long(kernels):
    split = kernels.num_decode_splits
    # 256 rows x 8 KV heads already give 2048 programs.
    assert split(256, 8, 8192, target_programs=528, min_keys=256) == 1
    # One long sequence: as many splits as the target asks, capped.
    assert split(1, 8, 32768, target_programs=528, min_keys=256) == 64
    assert split(4, 8, 32768, target_programs=528, min_keys=256) == 17
    # Short contexts are not split below min_keys keys a split.
    assert split(1, 8, 700, target_programs=528, min_keys=256) == 2
    assert split(1, 8, 100, target_programs=528, min_keys=256) == 1
