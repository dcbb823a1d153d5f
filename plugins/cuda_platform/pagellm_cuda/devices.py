"""Which CUDA devices exist, and how a device id maps between the three namespaces.

- **logical**: the id pagellm uses, a worker's local rank;
- **visible**: torch's ``cuda:N`` index in this process, after ``CUDA_VISIBLE_DEVICES`` has hidden and
  reordered devices. pagellm does not remap ranks, so a logical id *is* the visible index; mapping
  one to the other only checks that the device exists;
- **physical**: what ``nvidia-smi`` and NVML call the device: an index on the whole machine, or the
  UUID (``GPU-...``, ``MIG-...``) that ``CUDA_VISIBLE_DEVICES`` named it by.

The mapping functions are pure (they take the environment and the device count as arguments), so
they are tested on machines without a GPU; `cuda_device_count` is the only one that asks torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"


class CudaDeviceError(ValueError):
    """A device id that names no visible CUDA device."""


def cuda_device_count() -> int:
    """Number of CUDA devices this process can see, without initialising CUDA where possible.

    Not ``torch.cuda.is_available()``: by default it calls ``cudaGetDeviceCount``, which initialises
    the CUDA driver and marks the process so that a forked child can no longer use CUDA. The
    platform plugin is asked in every process (API server, engine core) before any worker is
    started, so that check would break forking workers later. ``torch.cuda.device_count()`` counts
    devices through NVML (honouring ``CUDA_VISIBLE_DEVICES``) and only falls back to the CUDA
    runtime when NVML is unavailable; this is the check ``is_available()`` itself makes under
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``. ROCm builds of torch also answer through ``torch.cuda``;
    they are left to a ROCm platform, so they count as zero here, as do CPU-only builds.
    """
    if torch.version.cuda is None or torch.version.hip is not None:
        return 0
    return torch.cuda.device_count()


def inactive_reason(env: Mapping[str, str]) -> str | None:
    """Why the CUDA platform is inactive in this process, or None when it has a GPU. A ROCm build
    of torch also answers through ``torch.cuda``; its GPUs are the ``rocm`` platform's
    (pagellm-rocm), so the two are never active together."""
    if torch.version.hip is not None:
        return (
            f"torch is a ROCm build (torch.version.hip {torch.version.hip}): AMD GPUs are the "
            "rocm platform's (pip install pagellm-rocm)"
        )
    if torch.version.cuda is None:
        return "torch is not a CUDA build (torch.version.cuda is None)"
    if cuda_device_count() == 0:
        value = env.get(VISIBLE_DEVICES_VAR)
        shown = "unset" if value is None else repr(value)
        return f"no CUDA device is visible ({VISIBLE_DEVICES_VAR} {shown})"
    return None


def parse_visible_devices(value: str | None) -> list[int | str] | None:
    """The ids a ``CUDA_VISIBLE_DEVICES`` value lists, or None when it hides nothing.

    Unset and the empty string both mean "every device, in physical order" (for CUDA itself an
    empty value hides every device, so torch then counts none and this plugin stays inactive; an
    empty value is what Ray sets for a CPU-only placement group). Integer ids become ints; other
    ids (``GPU-<uuid>``, ``MIG-<uuid>``) are passed through as stripped strings. As in CUDA, a
    negative id ends the list: ``-1`` hides every device.
    """
    if value is None or not value.strip():
        return None
    ids: list[int | str] = []
    for item in value.split(","):
        item = item.strip()
        try:
            number = int(item)
        except ValueError:
            ids.append(item)
            continue
        if number < 0:
            break
        ids.append(number)
    return ids


def visible_device_ids(env: Mapping[str, str], num_devices: int) -> list[int | str]:
    """Physical ids of the visible devices, in visible order.

    ``num_devices`` is how many devices CUDA exposes to this process (``cuda_device_count()``): all
    of them when nothing is hidden; otherwise CUDA exposes only the leading ids of the list that
    name real devices, so the list is cut there.
    """
    listed = parse_visible_devices(env.get(VISIBLE_DEVICES_VAR))
    if listed is None:
        return list(range(num_devices))
    return listed[:num_devices]


def visible_device_id(logical: int, env: Mapping[str, str], num_devices: int) -> int:
    """torch's ``cuda:N`` index for ``logical`` (the same number), once checked to exist."""
    visible = visible_device_ids(env, num_devices)
    if 0 <= logical < len(visible):
        return logical
    value = env.get(VISIBLE_DEVICES_VAR)
    shown = "unset" if value is None else repr(value)
    if visible:
        seen = f"{len(visible)} CUDA device(s) are visible (physical ids {visible})"
        fix = (
            f"Use a device index from 0 to {len(visible) - 1}, or make more devices visible "
            f"with {VISIBLE_DEVICES_VAR}."
        )
    else:
        seen = "no CUDA device is visible"
        fix = f"Check the GPU with nvidia-smi and that {VISIBLE_DEVICES_VAR} names real devices."
    raise CudaDeviceError(
        f"CUDA device {logical} does not exist: {seen} ({VISIBLE_DEVICES_VAR} {shown}). {fix}"
    )


def physical_device_id(logical: int, env: Mapping[str, str], num_devices: int) -> int | str:
    """The physical id (index or UUID) of the device pagellm calls ``logical``."""
    return visible_device_ids(env, num_devices)[visible_device_id(logical, env, num_devices)]
