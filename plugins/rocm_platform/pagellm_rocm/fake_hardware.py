"""Faked AMD GPUs, for checking the ROCm platform where there is none (CI, a CUDA machine):

    pytest --pagellm-platform rocm --pagellm-fake-hardware pagellm_rocm.fake_hardware:gfx942

Faked is only what `pagellm_rocm.detection` reads before any device is touched: torch's build
(``torch.version.hip`` set, ``torch.version.cuda`` None) and amdsmi's list of GPUs (a stand-in
``amdsmi`` module). Everything else is the real code on the faked facts: the plugin hook, the
visible-device variables, the architecture table, the platform's decisions. Nothing of
``torch.cuda`` is faked, so whatever would run on a GPU (selecting it, allocating, profiling
memory, recording a HIP graph) still cannot, and the conformance kit skips the cases that would.
The platform never imports this module.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from pagellm_rocm import detection
from pagellm_rocm.arch import parse_arch

HIP_VERSION = "6.4.43482"
"""``torch.version.hip`` of a ROCm 6.4 build of torch."""


def stand_in_amdsmi(archs: list[str]) -> types.ModuleType:
    """An ``amdsmi`` module that lists one GPU of each of ``archs``."""
    module = types.ModuleType("amdsmi")
    module.amdsmi_init = module.amdsmi_shut_down = lambda: None  # type: ignore[attr-defined]
    module.amdsmi_get_processor_handles = lambda: list(range(len(archs)))  # type: ignore
    module.amdsmi_get_gpu_asic_info = lambda handle: {  # type: ignore[attr-defined]
        "target_graphics_version": archs[handle]
    }
    return module


@contextlib.contextmanager
def fake_rocm(arch: str = "gfx942", count: int = 1, hip: str = HIP_VERSION) -> Iterator[str]:
    """Within the block, this process is a ROCm build of torch on ``count`` AMD GPUs of ``arch``
    (as far as detection can tell); yields what is faked, in one line. Restores torch's version
    fields and ``sys.modules["amdsmi"]`` afterwards, and forgets the GPUs found meanwhile."""
    parse_arch(arch)  # an architecture the platform does not know is refused here already
    absent = object()
    saved: tuple[Any, Any, Any] = (
        torch.version.hip,
        torch.version.cuda,
        sys.modules.get("amdsmi", absent),
    )
    torch.version.hip, torch.version.cuda = hip, None
    sys.modules["amdsmi"] = stand_in_amdsmi([arch] * count)
    detection.physical_gpus.cache_clear()
    try:
        yield (
            f"torch.version.hip {hip!r}, torch.version.cuda None, {count} {arch} GPU(s) listed "
            "by a stand-in amdsmi; torch.cuda is not faked"
        )
    finally:
        torch.version.hip, torch.version.cuda = saved[0], saved[1]
        if saved[2] is absent:
            sys.modules.pop("amdsmi", None)
        else:
            sys.modules["amdsmi"] = saved[2]
        detection.physical_gpus.cache_clear()


def gfx942() -> contextlib.AbstractContextManager[str]:
    """One MI300X (CDNA3, gfx942: bfloat16, fp8 in float8_e4m3fnuz), the GPU pagellm-rocm's
    conformance run fakes."""
    return fake_rocm("gfx942")
