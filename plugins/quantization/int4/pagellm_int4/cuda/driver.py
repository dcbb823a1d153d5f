"""The few CUDA driver API calls that load a cubin into the current device's primary context and
launch its kernels on a torch stream (capturable into CUDA graphs like any launch), through
ctypes on ``libcuda``: no compiled extension, no dependency beyond the driver itself."""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_c_ptr = ctypes.c_void_p


class DriverError(RuntimeError):
    pass


PROGRAMMATIC_STREAM_SERIALIZATION = 6
"""``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: the kernel may start before the
one before it on the stream has finished (programmatic dependent launch, sm_90+); it waits for
it with ``griddepcontrol.wait``."""


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: the attribute's id, padding to 8 bytes, a 64-byte value (a union;
    the integer values sit in its first 4 bytes)."""

    _fields_ = [
        ("id", ctypes.c_int),
        ("pad", ctypes.c_char * 4),
        ("value", ctypes.c_int),
        ("value_rest", ctypes.c_char * 60),
    ]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", _c_ptr),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


@functools.cache
def _lib() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise DriverError(f"the CUDA driver library (libcuda.so.1) does not load: {exc}") from exc
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuLaunchKernel.argtypes = [
        _c_ptr,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        _c_ptr,
        ctypes.POINTER(_c_ptr),
        ctypes.POINTER(_c_ptr),
    ]
    if hasattr(lib, "cuLaunchKernelEx"):  # drivers of CUDA 12.0 and later
        lib.cuLaunchKernelEx.argtypes = [
            ctypes.POINTER(_LaunchConfig),
            _c_ptr,
            ctypes.POINTER(_c_ptr),
            ctypes.POINTER(_c_ptr),
        ]
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(_c_ptr), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(_c_ptr), _c_ptr, ctypes.c_char_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(_c_ptr)]
    lib.cuCtxSetCurrent.argtypes = [_c_ptr]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(_c_ptr), ctypes.c_int]
    lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def can_overlap() -> bool:
    """Whether this driver launches with attributes (``cuLaunchKernelEx``, CUDA 12.0 and
    later), which programmatic dependent launch needs."""
    return hasattr(_lib(), "cuLaunchKernelEx")


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        message = text.value.decode() if text.value else f"error {result}"
        raise DriverError(f"{what} failed: {message}")


_current = threading.local()


def make_current(device: torch.device) -> None:
    """Make ``device``'s primary context (torch's) current on this thread, once a thread."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if getattr(_current, "index", None) == index:
        return
    lib = _lib()
    ctx = _c_ptr()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    on = ctypes.c_int(-1)
    if ctx.value is not None:
        _check(lib, lib.cuCtxGetDevice(ctypes.byref(on)), "cuCtxGetDevice")
    if ctx.value is None or on.value != index:
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        primary = _c_ptr()
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev), "retain context")
        _check(lib, lib.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    _current.index = index


class Module:
    """A cubin loaded on one device, its kernels by name."""

    def __init__(self, cubin: Path, device: torch.device) -> None:
        self.device = device
        lib = _lib()
        torch.cuda.init()
        make_current(device)
        self._image = cubin.read_bytes()  # kept alive with the module
        handle = _c_ptr()
        _check(lib, lib.cuModuleLoadData(ctypes.byref(handle), self._image), "cuModuleLoadData")
        self._handle = handle
        self._functions: dict[str, _c_ptr] = {}
        self._overlap = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._config = _LaunchConfig(blockDimY=1, blockDimZ=1, numAttrs=1)
        self._config.attrs = ctypes.pointer(self._overlap)

    def function(self, name: str) -> _c_ptr:
        fn = self._functions.get(name)
        if fn is None:
            lib = _lib()
            fn = _c_ptr()
            _check(
                lib,
                lib.cuModuleGetFunction(ctypes.byref(fn), self._handle, name.encode()),
                f"cuModuleGetFunction({name})",
            )
            self._functions[name] = fn
        return fn

    def launch(
        self,
        name: str,
        grid: tuple[int, int, int],
        block: int,
        shared_bytes: int,
        args: Sequence[Any] | Launch,
        overlap_previous: bool = False,
    ) -> None:
        """Launch kernel ``name`` on the current torch stream of the module's device, with
        ``args`` (ctypes values) or a prepared `Launch` (its values as they are now).
        ``overlap_previous``: with programmatic dependent launch (sm_90+; the kernel must wait
        for the previous one, ``griddepcontrol.wait``, before it reads what that one wrote)."""
        lib = _lib()
        make_current(self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        params = args.params if isinstance(args, Launch) else _params(args)
        if overlap_previous:
            if not hasattr(lib, "cuLaunchKernelEx"):
                raise DriverError("this CUDA driver has no cuLaunchKernelEx (CUDA 12.0 and later)")
            config = self._config
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX = block
            config.sharedMemBytes = shared_bytes
            config.hStream = stream
            result = lib.cuLaunchKernelEx(ctypes.byref(config), self.function(name), params, None)
        else:
            result = lib.cuLaunchKernel(
                self.function(name),
                grid[0],
                grid[1],
                grid[2],
                block,
                1,
                1,
                shared_bytes,
                _c_ptr(stream),
                params,
                None,
            )
        _check(lib, result, f"launching {name}")


def _params(args: Sequence[Any]) -> Any:
    return (_c_ptr * len(args))(*[ctypes.addressof(a) for a in args])


class Launch:
    """A kernel's arguments kept between launches (ctypes values and the pointer array to
    them): a launch sets the values that change (``args[i].value = ...``) and passes them on,
    without building them again."""

    def __init__(self, args: Sequence[Any]) -> None:
        self.args = list(args)
        self.params = _params(self.args)
