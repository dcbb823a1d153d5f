"""What an AMD GPU can do, decided from its gfx architecture name alone.

HIP names a GPU's instruction set ``gfx<major><minor><stepping>`` (``gcnArchName``, with target
features after colons: ``gfx942:sramecc+:xnack-``); the major version is every digit but the last
two, the minor and the stepping one hexadecimal digit each (``gfx90a``: 9, 0, a). Every fact the
platform needs follows from it, so these are pure functions of a string, tested on any machine:

| arch | family | GPUs | capability | wavefront | LDS | bf16 | fp8 |
|---|---|---|---|---|---|---|---|
| gfx908 | CDNA1 | MI100 | 9.0 | 64 | 64 KiB | yes | none |
| gfx90a | CDNA2 | MI210, MI250(X) | 9.0 | 64 | 64 KiB | yes | none |
| gfx942 | CDNA3 | MI300X/A, MI325X | 9.4 | 64 | 64 KiB | yes | float8_e4m3fnuz |
| gfx950 | CDNA4 | MI350X, MI355X | 9.5 | 64 | 160 KiB | yes | float8_e4m3fn |
| gfx900, gfx906 | GCN5 | Vega, MI50/MI60 | 9.0 | 64 | 64 KiB | no | none |
| gfx10xx | RDNA1/2 | Radeon RX 5000/6000 | 10.x | 32 | 64 KiB | no | none |
| gfx11xx | RDNA3 | Radeon RX 7000, W7900 | 11.x | 32 | 64 KiB | yes | none |
| gfx12xx | RDNA4 | Radeon RX 9000 | 12.x | 32 | 64 KiB | yes | float8_e4m3fn |

- **wavefront**: threads that run in lock step. CDNA (and GCN) run 64; RDNA runs 32 in the mode
  HIP and Triton compile for. Kernels size their tiles by it.
- **LDS** (local data share, what CUDA calls shared memory): what one workgroup may allocate.
- **bf16**: matrix instructions for bfloat16 (MFMA on CDNA, WMMA on RDNA3/4). Without them torch
  still computes in bfloat16, emulated and slow, so ``dtype="auto"`` picks float16 there.
- **fp8**: the float8 e4m3 flavour the matrix units compute in. CDNA3 has only the "fnuz"
  variant (no negative zero, no infinities, NaN is the bit pattern 0x80, exponent bias 8 instead
  of 7: every value is half the float8_e4m3fn value of the same bits); CDNA4 and RDNA4 use the
  OCP standard float8_e4m3fn that checkpoints are written in. pagellm-fp8 converts checkpoints
  for CDNA3 at load (`pagellm.quantization.fp8_formats`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

Family = Literal["GCN5", "CDNA1", "CDNA2", "CDNA3", "CDNA4", "RDNA1/2", "RDNA3", "RDNA4"]

KIB = 1024
_DEFAULT_LDS = 64 * KIB
_GFX = re.compile(r"gfx(?P<major>\d{1,2})(?P<minor>[0-9a-f])(?P<stepping>[0-9a-f])")
# gfx9 GPUs by exact name: the major version alone does not tell GCN5 from the CDNA generations.
_GFX9_FAMILIES: dict[str, Family] = {
    "gfx900": "GCN5",
    "gfx902": "GCN5",
    "gfx904": "GCN5",
    "gfx906": "GCN5",
    "gfx909": "GCN5",
    "gfx90c": "GCN5",
    "gfx908": "CDNA1",
    "gfx90a": "CDNA2",
    "gfx940": "CDNA3",
    "gfx941": "CDNA3",
    "gfx942": "CDNA3",
    "gfx950": "CDNA4",
}
_RDNA_FAMILIES: dict[int, Family] = {10: "RDNA1/2", 11: "RDNA3", 12: "RDNA4"}
_BF16_FAMILIES = frozenset({"CDNA1", "CDNA2", "CDNA3", "CDNA4", "RDNA3", "RDNA4"})
_FP8_E4M3: dict[Family, torch.dtype] = {
    "CDNA3": torch.float8_e4m3fnuz,
    "CDNA4": torch.float8_e4m3fn,
    "RDNA4": torch.float8_e4m3fn,
}
_LDS: dict[str, int] = {"gfx950": 160 * KIB}


class UnknownArchitectureError(ValueError):
    """A ``gcnArchName`` that is not an AMD GPU architecture pagellm knows."""


@dataclass(frozen=True)
class GfxArch:
    """The facts of one AMD GPU architecture (`parse_arch`)."""

    name: str
    """``gfx942``: the architecture without target features."""
    family: Family
    capability: tuple[int, int]
    """(major, minor) as HIP reports them (``hipDeviceProp_t.major`` / ``.minor``)."""
    wavefront_size: int
    lds_bytes: int
    has_bf16: bool
    fp8_dtype: torch.dtype | None
    """The float8 e4m3 format the matrix units compute in; None: no fp8 matrix instructions."""

    @property
    def is_cdna(self) -> bool:
        return self.family.startswith("CDNA")

    @property
    def fp8_is_fnuz(self) -> bool:
        """fp8 checkpoints (float8_e4m3fn) must be converted to this GPU's format at load."""
        return self.fp8_dtype == torch.float8_e4m3fnuz

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Model dtypes, the preferred one first (what ``dtype="auto"`` falls back to)."""
        if self.has_bf16:
            return (torch.bfloat16, torch.float16, torch.float32)
        return (torch.float16, torch.float32)


def parse_arch(gcn_arch_name: str) -> GfxArch:
    """The facts of ``gcn_arch_name`` (``gfx942:sramecc+:xnack-``, ``gfx1100``, ...).

    Raises `UnknownArchitectureError` for a name that is not ``gfx<major><minor><stepping>`` or
    whose generation is not in the table (pre-GCN5, or a gfx9 name HIP does not use)."""
    name = gcn_arch_name.strip().split(":", 1)[0].lower()
    match = _GFX.fullmatch(name)
    if match is None:
        raise UnknownArchitectureError(
            f"{gcn_arch_name!r} is not an AMD GPU architecture name (expected gfx<major><minor>"
            "<stepping>, e.g. gfx942 or gfx1100, as torch.cuda.get_device_properties(i)"
            ".gcnArchName reports on a ROCm build of torch)."
        )
    major = int(match["major"])
    capability = (major, int(match["minor"], 16))
    family = _GFX9_FAMILIES.get(name) if major == 9 else _RDNA_FAMILIES.get(major)
    if family is None:
        raise UnknownArchitectureError(
            f"AMD GPU architecture {name} (capability {capability[0]}.{capability[1]}) is not "
            "one pagellm knows: the ROCm platform supports GCN5 and CDNA (gfx900-gfx950) and "
            "RDNA (gfx10xx-gfx12xx). Add it to pagellm_rocm.arch if ROCm supports it."
        )
    return GfxArch(
        name=name,
        family=family,
        capability=capability,
        wavefront_size=64 if major == 9 else 32,
        lds_bytes=_LDS.get(name, _DEFAULT_LDS),
        has_bf16=family in _BF16_FAMILIES,
        fp8_dtype=_FP8_E4M3.get(family),
    )


def arch_from_target_version(version: int) -> str:
    """The gfx name of a KFD ``gfx_target_version`` (``major * 10000 + minor * 100 +
    stepping``, decimal): 90402 → gfx942, 90010 → gfx90a, 110000 → gfx1100."""
    major, rest = divmod(version, 10000)
    minor, stepping = divmod(rest, 100)
    return f"gfx{major}{minor:x}{stepping:x}"
