"""The messages between an executor's driver (the engine core) and its worker ranks.

Every frame is one msgpack-encoded msgspec struct (never pickle), decoded straight to its type
through a tagged union. The per-step messages carry the `SchedulerOutput` (a dataclass msgspec
encodes as it is) and come back as a `ModelRunnerOutput`; other calls name a `Worker` method and
carry plain arguments, which the worker converts to that method's annotated parameter types (and
the driver converts results to its return type), so only method names and data cross the wire.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import torch

from pagellm.scheduler.output import ModelRunnerOutput, SchedulerOutput


class ExecuteModel(msgspec.Struct, tag="execute", array_like=True):
    seq: int
    scheduler_output: SchedulerOutput


class LaunchModel(msgspec.Struct, tag="launch", array_like=True):
    seq: int
    scheduler_output: SchedulerOutput


class CollectOutput(msgspec.Struct, tag="collect", array_like=True):
    seq: int


class Call(msgspec.Struct, tag="call", array_like=True):
    """Call a `Worker` method on every rank; every rank answers with a `CallResult`."""

    seq: int
    method: str
    args: list[Any] = []


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """A worker process built its `Worker` and loaded the model."""

    rank: int


class StepDone(msgspec.Struct, tag="done", array_like=True):
    """The output rank's answer to a step message (``output`` is None for `LaunchModel`)."""

    seq: int
    output: ModelRunnerOutput | None = None


class CallResult(msgspec.Struct, tag="result", array_like=True):
    seq: int
    rank: int
    result: Any = None


class Failure(msgspec.Struct, tag="failure", array_like=True):
    """A rank's message raised (any rank sends it, for any message)."""

    seq: int
    rank: int
    message: str
    traceback: str = ""


DriverMsg = ExecuteModel | LaunchModel | CollectOutput | Call | Stop
WorkerMsg = Ready | StepDone | CallResult | Failure


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    raise NotImplementedError(f"{type(obj).__name__} cannot cross the executor's wire")


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is torch.dtype:
        dtype = getattr(torch, obj, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise NotImplementedError(f"{obj!r} is not a {tp}")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
driver_decoder = msgspec.msgpack.Decoder(DriverMsg)
worker_decoder = msgspec.msgpack.Decoder(WorkerMsg)


def convert(value: Any, tp: Any) -> Any:
    """A decoded plain value as ``tp`` (a `Worker` method's parameter or return annotation)."""
    if tp is Any or tp is None or tp is type(None):
        return value
    return msgspec.convert(value, tp, dec_hook=_dec_hook)


def method_hints(cls: type, method: str) -> dict[str, Any]:
    """The resolved annotations of ``cls.method`` (its parameters, and ``return``)."""
    return typing.get_type_hints(getattr(cls, method))
