"""Clients of the engine core: what `LLMEngine` and `AsyncLLM` drive.

`EngineCore` itself is the in-process client. `SyncMPClient` (blocking, for `LLM`) and
`AsyncMPClient` (asyncio, for `AsyncLLM`, in `async_core_client`) run it in a spawned process
(`core_proc`) and talk to it
over two ZMQ PUSH/PULL channels on IPC paths in a private temporary directory: the engine process
binds both, the client connects both (so its sends never block, even before the engine is up or
after it died). Frames are msgspec-msgpack structs (`engine.messages`), never pickle.

Engine death: both clients watch the process's sentinel (a file descriptor that becomes readable
when the process exits) next to the output socket, so a crash or a SIGKILL is seen at once; every
pending request and utility call then fails with `EngineDeadError` and `errored` turns True.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Iterable
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import zmq

from pagellm.child_processes import join_or_kill
from pagellm.config import EngineConfig
from pagellm.engine import messages
from pagellm.engine.core_proc import run_engine_core
from pagellm.engine.errors import EngineDeadError, EngineStartupError
from pagellm.request import EngineCoreRequest
from pagellm.scheduler.output import EngineCoreOutputs

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 5.0
# After the process exited, how long its last messages (an EngineError) may take to arrive.
DRAIN_MS = 200
# Sync client: re-check the process this often even if the sentinel said nothing.
_POLL_MS = 5000


class RequestSink(Protocol):
    """The part of an engine-core client the request path uses (`RequestFrontend`)."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: Iterable[str]) -> None: ...


class EngineCoreClient(RequestSink, Protocol):
    """What `LLMEngine` drives: `EngineCore` in process, or `SyncMPClient`."""

    def step(self) -> EngineCoreOutputs: ...

    def shutdown(self) -> None: ...


def send_shutdown(input_socket: zmq.Socket) -> None:
    with contextlib.suppress(zmq.ZMQError):
        input_socket.send(messages.encoder.encode(messages.Shutdown()), zmq.NOBLOCK)


def _stop_process(
    proc: BaseProcess, input_socket: zmq.Socket, sockets: list[zmq.Socket], tmpdir: str
) -> None:
    """Ask the engine to stop, then insist; close the sockets and remove the IPC files.
    A module function (not a method) so the finalizer does not keep the client alive."""
    try:
        if proc.pid is not None and proc.exitcode is None:
            send_shutdown(input_socket)
            join_or_kill(proc, _SHUTDOWN_TIMEOUT_S, "Engine core")
    finally:
        for sock in sockets:
            sock.close(linger=0)
        shutil.rmtree(tmpdir, ignore_errors=True)


class MPClientBase:
    """Starts the engine-core process and owns its sockets; subclasses read the outputs."""

    def __init__(self, config: EngineConfig) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="pagellm-engine-")
        input_address = f"ipc://{os.path.join(self.ipc_dir, 'input')}"
        output_address = f"ipc://{os.path.join(self.ipc_dir, 'output')}"
        self.ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.connect(input_address)
        self._output_sync = self.ctx.socket(zmq.PULL)
        self._output_sync.setsockopt(zmq.RCVHWM, 0)
        self._output_sync.connect(output_address)
        # spawn, not fork: the front end may already hold threads, an event loop or a device.
        # daemon: the process never outlives the front end, even if nobody calls shutdown().
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, input_address, output_address, os.getpid()),
            name="pagellm-engine-core",
            daemon=True,
        )
        self._finalizer = weakref.finalize(
            self,
            _stop_process,
            self.proc,
            self.input_socket,
            [self.input_socket, self._output_sync],
            self.ipc_dir,
        )
        self._closed = False
        self._stopping = False
        """Set once this side asked the engine to stop: its exit is then expected, not logged
        as a death."""
        self._dead: EngineDeadError | None = None
        self._call_ids = itertools.count()
        self.proc.start()
        # The output socket and the process's sentinel: a message, or the process's exit.
        self._poller = zmq.Poller()
        self._poller.register(self._output_sync, zmq.POLLIN)
        self._poller.register(self.proc.sentinel, zmq.POLLIN)
        try:
            self.ready = self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_until_ready(self) -> messages.EngineReady:
        sock = self._output_sync
        while True:
            events = dict(self._poller.poll())
            # After the exit, its last messages (an EngineError) may still be on the way.
            if sock in events or (self.proc.sentinel in events and sock.poll(DRAIN_MS)):
                msg = messages.output_decoder.decode(sock.recv())
                if isinstance(msg, messages.EngineReady):
                    return msg
                if isinstance(msg, messages.EngineError):
                    raise EngineStartupError(
                        f"The engine core failed to start: {msg.message}\n{msg.traceback}"
                    )
            elif self.proc.sentinel in events:
                raise EngineStartupError(
                    f"The engine-core process exited with code {self.proc.exitcode} while starting."
                )

    @property
    def errored(self) -> bool:
        if self._dead is None and not self._closed and self.proc.exitcode is not None:
            self._set_dead(None)
        return self._dead is not None

    def _set_dead(self, error: messages.EngineError | None) -> EngineDeadError:
        """Record the engine's death (once) and return the error pending calls fail with. The
        engine's own error is logged here, not handed to clients."""
        if self._dead is None:
            code = self.proc.exitcode  # reaps the process if it has exited
            message = "The engine-core process died" + (
                f" (exit code {code})" if code is not None else ""
            )
            if self._stopping and error is None:
                self._dead = EngineDeadError("The engine core was shut down.")
                logger.info("The engine-core process stopped (exit code %s)", code)
                return self._dead
            self._dead = EngineDeadError(message)
            if error is not None:
                message += f": {error.message}\n{error.traceback}"
            logger.error("%s", message)
        return self._dead

    def _set_frontend_failed(self, exc: Exception) -> EngineDeadError:
        """This process can no longer follow the engine (its output handling raised)."""
        if self._dead is None:
            logger.exception("Handling the engine core's outputs failed")
            self._dead = EngineDeadError(
                f"The front end lost track of the engine core: {type(exc).__name__}: {exc}"
            )
        return self._dead

    def raise_if_dead(self) -> None:
        if self._closed:
            raise EngineDeadError("The engine core was shut down.")
        if self.errored and self._dead is not None:
            raise EngineDeadError(*self._dead.args)  # a fresh instance: its own traceback

    def _send(self, msg: messages.EngineRequestMsg) -> None:
        # Never blocks: the connecting side queues without limit (SNDHWM 0).
        self.input_socket.send(messages.encoder.encode(msg))

    def add_request(self, request: EngineCoreRequest) -> None:
        self.raise_if_dead()
        self._send(messages.AddRequest(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Silently nothing when the engine is gone: there is nothing left to free."""
        ids = list(request_ids)
        if ids and not self._closed and self._dead is None:
            self._send(messages.AbortRequests(ids))

    def shutdown(self) -> None:
        """Stop the process (shutdown message, then terminate / kill) and remove the IPC files."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()


class SyncMPClient(MPClientBase):
    """Blocking client for `LLMEngine` (``LLM(..., multiprocess_engine=True)``)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._buffered: deque[messages.EngineStepOutputs] = deque()

    def _recv(self) -> messages.EngineOutputMsg:
        sock = self._output_sync
        while True:
            self.raise_if_dead()
            events = dict(self._poller.poll(_POLL_MS))
            if sock in events or (self.proc.sentinel in events and sock.poll(DRAIN_MS)):
                msg = messages.output_decoder.decode(sock.recv())
                if isinstance(msg, messages.EngineError):
                    self.proc.join(_SHUTDOWN_TIMEOUT_S)  # it exits right after: reap it
                    raise self._set_dead(msg)
                return msg
            if self.proc.sentinel in events:
                self.proc.join()  # it has exited: reap it
                raise self._set_dead(None)

    def step(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks; raises `EngineDeadError`)."""
        if self._buffered:
            return self._buffered.popleft().outputs
        while True:
            msg = self._recv()
            if isinstance(msg, messages.EngineStepOutputs):
                return msg.outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        self.raise_if_dead()
        call_id = next(self._call_ids)
        self._send(messages.UtilityCall(call_id, method, list(args)))
        while True:
            msg = self._recv()
            if isinstance(msg, messages.EngineStepOutputs):
                self._buffered.append(msg)
            elif isinstance(msg, messages.UtilityResult) and msg.call_id == call_id:
                if msg.error is not None:
                    raise RuntimeError(f"Engine utility {method!r} failed: {msg.error}")
                return msg.result
