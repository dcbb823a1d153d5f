"""Compiling ``w4a16_mma.cu`` for this GPU with the machine's nvcc, once: the cubin is cached
under ``$PAGELLM_INT4_CUDA_CACHE`` (default ``$PAGELLM_CACHE_DIR/int4-cuda``, the cache
directory ``~/.cache/pagellm`` unless set), keyed by the
source, the architecture and nvcc's version, so later starts load it without compiling."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "w4a16_mma.cu"
HEADERS = ("fragments.cuh", "dequantize.cuh")
"""What ``w4a16_mma.cu`` includes (one cubin): part of the cache key."""
CACHE_ENV = "PAGELLM_INT4_CUDA_CACHE"
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17")


class BuildError(RuntimeError):
    """nvcc is missing or failed: the message says which, for the start-up log."""


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    root = os.environ.get("PAGELLM_CACHE_DIR") or str(Path.home() / ".cache" / "pagellm")
    return Path(root) / "int4-cuda"


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"nvcc ({nvcc}) does not run: {exc}") from exc
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"


def cubin_path(arch: str, nvcc: str) -> Path:
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    for header in HEADERS:
        key.update((SOURCE.parent / header).read_bytes())
    key.update(arch.encode())
    key.update(" ".join(NVCC_FLAGS).encode())
    key.update(_nvcc_version(nvcc).encode())
    return cache_dir() / f"w4a16_mma_{arch}_{key.hexdigest()[:16]}.cubin"


def build_cubin(arch: str) -> tuple[Path, float | None]:
    """The cubin for ``arch`` (e.g. ``sm_90``) and the seconds spent compiling it (None: it was
    in the cache). Raises `BuildError` with the reason when it cannot be built."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc is not installed (set CUDA_HOME or put nvcc on PATH)")
    path = cubin_path(arch, nvcc)
    if path.is_file():
        return path, None
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [nvcc, *NVCC_FLAGS, f"-arch={arch}", "-o", str(out), str(SOURCE)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildError(f"nvcc failed to run: {exc}") from exc
        if run.returncode != 0:
            raise BuildError(f"nvcc exited with {run.returncode}: {run.stderr.strip()[-2000:]}")
        os.replace(out, path)  # atomic: a concurrent start sees the whole file or none
    seconds = time.perf_counter() - start
    logger.info("pagellm-int4: compiled the CUDA W4A16 kernels for %s in %.1f s", arch, seconds)
    return path, seconds
