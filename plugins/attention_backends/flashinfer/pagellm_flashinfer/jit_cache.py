"""FlashInfer's kernels are compiled on first use (nvcc through ninja) into its JIT cache, where
later starts find them. This module names the modules a model needs and builds those missing
when the metadata builder is made (in the engine's start-up, before the model loads), so that
no step waits for the compiler.

Each module is built by its own ninja file, in its own build directory, as FlashInfer's
``build_and_load`` runs it whenever a wrapper loads the module: ninja rebuilds every output its
log there does not record, so a module built otherwise (by ``flashinfer.jit.build_jit_specs``,
one ninja run over several modules, logged in the JIT directory) would be compiled a second
time at its first load, in the warm-up or a graph capture, unreported (on the H200: 26 s in the
decode graphs' capture and 100 s in the warm-up of a first start). So is a module whose sources,
headers or flags changed since its build (a newer apache-tvm-ffi installed beside it, the likely
cause of 84 s in the warm-up of an H100's start), which only ninja's own dry run of the module's
file sees. Such modules count as missing here and are rebuilt once, at start-up, logged with the
reason.

The cache is FlashInfer's: ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<arch>/``
(``FLASHINFER_WORKSPACE_BASE`` defaults to the home directory), read when flashinfer is first
imported; set it to share or move the cache.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelModule:
    """One of FlashInfer's batch attention modules: the paged prefill kernels of one backend
    (``"fa2"`` or ``"fa3"``), specialised for a dtype, a head size and whether a window is
    applied. The tensor-core decode wrapper runs the ``"fa2"`` one."""

    backend: str
    dtype: torch.dtype
    head_size: int
    sliding_window: bool

    def spec(self, flashinfer: ModuleType) -> Any:
        """The module's JIT spec, built with the arguments the wrappers' ``plan`` uses."""
        return flashinfer.jit.gen_batch_prefill_module(
            self.backend,
            self.dtype,  # queries
            self.dtype,  # keys / values
            self.dtype,  # output
            torch.int32,  # index arrays
            self.head_size,  # query / key head size
            self.head_size,  # value head size
            0,  # no rotary embedding inside attention (the model applies it)
            self.sliding_window,
            False,  # no logit soft-capping
            False,  # no float16 QK reduction
        )


@dataclass(frozen=True)
class DecodeModule:
    """FlashInfer's CUDA-core decode kernels (the decode wrapper without tensor cores),
    specialised like `KernelModule`."""

    dtype: torch.dtype
    head_size: int
    sliding_window: bool

    def spec(self, flashinfer: ModuleType) -> Any:
        return flashinfer.jit.gen_batch_decode_module(
            self.dtype,
            self.dtype,
            self.dtype,
            torch.int32,
            self.head_size,
            self.head_size,
            0,  # no rotary embedding inside attention
            self.sliding_window,
            False,  # no logit soft-capping
        )


def modules_for(
    prefill_backend: str,
    dtype: torch.dtype,
    head_size: int,
    sliding_window: bool,
    decode_wrapper: bool = True,
) -> list[KernelModule]:
    """The prefill backend's module and, when the decode wrapper runs (``decode_wrapper``; not
    when TRITON_ATTN's kernel takes the one-token rows), its ``"fa2"`` one (the same one when
    prefill runs on ``"fa2"``)."""
    backends = dict.fromkeys([prefill_backend] + (["fa2"] if decode_wrapper else []))
    return [KernelModule(b, dtype, head_size, sliding_window) for b in backends]


def cache_dir(flashinfer: ModuleType) -> str:
    return str(flashinfer.jit.env.FLASHINFER_JIT_DIR)


BUILD_WORKERS = 2
"""Modules built at once (each ninja run uses every core for its module's sources)."""


NOT_BUILT = "not built"
COMBINED_BUILD = "built before by a combined build, which their own build does not see"
OUT_OF_DATE = "out of date with their sources, headers or flags (ninja would rebuild them)"


def _build_lock(spec: Any) -> AbstractContextManager[Any]:
    """The file lock FlashInfer's ``JitSpec.build`` takes (``spec.lock_path``), where it has one."""
    lock_path = getattr(spec, "lock_path", None)
    if lock_path is None:
        return nullcontext()
    try:
        from filelock import FileLock
    except ImportError:
        return nullcontext()
    return FileLock(str(lock_path), thread_local=False)


def ninja_would_rebuild(spec: Any) -> bool | None:
    """ninja's own dry run of the module's build file, written first as FlashInfer's build
    writes it (only where it changed): whether a load would rebuild something. None where
    ninja cannot be run (FlashInfer cannot build then either)."""
    ninja = shutil.which("ninja")
    if ninja is None:
        return None
    try:
        with _build_lock(spec):  # the lock FlashInfer's build holds around the same two steps
            spec.write_ninja()
            dry = subprocess.run(
                [ninja, "-n", "-C", str(spec.build_dir), "-f", str(spec.ninja_path)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return dry.returncode != 0 or "no work to do" not in dry.stdout


def why_it_would_build(spec: Any) -> str | None:
    """Why FlashInfer's ``build_and_load`` of ``spec`` would compile rather than only load it
    (`NOT_BUILT`, `COMBINED_BUILD`, `OUT_OF_DATE`), or None: a prebuilt (AOT) module, or one
    compiled by its own ninja file, whose log in its build directory records the library, with
    nothing changed since."""
    if getattr(spec, "is_aot", False):
        return None
    if not spec.is_compiled:
        return NOT_BUILT
    try:
        ninja_log = (Path(spec.build_dir) / ".ninja_log").read_text(errors="replace")
    except OSError:
        return COMBINED_BUILD
    if f"{spec.name}.so" not in ninja_log:
        return COMBINED_BUILD
    return OUT_OF_DATE if ninja_would_rebuild(spec) else None


def loads_without_building(spec: Any) -> bool:
    return why_it_would_build(spec) is None


def compile_missing(flashinfer: ModuleType, modules: Sequence[KernelModule | DecodeModule]) -> int:
    """Build the modules a wrapper's load would build (`loads_without_building`), each by its own
    ninja file, `BUILD_WORKERS` at a time; returns how many were built. Logs the time it took,
    or that the cache had them all."""
    specs = [module.spec(flashinfer) for module in modules]
    missing = [(spec, why) for spec in specs if (why := why_it_would_build(spec)) is not None]
    where = cache_dir(flashinfer)
    if not missing:
        logger.info("FlashInfer: %d kernel modules found in the JIT cache %s", len(specs), where)
        return 0
    rebuilt = Counter(why for _, why in missing if why != NOT_BUILT)
    logger.info(
        "FlashInfer: compiling %d kernel modules (first use; cached in %s for later starts)%s",
        len(missing),
        where,
        "".join(f"; {n} of them {why}" for why, n in rebuilt.items()),
    )
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=BUILD_WORKERS) as pool:
        list(pool.map(lambda item: item[0].build(verbose=False), missing))  # raises a build's error
    logger.info(
        "FlashInfer: compiled %d kernel modules in %.1f s: %s",
        len(missing),
        time.perf_counter() - started,
        ", ".join(spec.name for spec, _ in missing),
    )
    return len(missing)
