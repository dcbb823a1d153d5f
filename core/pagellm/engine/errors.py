"""The errors a client of the engine sees (raised from `generate`, `add_request`, utilities)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (crashed, killed, or failed): no request can complete."""


class EngineStartupError(RuntimeError):
    """The engine-core process failed while loading the model or sizing the KV cache."""


class RequestFailedError(RuntimeError):
    """The request made an engine step raise; the engine failed it and serves the others."""


class EngineOverloadedError(RuntimeError):
    """More requests wait for the engine than ``max_waiting_requests`` allows: try again later."""


class EngineShuttingDownError(RuntimeError):
    """The server is shutting down; requests still running at its deadline end with this."""
