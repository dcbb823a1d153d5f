"""Clients of the engine core: what `LLMEngine` and `AsyncLLM` drive.

`EngineCore` itself is the in-process client. `SyncMPClient` (blocking, for `LLM`) and
`AsyncMPClient` (asyncio, for `AsyncLLM`) run it in a spawned process (`core_proc`) and talk to it
over two ZMQ PUSH/PULL channels on IPC paths in a private temporary directory: the engine process
binds both, the client connects both (so its sends never block, even before the engine is up or
after it died). Frames are msgspec-msgpack structs (`engine.messages`), never pickle.

Engine death: both clients watch the process's sentinel (a file descriptor that becomes readable
when the process exits) next to the output socket, so a crash or a SIGKILL is seen at once; every
pending request and utility call then fails with `EngineDeadError` and `errored` turns True.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import zmq
import zmq.asyncio

from pagellm.engine.args import EngineArgs
from pagellm.engine.core_proc import run_engine_core
from pagellm.engine.errors import EngineDeadError, EngineStartupError
from pagellm.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineError,
    EngineOutputMsg,
    EngineReady,
    EngineRequestMsg,
    EngineStepOutputs,
    Shutdown,
    UtilityCall,
    UtilityResult,
    encoder,
    output_decoder,
)
from pagellm.request import EngineCoreRequest
from pagellm.scheduler.output import EngineCoreOutputs

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 5.0
# After the process exited, how long its last messages (an EngineError) may take to arrive.
_DRAIN_MS = 200
# Sync client: re-check the process this often even if the sentinel said nothing.
_POLL_MS = 5000


class EngineCoreClient(Protocol):
    """What `LLMEngine` drives: `EngineCore` in process, or `SyncMPClient`."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    def step(self) -> EngineCoreOutputs: ...

    def shutdown(self) -> None: ...


def _send_shutdown(input_socket: zmq.Socket) -> None:
    with contextlib.suppress(zmq.ZMQError):
        input_socket.send(encoder.encode(Shutdown()), zmq.NOBLOCK)


def _stop_process(
    proc: BaseProcess, input_socket: zmq.Socket, sockets: list[zmq.Socket], tmpdir: str
) -> None:
    """Ask the engine to stop, then insist; close the sockets and remove the IPC files.
    A module function (not a method) so the finalizer does not keep the client alive."""
    try:
        if proc.pid is not None and proc.exitcode is None:
            _send_shutdown(input_socket)
            proc.join(_SHUTDOWN_TIMEOUT_S)
            if proc.exitcode is None:
                logger.warning(
                    "Engine core did not stop in %.0f s: terminating", _SHUTDOWN_TIMEOUT_S
                )
                proc.terminate()
                proc.join(_SHUTDOWN_TIMEOUT_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    finally:
        for sock in sockets:
            sock.close(linger=0)
        shutil.rmtree(tmpdir, ignore_errors=True)


class _MPClient:
    """Starts the engine-core process and owns its sockets; subclasses read the outputs."""

    def __init__(self, args: EngineArgs) -> None:
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
            args=(args, input_address, output_address, os.getpid()),
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
        self._dead: EngineDeadError | None = None
        self.proc.start()
        try:
            self.ready = self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_until_ready(self) -> EngineReady:
        poller = zmq.Poller()
        poller.register(self._output_sync, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._output_sync in events:
                msg = output_decoder.decode(self._output_sync.recv())
                if isinstance(msg, EngineReady):
                    return msg
                if isinstance(msg, EngineError):
                    raise EngineStartupError(
                        f"The engine core failed to start: {msg.message}\n{msg.traceback}"
                    )
            elif self.proc.sentinel in events:
                if self._output_sync.poll(_DRAIN_MS):
                    continue  # its error message is still on the way
                raise EngineStartupError(
                    f"The engine-core process exited with code {self.proc.exitcode} while starting."
                )

    @property
    def errored(self) -> bool:
        if self._dead is None and not self._closed and self.proc.exitcode is not None:
            self._set_dead(None)
        return self._dead is not None

    def _set_dead(self, error: EngineError | None) -> EngineDeadError:
        """Record the engine's death (once) and return the error pending calls fail with. The
        engine's own error is logged here, not handed to clients."""
        if self._dead is None:
            code = self.proc.exitcode  # reaps the process if it has exited
            message = "The engine-core process died" + (
                f" (exit code {code})" if code is not None else ""
            )
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

    def _send(self, msg: EngineRequestMsg) -> None:
        # Never blocks: the connecting side queues without limit (SNDHWM 0).
        self.input_socket.send(encoder.encode(msg))

    def add_request(self, request: EngineCoreRequest) -> None:
        self.raise_if_dead()
        self._send(AddRequest(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Silently nothing when the engine is gone: there is nothing left to free."""
        ids = list(request_ids)
        if ids and not self._closed and self._dead is None:
            self._send(AbortRequests(ids))

    def shutdown(self) -> None:
        """Stop the process (shutdown message, then terminate / kill) and remove the IPC files."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()


class SyncMPClient(_MPClient):
    """Blocking client for `LLMEngine` (``LLM(..., multiprocess_engine=True)``)."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        self._poller = zmq.Poller()
        self._poller.register(self._output_sync, zmq.POLLIN)
        self._poller.register(self.proc.sentinel, zmq.POLLIN)
        self._buffered: deque[EngineStepOutputs] = deque()
        self._call_ids = itertools.count()

    def _recv(self) -> EngineOutputMsg:
        sock = self._output_sync
        while True:
            self.raise_if_dead()
            events = dict(self._poller.poll(_POLL_MS))
            if sock in events or (self.proc.sentinel in events and sock.poll(_DRAIN_MS)):
                msg = output_decoder.decode(sock.recv())
                if isinstance(msg, EngineError):
                    self.proc.join(_SHUTDOWN_TIMEOUT_S)  # it exits right after: reap it
                    raise self._set_dead(msg)
                return msg
            if self.proc.sentinel in events:
                self.proc.join()  # it has exited: reap it
                raise self._set_dead(None)

    def get_output(self) -> EngineStepOutputs:
        """The next step's outputs and stats (blocks; raises `EngineDeadError`)."""
        if self._buffered:
            return self._buffered.popleft()
        while True:
            msg = self._recv()
            if isinstance(msg, EngineStepOutputs):
                return msg

    def step(self) -> EngineCoreOutputs:
        return self.get_output().outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        self.raise_if_dead()
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, method, list(args)))
        while True:
            msg = self._recv()
            if isinstance(msg, EngineStepOutputs):
                self._buffered.append(msg)
            elif isinstance(msg, UtilityResult) and msg.call_id == call_id:
                if msg.error is not None:
                    raise RuntimeError(f"Engine utility {method!r} failed: {msg.error}")
                return msg.result


class AsyncMPClient(_MPClient):
    """asyncio client for `AsyncLLM`.

    A background task (started by `start_output_task` in the running loop, and again in a later
    loop if that one ended) reads the output socket and hands each step's outputs to
    ``on_outputs``; ``on_dead`` is called once when the engine dies. Requests and aborts are
    sent synchronously (they never block), so an abort can be sent from any ``finally``.
    """

    def __init__(
        self,
        args: EngineArgs,
        on_outputs: Callable[[EngineStepOutputs], None],
        on_dead: Callable[[EngineDeadError], None],
    ) -> None:
        super().__init__(args)
        self.output_socket = zmq.asyncio.Socket.from_socket(self._output_sync)
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._task: asyncio.Task[None] | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._exited = False
        self._recv_future: asyncio.Future[Any] | None = None

    def start_output_task(self) -> None:
        """Make sure the output task runs in the current event loop."""
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._task = loop.create_task(self._process_outputs(loop), name="pagellm-engine-outputs")

    async def _process_outputs(self, loop: asyncio.AbstractEventLoop) -> None:
        sentinel = self.proc.sentinel

        def on_exit() -> None:
            loop.remove_reader(sentinel)
            self.proc.join(0)  # it has exited: reap it (no zombie left behind)
            self._exited = True
            if self._recv_future is not None:
                self._recv_future.cancel()

        loop.add_reader(sentinel, on_exit)
        sock = self.output_socket
        try:
            while not self._exited:
                self._recv_future = sock.recv()  # type: ignore[assignment]
                try:
                    frame = await self._recv_future  # type: ignore[misc]
                except asyncio.CancelledError:
                    if self._exited and not self._closed:
                        break  # cancelled by on_exit, not from outside
                    raise
                finally:
                    self._recv_future = None
                self._dispatch(output_decoder.decode(frame))
            # The process is gone: take what it sent before dying (its EngineError, if any).
            while await sock.poll(_DRAIN_MS):
                self._dispatch(output_decoder.decode(await sock.recv()))
            if not self._closed:
                self._fail_all(self._set_dead(None))
        except Exception as exc:
            if not self._closed:  # a closed socket is how shutdown() stops us
                self._fail_all(self._set_frontend_failed(exc))
        finally:
            loop.remove_reader(sentinel)

    def _dispatch(self, msg: EngineOutputMsg) -> None:
        if isinstance(msg, EngineStepOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, UtilityResult):
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                if msg.error is not None:
                    future.set_exception(RuntimeError(f"Engine utility failed: {msg.error}"))
                else:
                    future.set_result(msg.result)
        elif isinstance(msg, EngineError):
            self._fail_all(self._set_dead(msg))

    def _fail_all(self, error: EngineDeadError) -> None:
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
        self._on_dead(error)

    async def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Run a utility method in the engine process; ``asyncio.TimeoutError`` after
        ``timeout`` seconds, `EngineDeadError` if the engine dies meanwhile."""
        self.raise_if_dead()
        self.start_output_task()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def shutdown_async(self, timeout: float) -> None:
        """`shutdown` without blocking the event loop: ask the engine to stop, wait up to
        ``timeout`` seconds for it to exit (its output socket stays open meanwhile, so its last
        sends never block), then kill it if it has not."""
        if self._closed:
            return
        if self.proc.exitcode is None:
            _send_shutdown(self.input_socket)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while self.proc.exitcode is None and loop.time() < deadline:
                await asyncio.sleep(0.02)
            if self.proc.exitcode is None:
                logger.warning("Engine core did not stop within %.1f s: killing it", timeout)
                self.proc.kill()
        self.shutdown()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        task = self._task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.get_loop().remove_reader(self.proc.sentinel)
            task.cancel()
        self._finalizer()  # stops the process first, then closes the sockets
        self.output_socket.close(linger=0)
