"""The ``pagellm.platform_plugins`` entry point: names `CudaPlatform` when a CUDA GPU is present.

Asked in every process the first time ``current_platform`` is read, so it must stay cheap and must
not initialise CUDA: see `pagellm_cuda.devices.cuda_device_count`. A ROCm build of torch counts
no CUDA GPU here: the ``rocm`` platform (pagellm-rocm) serves it.
"""

from __future__ import annotations

import os

from pagellm.plugins import hookimpl
from pagellm_cuda.devices import cuda_device_count, inactive_reason

pagellm_plugin_api = "1.3"
pagellm_platform_class = "pagellm_cuda.platform:CudaPlatform"
"""What the hook answers on a machine with a GPU; the conformance kit reads it elsewhere."""


@hookimpl
def pagellm_platform() -> str | None:
    if cuda_device_count() > 0:
        return pagellm_platform_class
    return None


@hookimpl
def pagellm_platform_inactive_reason() -> str:
    return inactive_reason(os.environ) or "a CUDA GPU is visible"
