"""`EngineCoreProc`: the engine core in a background process, driven over ZMQ.

The front end (`core_client`) starts `run_engine_core` in a *spawned* process with the resolved
`EngineConfig` (pickled by `multiprocessing`) and two IPC addresses; this process builds the
`EngineCore` from that config (its worker loads the general plugins; the platform, attention and
quantization groups load where they are first used, as in any process), binds both sockets (PULL for requests, PUSH for outputs: see
`engine.messages`) and runs the busy loop: take every queued message, step while requests are
unfinished and send each step's outputs with the scheduler's stats; with nothing to do it blocks
on the input socket. An exception is reported to the front end as an `EngineError` message, then
the process exits with status 1.
"""

from __future__ import annotations

import logging
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from pagellm.child_processes import exit_when_orphaned
from pagellm.config import EngineConfig
from pagellm.engine import messages
from pagellm.engine.core import EngineCore
from pagellm.executor.errors import ExecutorDeadError
from pagellm.request import FinishReason
from pagellm.scheduler.output import EngineCoreOutput, EngineCoreOutputs

logger = logging.getLogger(__name__)

# How long closing the output socket may wait to deliver the last messages (e.g. an EngineError).
_LINGER_MS = 2000


class EngineCoreProc:
    """The engine-core side of the sockets: a busy loop around one `EngineCore`."""

    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket):
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        # The only methods the front end may call: nothing here runs arbitrary code.
        self.utilities: dict[str, Callable[..., Any]] = {
            "reset_prefix_cache": core.reset_prefix_cache,
            "get_state": core.get_state,
        }

    def send(self, msg: messages.EngineOutputMsg) -> None:
        self.output_socket.send(messages.encoder.encode(msg))

    def send_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Outputs go with the scheduler's stats as they stand after them."""
        self.send(messages.EngineStepOutputs(outputs, self.core.make_scheduler_stats()))

    def run_busy_loop(self) -> None:
        """Until a `Shutdown` message comes."""
        core = self.core
        sock = self.input_socket
        while True:
            if not core.has_unfinished_requests():
                sock.poll()  # idle: sleep until the front end sends something
            aborted = False
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = messages.request_decoder.decode(frame)
                if isinstance(msg, messages.Shutdown):
                    return
                if isinstance(msg, messages.WorkersFailed):
                    raise ExecutorDeadError(msg.message)
                aborted |= isinstance(msg, messages.AbortRequests)
                self._handle(msg)
            if core.has_unfinished_requests():
                self.send_outputs(core.step())
            elif aborted:  # no step follows to report it: the gauges must see the idle engine
                self.send_outputs(EngineCoreOutputs())

    def _handle(self, msg: messages.EngineRequestMsg) -> None:
        if isinstance(msg, messages.AddRequest):
            try:
                self.core.add_request(msg.request)
            except Exception:  # that request's fault: it fails, the engine goes on
                logger.exception("Request %s could not be added", msg.request.request_id)
                failed = EngineCoreOutput(
                    msg.request.request_id, [], finish_reason=int(FinishReason.ERROR)
                )
                self.send_outputs(EngineCoreOutputs(outputs=[failed]))
        elif isinstance(msg, messages.AbortRequests):
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, messages.UtilityCall):
            self.send(self._call_utility(msg))

    def _call_utility(self, call: messages.UtilityCall) -> messages.UtilityResult:
        method = self.utilities.get(call.method)
        if method is None:
            return messages.UtilityResult(
                call.call_id,
                error=f"AttributeError: unknown utility {call.method!r}; "
                f"available: {sorted(self.utilities)}",
            )
        try:
            return messages.UtilityResult(call.call_id, result=method(*call.args))
        except Exception as exc:  # a failed utility call is the caller's error, not the engine's
            return messages.UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")


def _wake_with_failure(ctx: zmq.Context, input_address: str, message: str) -> None:
    """From the executor's monitor thread: put a `WorkersFailed` in the busy loop's input (a
    socket of this thread's own: ZMQ sockets are not shared between threads)."""
    sock = ctx.socket(zmq.PUSH)
    sock.connect(input_address)
    sock.send(messages.encoder.encode(messages.WorkersFailed(message)))
    sock.close(linger=1000)


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int
) -> None:
    """The engine-core process's entry point (a `multiprocessing` spawn target)."""
    # Ctrl-C reaches the whole process group: the front end decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.bind(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.bind(output_address)
    core: EngineCore | None = None
    try:
        core = EngineCore(config)  # its worker loads the general plugins
        core.executor.register_failure_callback(
            lambda message: _wake_with_failure(ctx, input_address, message)
        )
        proc = EngineCoreProc(core, input_socket, output_socket)
        proc.send(messages.EngineReady(num_blocks=core.kv_cache_manager.block_pool.num_blocks))
        proc.run_busy_loop()
    except Exception as exc:
        logger.exception("Engine core failed")
        error = messages.EngineError(f"{type(exc).__name__}: {exc}", traceback.format_exc())
        output_socket.send(messages.encoder.encode(error))
        raise SystemExit(1) from None  # after the cleanup below
    finally:
        if core is not None:
            core.shutdown()
        input_socket.close(linger=0)
        output_socket.close(linger=_LINGER_MS)
        ctx.term()
