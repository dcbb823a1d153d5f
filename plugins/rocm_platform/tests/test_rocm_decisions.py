"""The ROCm platform's decision tables, on any machine: architecture → capability, family,
wavefront, LDS, dtypes and fp8 format; the dtype for ``dtype="auto"``; and the attention ranking.
(The conversion of fp8 checkpoints to CDNA3's float8_e4m3fnuz is the core's:
tests/quantization/test_fp8_formats.py.)

No AMD GPU exists where these run: the inputs are the strings and flags a GPU would report
(``gcnArchName``, KFD's ``gfx_target_version``, whether a library imports), written out by hand.
"""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest
import torch
from pagellm_rocm.arch import UnknownArchitectureError, arch_from_target_version, parse_arch
from pagellm_rocm.attention import attention_ranking
from pagellm_rocm.platform import auto_dtype

FNUZ, FN = torch.float8_e4m3fnuz, torch.float8_e4m3fn
KIB = 1024

# arch name as HIP reports it → family, capability, wavefront, LDS, bf16, fp8 format
ARCHS = [
    ("gfx942:sramecc+:xnack-", "gfx942", "CDNA3", (9, 4), 64, 64 * KIB, True, FNUZ),
    ("gfx950:sramecc+:xnack-", "gfx950", "CDNA4", (9, 5), 64, 160 * KIB, True, FN),
    ("gfx90a:sramecc+:xnack-", "gfx90a", "CDNA2", (9, 0), 64, 64 * KIB, True, None),
    ("gfx908", "gfx908", "CDNA1", (9, 0), 64, 64 * KIB, True, None),
    ("gfx906", "gfx906", "GCN5", (9, 0), 64, 64 * KIB, False, None),
    ("gfx1030", "gfx1030", "RDNA1/2", (10, 3), 32, 64 * KIB, False, None),
    ("gfx1100", "gfx1100", "RDNA3", (11, 0), 32, 64 * KIB, True, None),
    ("gfx1151", "gfx1151", "RDNA3", (11, 5), 32, 64 * KIB, True, None),
    ("gfx1201", "gfx1201", "RDNA4", (12, 0), 32, 64 * KIB, True, FN),
]


@pytest.mark.parametrize(
    ("reported", "name", "family", "capability", "wavefront", "lds", "bf16", "fp8"),
    ARCHS,
    ids=[row[1] for row in ARCHS],
)
def test_architecture_facts(reported, name, family, capability, wavefront, lds, bf16, fp8):
    arch = parse_arch(reported)
    assert (arch.name, arch.family, arch.capability) == (name, family, capability)
    assert (arch.wavefront_size, arch.lds_bytes) == (wavefront, lds)
    assert (arch.has_bf16, arch.fp8_dtype) == (bf16, fp8)
    assert arch.fp8_is_fnuz == (fp8 == FNUZ)
    assert arch.is_cdna == family.startswith("CDNA")
    expected = (torch.bfloat16, torch.float16, torch.float32) if bf16 else (torch.float16,)
    assert arch.supported_dtypes[: len(expected)] == expected
    assert torch.float32 in arch.supported_dtypes
    assert (torch.bfloat16 in arch.supported_dtypes) == bf16


@pytest.mark.parametrize(
    ("reported", "message"),
    [
        ("sm_90", "is not an AMD GPU architecture name"),
        ("gfx9", "is not an AMD GPU architecture name"),
        ("", "is not an AMD GPU architecture name"),
        ("gfx803", r"gfx803 \(capability 8.0\) is not one pagellm knows"),
        ("gfx1300", r"gfx1300 \(capability 13.0\) is not one pagellm knows"),
        ("gfx9ff", "gfx9ff"),
    ],
)
def test_unknown_architectures_are_refused_by_name(reported, message):
    with pytest.raises(UnknownArchitectureError, match=message):
        parse_arch(reported)


@pytest.mark.parametrize(
    ("version", "name"),
    [(90402, "gfx942"), (90010, "gfx90a"), (90500, "gfx950"), (110000, "gfx1100"),
     (120001, "gfx1201"), (100300, "gfx1030")],
)  # fmt: skip
def test_kfd_target_versions_name_the_architecture(version, name):
    assert arch_from_target_version(version) == name
    parse_arch(name)  # and the table knows it


@pytest.mark.parametrize(
    ("checkpoint", "arch", "expected"),
    [
        (torch.float16, "gfx942", torch.float16),
        (torch.bfloat16, "gfx942", torch.bfloat16),
        (torch.float32, "gfx942", torch.bfloat16),
        (None, "gfx1100", torch.bfloat16),
        (torch.bfloat16, "gfx1030", torch.float16),  # no bf16 matrix instructions
        (torch.float32, "gfx906", torch.float16),
        (torch.float16, "gfx950", torch.float16),
    ],
)
def test_auto_dtype_prefers_bfloat16_where_the_architecture_has_it(checkpoint, arch, expected):
    assert auto_dtype(checkpoint, parse_arch(arch)) == expected


def spec_of(*present: str):
    return lambda name: ModuleSpec(name, None) if name in present else None


def test_ranking_puts_triton_first_and_leaves_out_what_does_not_import():
    ranking, left_out = attention_ranking(spec_of())
    assert ranking == ["TRITON_ATTN", "TORCH_SDPA"]
    assert set(left_out) == {"FLASH_ATTN", "ROCM_AITER_FA"}
    assert "flash_attn is not installed" in left_out["FLASH_ATTN"]
    assert "aiter" in left_out["ROCM_AITER_FA"]


@pytest.mark.parametrize(
    ("present", "ranking"),
    [
        (("flash_attn",), ["TRITON_ATTN", "FLASH_ATTN", "TORCH_SDPA"]),
        (("aiter",), ["TRITON_ATTN", "ROCM_AITER_FA", "TORCH_SDPA"]),
        (("flash_attn", "aiter"), ["TRITON_ATTN", "FLASH_ATTN", "ROCM_AITER_FA", "TORCH_SDPA"]),
    ],
)
def test_ranking_adds_the_rocm_libraries_that_import_after_triton(present, ranking):
    got, left_out = attention_ranking(spec_of(*present))
    assert got == ranking
    assert not set(left_out) & set(got)


def test_ranking_asks_the_real_import_system():
    """What this machine has installed decides (in CI: neither library, both left out)."""
    installed = [m for m in ("flash_attn", "aiter") if importlib.util.find_spec(m) is not None]
    assert attention_ranking() == attention_ranking(spec_of(*installed))
