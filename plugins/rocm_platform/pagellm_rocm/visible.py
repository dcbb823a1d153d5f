"""Which AMD GPUs a process may use, from three environment variables, and how a device id maps
between pagellm's, torch's and the machine's namespaces.

ROCm hides devices at two levels:

- ``ROCR_VISIBLE_DEVICES``, read by the ROCr (HSA) runtime: physical indices (what ``amd-smi``
  lists) or UUIDs (``GPU-...``);
- ``HIP_VISIBLE_DEVICES``, read by HIP above it: indices into the devices ROCr left visible.
  HIP also reads ``CUDA_VISIBLE_DEVICES`` (with the same meaning), which is what CUDA-minded
  tools such as Ray set.

The rules (vLLM's, for its ROCm platform): an empty value counts as unset. When both
``HIP_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES`` are set they must agree, else it is an error
naming both; when one is set, `synced_variables` gives the other the same value so that every
library and child process sees one list. An index past the devices ROCr leaves visible is an error
naming both levels' variables. Lists follow CUDA's grammar (`pagellm_cuda.devices`): integers or
UUIDs, separated by commas, a negative index ending the list.

The namespaces: **logical** is pagellm's id (a worker's local rank); **visible** is torch's
``cuda:N`` index, the same number, once checked to exist; **physical** is the machine's id, after
both levels: ``rocr[hip[logical]]``. Everything here is a pure function of the environment and
the machine's device count, tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagellm_cuda.devices import parse_visible_devices

HIP_VAR = "HIP_VISIBLE_DEVICES"
CUDA_VAR = "CUDA_VISIBLE_DEVICES"
ROCR_VAR = "ROCR_VISIBLE_DEVICES"

DeviceId = int | str


class RocmVisibleDevicesError(ValueError):
    """The visible-device variables contradict each other, or name no device."""


def _value(env: Mapping[str, str], var: str) -> str | None:
    """The variable's value without blanks; None when unset or empty."""
    raw = env.get(var)
    if raw is None or not raw.strip():
        return None
    return ",".join(item.strip() for item in raw.split(","))


def _hip_value(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(value, the variable it comes from) of the HIP-level list."""
    hip, cuda = _value(env, HIP_VAR), _value(env, CUDA_VAR)
    if hip is not None and cuda is not None and hip != cuda:
        raise RocmVisibleDevicesError(
            f"{HIP_VAR}={hip!r} and {CUDA_VAR}={cuda!r} disagree; on ROCm both select the same "
            f"devices. Set only one of them, or give both the same value."
        )
    if hip is not None:
        return hip, HIP_VAR
    return cuda, None if cuda is None else CUDA_VAR


def synced_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The assignments that make ``HIP_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES`` agree (the
    unset one takes the other's value); empty when nothing needs setting. Raises
    `RocmVisibleDevicesError` when they are both set and disagree."""
    value, source = _hip_value(env)
    if value is None or source is None:
        return {}
    other = CUDA_VAR if source == HIP_VAR else HIP_VAR
    return {} if _value(env, other) == value else {other: value}


@dataclass(frozen=True)
class VisibleDevices:
    """The devices this process sees, as physical ids in torch's (visible) order."""

    physical: list[DeviceId]
    description: str
    """The variables that decided it, for messages (``HIP_VISIBLE_DEVICES='1,0'``, ``none set``)."""


def visible_devices(env: Mapping[str, str], num_physical: int) -> VisibleDevices:
    """Apply ``ROCR_VISIBLE_DEVICES``, then the HIP-level list, to ``num_physical`` devices.

    As the runtime does, indices at or past the devices that exist end a list (devices after
    them are hidden too). A HIP-level index past what ``ROCR_VISIBLE_DEVICES`` leaves visible is
    a contradiction between the two, raised as `RocmVisibleDevicesError`."""
    hip_value, hip_var = _hip_value(env)
    rocr_value = _value(env, ROCR_VAR)
    shown = [f"{ROCR_VAR}={rocr_value!r}"] if rocr_value is not None else []
    if hip_var is not None:
        shown.append(f"{hip_var}={hip_value!r}")
    description = ", ".join(shown) or f"none of {HIP_VAR}, {CUDA_VAR}, {ROCR_VAR} set"

    rocr = _existing(parse_visible_devices(rocr_value), num_physical)
    level1: list[DeviceId] = list(range(num_physical)) if rocr is None else rocr
    hip = parse_visible_devices(hip_value)
    if hip is None:
        return VisibleDevices(level1, description)
    physical: list[DeviceId] = []
    for item in hip:
        if isinstance(item, str):
            physical.append(item)  # a UUID names a physical device whatever ROCr hides
        elif item < len(level1):
            physical.append(level1[item])
        elif rocr is not None:
            raise RocmVisibleDevicesError(
                f"{hip_var}={hip_value!r} selects device {item}, but {ROCR_VAR}={rocr_value!r} "
                f"leaves only {len(level1)} device(s) visible, which {hip_var} indexes from 0. "
                f"Index the devices {ROCR_VAR} lists (0 to {len(level1) - 1}), or unset one of "
                "the two variables."
            )
        else:
            break  # past the machine's devices: hidden, as HIP does
    return VisibleDevices(physical, description)


def _existing(ids: list[DeviceId] | None, num_physical: int) -> list[DeviceId] | None:
    if ids is None:
        return None
    for position, item in enumerate(ids):
        if isinstance(item, int) and item >= num_physical:
            return ids[:position]
    return ids


def visible_device_id(logical: int, env: Mapping[str, str], num_physical: int) -> int:
    """torch's ``cuda:N`` index for ``logical`` (the same number), once checked to exist."""
    visible = visible_devices(env, num_physical)
    if 0 <= logical < len(visible.physical):
        return logical
    if visible.physical:
        seen = f"{len(visible.physical)} AMD GPU(s) are visible (physical ids {visible.physical})"
        fix = f"Use a device index from 0 to {len(visible.physical) - 1}, or make more visible."
    else:
        seen = "no AMD GPU is visible"
        fix = f"Check the GPUs with amd-smi, and that {HIP_VAR} / {ROCR_VAR} name real devices."
    raise RocmVisibleDevicesError(
        f"AMD GPU {logical} does not exist: {seen} ({visible.description}). {fix}"
    )


def physical_device_id(logical: int, env: Mapping[str, str], num_physical: int) -> DeviceId:
    """The physical id (index or UUID) of the device pagellm calls ``logical``."""
    index = visible_device_id(logical, env, num_physical)
    return visible_devices(env, num_physical).physical[index]
