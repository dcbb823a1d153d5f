"""Whether this process runs on AMD GPUs, found without initialising HIP.

The platform plugin is asked in every process (API server, engine core) before any worker is
forked, and a process whose HIP runtime is initialised cannot hand its GPUs to a forked child.
So the GPUs are counted where no runtime is involved:

1. ``amdsmi`` (AMD's management library, through its Python wrapper), when it imports and
   initialises: the wrapper on the package index imports without the library and fails at
   ``amdsmi_init``; any failure is "not available" and the next source is tried;
2. the kernel driver's topology in sysfs (``/sys/class/kfd/kfd/topology/nodes/*/properties``):
   a node with SIMDs is a GPU, and ``gfx_target_version`` is its architecture.

Both see every physical GPU, so the visible-device variables are applied afterwards
(`pagellm_rocm.visible`). None of this runs unless torch is a ROCm build (``torch.version.hip``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm_rocm.arch import arch_from_target_version
from pagellm_rocm.visible import visible_devices

logger = logging.getLogger(__name__)

KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


@dataclass(frozen=True)
class PhysicalGpus:
    """The machine's AMD GPUs, in physical order."""

    archs: list[str]
    """gfx name of each GPU (``gfx942``); empty strings where the source did not say."""
    source: str
    """Where they were found: ``amdsmi`` or ``sysfs``."""


def probe_amdsmi() -> PhysicalGpus | str:
    """The GPUs amdsmi lists, or why amdsmi cannot be asked."""
    try:
        amdsmi = importlib.import_module("amdsmi")
        amdsmi.amdsmi_init()
    except Exception as exc:  # the wrapper raises its own types when the library is missing
        return f"amdsmi is not available ({type(exc).__name__}: {exc})"
    try:
        handles = amdsmi.amdsmi_get_processor_handles()
        archs = []
        for handle in handles:
            info = amdsmi.amdsmi_get_gpu_asic_info(handle)
            archs.append(str(info.get("target_graphics_version", "")).strip())
        return PhysicalGpus(archs, "amdsmi")
    except Exception as exc:
        return f"amdsmi failed to list the GPUs ({type(exc).__name__}: {exc})"
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception as exc:
            logger.debug("amdsmi_shut_down failed: %s", exc)


def _properties(path: Path) -> dict[str, int]:
    facts = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            facts[key] = int(value)
    return facts


def probe_sysfs(nodes: Path | None = None) -> PhysicalGpus | str:
    """The GPU nodes of the driver's topology (`KFD_NODES` by default), or why there are none
    to read."""
    nodes = KFD_NODES if nodes is None else nodes
    if not nodes.is_dir():
        return f"{nodes} does not exist (no amdgpu kernel driver, or /dev/kfd not passed through)"
    archs = []
    entries = sorted((p for p in nodes.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    for node in entries:
        try:
            facts = _properties(node / "properties")
        except OSError as exc:
            return f"cannot read {node / 'properties'} ({exc})"
        if facts.get("simd_count", 0) > 0:  # CPU nodes have none
            version = facts.get("gfx_target_version", 0)
            archs.append(arch_from_target_version(version) if version else "")
    if not archs:
        return f"{nodes} lists no GPU node"
    return PhysicalGpus(archs, "sysfs")


@functools.cache
def physical_gpus() -> PhysicalGpus | str:
    """The machine's AMD GPUs (amdsmi first, then sysfs), or why none were found. Asked once per
    process: the hardware does not change, the visible-device variables may (see `detect`)."""
    found = probe_amdsmi()
    if isinstance(found, PhysicalGpus):
        return found
    fallback = probe_sysfs()
    if isinstance(fallback, PhysicalGpus):
        logger.debug("%s; counted the GPUs in sysfs instead.", found)
        return fallback
    return f"no AMD GPU found: {found}; {fallback}"


@dataclass(frozen=True)
class Detection:
    """What `detect` found: the visible GPUs, or why the platform is inactive."""

    physical: list[int | str]
    """Physical ids of the visible GPUs, in torch's order."""
    archs: list[str]
    """Their gfx names, where known (one per visible GPU)."""
    inactive_reason: str | None


def detect(env: Mapping[str, str] | None = None) -> Detection:
    """The AMD GPUs this process sees under ``env`` (the process environment by default)."""
    env = os.environ if env is None else env
    if torch.version.hip is None:
        reason = "torch is not a ROCm build (torch.version.hip is None)"
        if torch.version.cuda is not None:
            reason += f"; it is a CUDA build ({torch.version.cuda}): the cuda platform serves it"
        return Detection([], [], reason)
    gpus = physical_gpus()
    if isinstance(gpus, str):
        return Detection([], [], gpus)
    visible = visible_devices(env, len(gpus.archs))
    if not visible.physical:
        return Detection(
            [],
            [],
            f"no AMD GPU is visible of the {len(gpus.archs)} present ({visible.description})",
        )
    archs = [gpus.archs[i] if isinstance(i, int) else "" for i in visible.physical]
    return Detection(visible.physical, archs, None)
