"""GGUF blocks repacked once, after loading, into aligned planes that stay quantized.

A GGUF row is a run of 18-210-byte blocks (scales and codes interleaved, not 4-byte aligned), so a
kernel reading them loads every byte on its own. The planes put each field in its own
column-major array, ``[rows of K, N]`` with the N output features contiguous (coalesced loads
along N), in 32-bit words:

- ``codes`` int32 ``[K / per_word, N]``: word ``r`` of column ``n`` holds input rows
  ``per_word * r + i`` (``i`` from the low bits up): eight 4-bit codes (Q4_0, Q4_1, and the low
  nibbles of the K-quants) or four int8 codes (Q8_0);
- ``high`` int32 ``[K * high_bits / 32, N]`` (Q5_K: 1 bit, Q6_K: 2 bits): the codes' bits above
  the nibble, word ``r`` holding rows ``32 / high_bits * r + j`` from the low bits up;
- ``scale`` (and ``bias``) ``[K / group, N]``: ``w = (q - offset) * scale + bias`` for the
  ``group`` (32; Q6_K 16) input rows sharing them.

Each plane value is the exact float32 value the `gguf` package's numpy dequantizer computes
(``gguf.quants``: Q4_K's ``d * sc`` is a float32 product of a float16 and a 6-bit integer, exact,
so it is stored as float32; Q4_0/Q4_1/Q8_0's scales are the file's float16 values, stored as
float16), and the kernels apply them in the same float32 operations: the weights they decode
equal numpy's bit for bit. Bytes per weight are in ``bytes_per_weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from pagellm_gguf.block_types import block_shape, type_name


@dataclass(frozen=True)
class PlaneLayout:
    """How a GGUF type's planes encode a weight: the kernels' compile-time constants."""

    code_bits: int  # bits per code in ``codes`` (4 or 8)
    signed: bool  # codes are two's-complement (Q8_0's int8)
    high_bits: int  # bits per code in ``high`` (0: no high plane)
    group: int  # input rows per scale (and bias)
    offset: int  # subtracted from the code before scaling (Q4_0: 8, Q6_K: 32)
    has_bias: bool
    scale_dtype: torch.dtype

    @property
    def per_word(self) -> int:
        return 32 // self.code_bits

    def bytes_per_weight(self) -> float:
        scale_bytes = torch.tensor([], dtype=self.scale_dtype).element_size()
        per_group = scale_bytes * (2 if self.has_bias else 1)
        return (self.code_bits + self.high_bits) / 8 + per_group / self.group


LAYOUTS: dict[int, PlaneLayout] = {
    int(T.Q4_0): PlaneLayout(4, False, 0, 32, 8, False, torch.float16),
    int(T.Q4_1): PlaneLayout(4, False, 0, 32, 0, True, torch.float16),
    int(T.Q8_0): PlaneLayout(8, True, 0, 32, 0, False, torch.float16),
    int(T.Q4_K): PlaneLayout(4, False, 0, 32, 0, True, torch.float32),
    int(T.Q5_K): PlaneLayout(4, False, 1, 32, 0, True, torch.float32),
    int(T.Q6_K): PlaneLayout(4, False, 2, 16, 32, False, torch.float32),
}

_CHUNK_ROWS = 4096
"""Output features repacked at a time: bounds the temporaries (a few bytes per weight) at load."""


@dataclass
class GGUFPlanes:
    """One weight matrix [out_features, in_features] of GGUF type ``qtype`` as planes."""

    qtype: int
    in_features: int
    out_features: int
    codes: torch.Tensor
    high: torch.Tensor | None
    scale: torch.Tensor
    bias: torch.Tensor | None

    @property
    def layout(self) -> PlaneLayout:
        return LAYOUTS[self.qtype]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The planes by name (``codes``, ``high``, ``scale``, ``bias``), those the type has."""
        named = {"codes": self.codes, "high": self.high, "scale": self.scale, "bias": self.bias}
        return {name: t for name, t in named.items() if t is not None}


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 field at byte ``at`` of each block [rows, blocks, bytes], as float32."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Codes of bytes [rows, blocks, n]: in runs of ``run`` bytes, the low nibbles of the run's
    bytes, then their high nibbles (llama.cpp's order), as uint8 [rows, blocks, 2 n]."""
    rows, blocks, n = qs.shape
    runs = qs.reshape(rows, blocks, n // run, 1, run)
    return torch.cat([runs & 15, runs >> 4], dim=3).reshape(rows, blocks, 2 * n)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of Q4_K/Q5_K super-blocks' 12 scale bytes [..., 12]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return scales.float(), mins.float()


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, K] small unsigned codes (uint8) into int32 words [K * bits / 32, rows], word ``r``
    holding codes ``32 / bits * r + i`` from the low bits up (little-endian bytes)."""
    rows, k = values.shape
    per_byte = 8 // bits
    grouped = values.reshape(rows, k // per_byte, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=values.device) * bits
    packed = (grouped << shifts).sum(-1).to(torch.uint8)  # [rows, K / per_byte] bytes
    words = packed.t().reshape(-1, 4, rows).permute(0, 2, 1).contiguous()
    return words.view(torch.int32)[..., 0]


def _planes_of(blocks: torch.Tensor, qtype: int) -> dict[str, torch.Tensor]:
    """Codes (uint8 [rows, K]), high bits, scales and biases [rows, groups] of raw blocks
    [rows, blocks, type_size], computed as ``gguf.quants`` does."""
    rows, nb, _ = blocks.shape
    if qtype in (T.Q4_0, T.Q4_1):
        first = 2 if qtype == T.Q4_0 else 4
        out = {"codes": _nibbles(blocks[..., first:], 16).reshape(rows, -1)}
        out["scale"] = _f16(blocks, 0)
        if qtype == T.Q4_1:
            out["bias"] = _f16(blocks, 2)
        return out
    if qtype == T.Q8_0:
        return {"codes": blocks[..., 2:].reshape(rows, -1), "scale": _f16(blocks, 0)}
    if qtype in (T.Q4_K, T.Q5_K):
        first = 16 if qtype == T.Q4_K else 48
        out = {"codes": _nibbles(blocks[..., first:], 32).reshape(rows, -1)}
        scales, mins = _k_scale_min(blocks[..., 4:16])
        out["scale"] = (_f16(blocks, 0)[..., None] * scales).reshape(rows, -1)
        out["bias"] = -(_f16(blocks, 2)[..., None] * mins).reshape(rows, -1)
        if qtype == T.Q5_K:
            # Bit s of high byte j is the fifth bit of weight 32 s + j of the super-block.
            qh = blocks[..., 16:48]
            bits = torch.stack([(qh >> s) & 1 for s in range(8)], dim=2)
            out["high"] = bits.reshape(rows, -1)
        return out
    if qtype == T.Q6_K:
        # Weight 128 h + 64 s + t: nibble s of ql[64 h + t]; weight 128 h + 32 s + t: bits
        # 2 s, 2 s + 1 of qh[32 h + t]; one int8 scale per 16 weights times d.
        out = {"codes": _nibbles(blocks[..., :128], 64).reshape(rows, -1)}
        qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32)
        high = torch.cat([(qh >> (2 * s)) & 3 for s in range(4)], dim=3)
        out["high"] = high.reshape(rows, -1)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
        out["scale"] = (_f16(blocks, 208)[..., None] * scales).reshape(rows, -1)
        return out
    raise ValueError(f"GGUF type {type_name(qtype)} has no plane layout.")


def repack(blocks: torch.Tensor, qtype: int, in_features: int) -> GGUFPlanes:
    """The planes of raw GGUF rows ``blocks`` (uint8 [out_features, bytes per row]) of type
    ``qtype``, on ``blocks``' device."""
    if qtype not in LAYOUTS:
        raise ValueError(f"GGUF type {type_name(qtype)} has no plane layout.")
    block_size, type_size = block_shape(qtype)
    if in_features % block_size:
        raise ValueError(
            f"in_features={in_features} is not a whole number of {block_size}-weight blocks."
        )
    row_bytes = in_features // block_size * type_size
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
        raise ValueError(
            f"GGUF blocks must be uint8 rows of {row_bytes} bytes, got {blocks.dtype} "
            f"{tuple(blocks.shape)}."
        )
    layout = LAYOUTS[qtype]
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, blocks.shape[0], _CHUNK_ROWS):
        chunk = blocks[start : start + _CHUNK_ROWS].reshape(-1, row_bytes // type_size, type_size)
        for name, value in _planes_of(chunk, qtype).items():
            if name == "codes":
                value = _pack(value, 8) if layout.code_bits == 8 else _pack(value, 4)
            elif name == "high":
                value = _pack(value, layout.high_bits)
            else:  # scale, bias: [rows, groups] -> [groups, rows]
                value = value.to(layout.scale_dtype).t()
            parts.setdefault(name, []).append(value)
    planes = {name: torch.cat(values, dim=1).contiguous() for name, values in parts.items()}
    return GGUFPlanes(
        qtype=qtype,
        in_features=in_features,
        out_features=blocks.shape[0],
        codes=planes["codes"],
        high=planes.get("high"),
        scale=planes["scale"],
        bias=planes.get("bias"),
    )
