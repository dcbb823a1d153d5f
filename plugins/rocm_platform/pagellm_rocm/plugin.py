"""The ``pagellm.platform_plugins`` entry point: names `RocmPlatform` when an AMD GPU is visible
to a ROCm build of torch, and otherwise says why not (``pagellm plugins`` shows it).

Asked in every process the first time ``current_platform`` is read, so it must stay cheap and must
not initialise HIP: see `pagellm_rocm.detection`. When the platform is active, it also makes
``HIP_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES`` agree in the environment (or raises, naming
both, when they contradict each other), so that child processes and libraries reading either one
select the same GPUs.
"""

from __future__ import annotations

import os

from pagellm.plugins import hookimpl
from pagellm_rocm.detection import detect
from pagellm_rocm.visible import synced_variables

pagellm_plugin_api = "1.3"
pagellm_platform_class = "pagellm_rocm.platform:RocmPlatform"
"""What the hook answers on a machine with an AMD GPU; the conformance kit reads it elsewhere."""


@hookimpl
def pagellm_platform() -> str | None:
    if detect().inactive_reason is not None:
        return None
    os.environ.update(synced_variables(os.environ))
    return pagellm_platform_class


@hookimpl
def pagellm_platform_inactive_reason() -> str:
    return detect().inactive_reason or "an AMD GPU is visible"
