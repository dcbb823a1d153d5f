"""Compiling Triton kernels for AMD GPUs on a machine without one.

Triton's AMD backend compiles ahead of time for any gfx target it knows, with nothing but the
Triton wheel (its LLVM, the AMDGPU code generator and the linker are inside libtriton; the device
libraries ``ocml.bc`` and ``ockl.bc`` ship with it): no ROCm installation and no GPU. This is how
CI checks that pagellm's kernels build for AMD GPUs and fit in their LDS.

A kernel is compiled as its host function would launch it: the host function runs with CPU
tensors of the right shapes inside `recorded_launches`, which records each launch (arguments,
compile-time constants, ``num_warps``, ``num_stages``) instead of running it; `compile_launch`
then specialises the recorded arguments the way Triton's runtime does at a launch (pointer and
integer alignment) and compiles for the target. Needs a process where Triton compiles (not
``TRITON_INTERPRET=1``: interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

AMD_TARGETS: dict[str, GPUTarget] = {
    "gfx942": GPUTarget("hip", "gfx942", 64),  # CDNA3: MI300X, MI325X
    "gfx950": GPUTarget("hip", "gfx950", 64),  # CDNA4: MI350X, MI355X
    "gfx1100": GPUTarget("hip", "gfx1100", 32),  # RDNA3: Radeon RX 7900 XTX, W7900
}
"""The architectures CI compiles for, with their wavefront sizes."""


class CrossCompileError(RuntimeError):
    """A kernel could not be compiled for a target, or this process cannot compile at all."""


def amd_backend_missing() -> str | None:
    """Why the installed Triton cannot compile for AMD GPUs, or None when it can."""
    try:
        from triton.backends import backends
    except ImportError as exc:
        return f"triton {triton.__version__} has no backend registry ({exc})"
    if "amd" not in backends:
        return f"triton {triton.__version__} is installed without its AMD backend"
    return None


@dataclass
class Launch:
    """One recorded launch of a Triton kernel."""

    kernel: Any
    """The ``@triton.jit`` function."""
    grid: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.kernel.__name__)


class _Recorder:
    def __init__(self, kernel: Any, launches: list[Launch]) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, grid, args, kwargs))

        return record


@contextlib.contextmanager
def recorded_launches(module: ModuleType, *kernel_names: str) -> Iterator[list[Launch]]:
    """Inside the block, launches of ``module``'s kernels ``kernel_names`` are recorded into the
    list this yields, and not run (the module attributes are restored afterwards)."""
    launches: list[Launch] = []
    originals = {name: getattr(module, name) for name in kernel_names}
    for name, kernel in originals.items():
        if not isinstance(kernel, triton.runtime.JITFunction):
            raise CrossCompileError(
                f"{module.__name__}.{name} is {type(kernel).__name__}, not a compiled Triton "
                "kernel: run without TRITON_INTERPRET=1 (kernels decorated under the interpreter "
                "cannot be compiled)."
            )
        setattr(module, name, _Recorder(kernel, launches))
    try:
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)


@dataclass(frozen=True)
class CompiledLaunch:
    """What the compiler reports of one kernel built for one target."""

    kernel: str
    arch: str
    warp_size: int
    num_warps: int
    num_stages: int
    shared: int
    """Bytes of LDS (shared memory) one program allocates."""
    scratch: int
    """Bytes of scratch (register spills to memory) per lane; 0 when nothing spills."""
    seconds: float
    """Compile time."""


_SCRATCH = re.compile(r"ScratchSize:\s*(\d+)")


def compile_launch(launch: Launch, target: GPUTarget) -> CompiledLaunch:
    """Compile ``launch`` for ``target`` (no cache lookups bypassed: point ``TRITON_CACHE_DIR``
    at an empty directory to time a cold compile)."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(target)
    kwargs = {"debug": False, **launch.kwargs}
    start = time.perf_counter()
    try:
        # The binder Triton's runtime builds for a launch: which arguments are constants, and
        # the alignment it specialises pointers and integers on.
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*launch.args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options
        )
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs),
            target=target,
            options=options.__dict__,
        )
    except Exception as exc:
        raise CrossCompileError(
            f"{launch.name} does not compile for {target.arch}: {type(exc).__name__}: {exc}"
        ) from exc
    seconds = time.perf_counter() - start
    scratch = [int(n) for n in _SCRATCH.findall(compiled.asm.get("amdgcn", ""))]
    meta = compiled.metadata
    return CompiledLaunch(
        kernel=launch.name,
        arch=target.arch,
        warp_size=target.warp_size,
        num_warps=meta.num_warps,
        num_stages=meta.num_stages,
        shared=meta.shared,
        scratch=max(scratch, default=0),
        seconds=seconds,
    )
