"""`AsyncMPClient`: the asyncio client of the engine-core process (`AsyncLLM` drives it).

It shares the process, the sockets and the death detection of `core_client.MPClientBase`; a task in
the running event loop reads the outputs and watches the process's sentinel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from pagellm.config import EngineConfig
from pagellm.engine import messages
from pagellm.engine.core_client import DRAIN_MS, MPClientBase, send_shutdown
from pagellm.engine.errors import EngineDeadError

logger = logging.getLogger(__name__)


class AsyncMPClient(MPClientBase):
    """asyncio client for `AsyncLLM`.

    A background task (started by `start_output_task` in the running loop, and again in a later
    loop if that one ended) reads the output socket and hands each step's outputs to
    ``on_outputs``; ``on_dead`` is called once when the engine dies. Requests and aborts are
    sent synchronously (they never block), so an abort can be sent from any ``finally``.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[messages.EngineStepOutputs], None],
        on_dead: Callable[[EngineDeadError], None],
    ) -> None:
        super().__init__(config)
        self.output_socket = zmq.asyncio.Socket.from_socket(self._output_sync)
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._task: asyncio.Task[None] | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
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

        def reap(tries: int = 100) -> None:
            # The sentinel closes while the process is still exiting: poll (without blocking
            # the loop) until it can be waited for, so no zombie is left behind.
            if self.proc.exitcode is None and tries:
                loop.call_later(0.05, reap, tries - 1)

        def on_exit() -> None:
            loop.remove_reader(sentinel)
            reap()
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
                self._dispatch(messages.output_decoder.decode(frame))
            # The process is gone: take what it sent before dying (its EngineError, if any).
            while await sock.poll(DRAIN_MS):
                self._dispatch(messages.output_decoder.decode(await sock.recv()))
            if not self._closed:
                self._fail_all(self._set_dead(None))
        except Exception as exc:
            if not self._closed:  # a closed socket is how shutdown() stops us
                self._fail_all(self._set_frontend_failed(exc))
        finally:
            loop.remove_reader(sentinel)

    def _dispatch(self, msg: messages.EngineOutputMsg) -> None:
        if isinstance(msg, messages.EngineStepOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, messages.UtilityResult):
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                if msg.error is not None:
                    future.set_exception(RuntimeError(f"Engine utility failed: {msg.error}"))
                else:
                    future.set_result(msg.result)
        elif isinstance(msg, messages.EngineError):
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
            self._send(messages.UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def shutdown_async(self, timeout: float) -> None:
        """`shutdown` without blocking the event loop: ask the engine to stop, wait up to
        ``timeout`` seconds for it to exit (its output socket stays open meanwhile, so its last
        sends never block), then kill it if it has not."""
        if self._closed:
            return
        self._stopping = True
        if self.proc.exitcode is None:
            send_shutdown(self.input_socket)
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
