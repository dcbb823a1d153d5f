"""The tiles of the fused W4A16 GEMM: a table measured per GPU (``configs/<device name>.json``,
written by ``benchmarks/int4_gemm.py --sweep``) for the shapes it lists, else a rule."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from pagellm_int4.kernel_layout import TILE_K

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TileConfig:
    kind: str
    """``dot`` (tensor cores), ``dot_t`` (tensor cores, the product transposed so that the
    weights are the A operand; with the inline PTX only, else as ``dot``) or ``fma`` (CUDA
    cores, BLOCK_M of 1 to 8 rows)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    """Programs sharing one output tile, each over its own run of K tiles; their float32 partial
    sums are added in a fixed order by a second kernel (deterministic, unlike atomics)."""
    num_warps: int
    num_stages: int
    unpack: str = "asm"
    """How a program turns a word tile into eight slabs of codes: ``asm`` (inline PTX: two byte
    permutes, then one shift, one LOP3 and one packed FMA per two codes, leaving ``q - z``) or
    ``shift`` (Triton ops, one code at a time); both build the float bits of ``offset + code``
    directly, with no int-to-float conversion (a quarter-rate instruction that bounded the
    first kernel). The interpreter, groups shorter than a tile and float32 activations always
    use ``shift``."""
    reduce: str = "serial"
    """How split-K partial sums meet: ``serial`` (the last program of an output tile to finish
    adds them, counted by an atomic per tile: one launch) or ``kernel`` (a second launch)."""
    chains: int = 1
    """Dependent MMA chains a tensor-core K tile is summed in: 1 (the eight slabs into one
    accumulator) or 2 (even and odd slabs apart, added once a tile: half the chain's latency
    for eight more additions)."""


SPLIT_K_MAX_M = 16
"""Split-K only up to this M: its float32 workspace (split_k x M x N) stays small next to the
weight it helps stream."""


def scales_per_tile(k: int, group_size: int, block_k: int) -> bool:
    """Every K tile lies in one group: one scale and zero row per tile."""
    return group_size >= k or group_size % block_k == 0


def _rule(m: int, n: int, k: int, group_size: int, num_sms: int) -> TileConfig:
    """Without a measured table: tensor cores (the fastest kind at every M the first H200 sweep
    measured), 128 columns a program; K split until there are about four programs per SM to
    keep enough weight reads in flight (a decode GEMM of N = 4096 has only 32 column tiles),
    each run keeping two K tiles. Groups shorter than a tile stage a scale and a zero per weight
    through shared memory: 64 columns and two stages there (128 and three overflow the H200's
    227 KB at 64 rows)."""
    kind = "dot"
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    per_tile = scales_per_tile(k, group_size, TILE_K)
    block_n, block_k = (128, TILE_K) if per_tile else (64, TILE_K)
    stages = 3 if per_tile else 2
    programs = _cdiv(m, block_m) * _cdiv(n, block_n)
    split = 1
    while m <= SPLIT_K_MAX_M and programs * split * 2 <= 4 * num_sms and k >= split * 4 * block_k:
        split *= 2
    return TileConfig(kind, block_m, block_n, block_k, split, 4, stages)


TENSOR_CORE_KINDS = ("dot", "dot_t")

SAFE_TILES = TileConfig("dot", 16, 64, TILE_K, 1, 4, 1)
"""What a launch falls back to when its tiles do not fit the GPU (`OutOfResources`): one
stage, narrow tiles (block_m is kept)."""


def _device_file(name: str) -> Path:
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".json")


@functools.cache
def measured_table(device_name: str) -> dict[str, list[tuple[int, TileConfig]]]:
    """``"N,K,group"`` -> [(largest M, tiles)] sorted by M, from the device's table if shipped."""
    path = _device_file(device_name)
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {
        shape: sorted((int(m), TileConfig(**cfg)) for m, cfg in by_m.items())
        for shape, by_m in raw["tiles"].items()
    }


def tile_config(
    m: int, n: int, k: int, group_size: int, num_sms: int, device_name: str = ""
) -> TileConfig:
    """The tiles for an [M, K] x [K, N] int4 GEMM: the measured table's entry for the smallest
    listed M >= m of this shape and group size, else `_rule`."""
    entries = measured_table(device_name).get(f"{n},{k},{group_size}") if device_name else None
    for largest_m, cfg in entries or ():
        if m <= largest_m:
            return cfg
    return _rule(m, n, k, group_size, num_sms)


def table_entry(cfg: TileConfig) -> dict[str, int | str]:
    return asdict(cfg)
