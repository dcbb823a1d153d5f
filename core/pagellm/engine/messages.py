"""The wire protocol between the front end and the engine-core process.

Two one-way ZMQ PUSH/PULL channels over local IPC; every frame is one msgpack-encoded msgspec
struct (never pickle). Each direction is a tagged union (the tag is the struct's first array
element), so the receiver decodes straight to the right type:

- front end → engine (`EngineRequestMsg`): `AddRequest`, `AbortRequests`, `UtilityCall`, `Shutdown`
  (and `WorkersFailed`, which the engine's own executor monitor sends to wake its loop);
- engine → front end (`EngineOutputMsg`): `EngineReady` once at start-up, then `EngineStepOutputs`
  after every step, `UtilityResult` per utility call, and `EngineError` just before the process
  exits on an exception.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagellm.metrics.stats import SchedulerStats
from pagellm.request import EngineCoreRequest
from pagellm.scheduler.output import EngineCoreOutputs


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    """Call one of the engine's utility methods (`EngineCoreProc.UTILITIES`)."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class WorkersFailed(msgspec.Struct, tag="workers_failed", array_like=True):
    """A worker of the engine's executor died between steps: the engine core stops."""

    message: str


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    """Sent once the engine core is built (model loaded, KV cache sized)."""

    num_blocks: int
    """KV cache blocks, the null block included."""


class EngineStepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: EngineCoreOutputs
    scheduler_stats: SchedulerStats


class UtilityResult(msgspec.Struct, tag="result", array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None
    """Set (``"TypeName: message"``) when the call raised; ``result`` is then None."""


class EngineError(msgspec.Struct, tag="error", array_like=True):
    """The engine loop (or start-up) raised; the process exits non-zero right after."""

    message: str
    traceback: str = ""


EngineRequestMsg = AddRequest | AbortRequests | UtilityCall | Shutdown | WorkersFailed
EngineOutputMsg = EngineReady | EngineStepOutputs | UtilityResult | EngineError

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(EngineRequestMsg)
output_decoder = msgspec.msgpack.Decoder(EngineOutputMsg)
