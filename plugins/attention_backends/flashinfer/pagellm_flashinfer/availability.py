"""Whether FlashInfer can run here, decided without importing it.

Importing flashinfer initialises CUDA and loads its FFI runtime, which selection (in the front end,
for every installed backend) should not pay for. What it needs is checked instead: the
``flashinfer-python`` distribution and its version, ``apache-tvm-ffi``, the tools its JIT compiler
runs on first use (nvcc, found as FlashInfer finds it, and ninja on ``PATH``) unless prebuilt
kernels are installed, and a GPU of a compute capability it builds for.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

import torch

MIN_VERSION = (0, 6, 13)
"""The release the GPU tests ran under (the ``flashinfer`` extra pins ``>=0.6.13,<0.7``)."""
MIN_CAPABILITY = (8, 0)
"""Ampere: FlashInfer's FA2 kernels in bfloat16 (its sm_75 support is float16 only)."""
INSTALL_HINT = "pip install 'pagellm-flashinfer[flashinfer]'"


@dataclass(frozen=True)
class Environment:
    """The facts `unavailable_reason` decides on."""

    version: str | None
    """The installed ``flashinfer-python`` version; None when flashinfer is not installed."""
    has_tvm_ffi: bool
    has_prebuilt_kernels: bool
    """``flashinfer-jit-cache`` is installed: kernels load from it, nothing is compiled."""
    nvcc: str | None
    ninja: str | None
    capability: tuple[int, int] | None
    """The current GPU's compute capability; None when torch sees no CUDA GPU."""


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def find_nvcc(environ: Mapping[str, str] = os.environ) -> str | None:
    """nvcc where FlashInfer's JIT looks: ``$CUDA_HOME`` / ``$CUDA_PATH``, ``PATH``, then
    ``/usr/local/cuda``."""
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if home:
        nvcc = os.path.join(home, "bin", "nvcc")
        return nvcc if os.path.exists(nvcc) else None
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.exists(default) else None


def probe() -> Environment:
    try:
        version: str | None = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None and importlib.util.find_spec("flashinfer") is not None:
        version = "unknown (no flashinfer-python distribution)"
    capability = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        capability = (major, minor)
    return Environment(
        version=version,
        has_tvm_ffi=importlib.util.find_spec("tvm_ffi") is not None,
        has_prebuilt_kernels=importlib.util.find_spec("flashinfer_jit_cache") is not None,
        nvcc=find_nvcc(),
        ninja=shutil.which("ninja"),
        capability=capability,
    )


def unavailable_reason(env: Environment) -> str | None:
    """None when FlashInfer can serve here; otherwise why not and what to do."""
    if env.version is None:
        return f"flashinfer is not installed ({INSTALL_HINT})"
    wanted = ".".join(map(str, MIN_VERSION))
    if _version_tuple(env.version) < MIN_VERSION:
        return f"flashinfer-python {env.version} is too old (needs >= {wanted}; {INSTALL_HINT})"
    if not env.has_tvm_ffi:
        return (
            "flashinfer needs apache-tvm-ffi, which is not installed (pip install apache-tvm-ffi)"
        )
    if not env.has_prebuilt_kernels:
        if env.nvcc is None:
            return (
                "FlashInfer compiles its kernels with nvcc on first use and none was found "
                "(install the CUDA toolkit or set CUDA_HOME)"
            )
        if env.ninja is None:
            return (
                "FlashInfer compiles its kernels with ninja, which is not on PATH "
                "(pip install ninja, and put the environment's bin/ on PATH)"
            )
    if env.capability is None:
        return "no CUDA GPU is visible"
    if env.capability < MIN_CAPABILITY:
        major, minor = env.capability
        return (
            f"compute capability {major}.{minor} is not supported "
            f"(needs >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]})"
        )
    return None


@functools.cache
def flashinfer_unavailable_reason() -> str | None:
    """`unavailable_reason` of this process's environment (probed once)."""
    return unavailable_reason(probe())
