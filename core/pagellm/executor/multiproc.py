"""One worker process per rank, driven from the engine core over ZMQ IPC.

The driver binds one PUSH socket per rank and one PULL socket for the replies; each message
(`executor.wire`) is encoded once and the same bytes are sent to every rank. Only the output rank
answers a step; every rank answers a `collective_rpc`; any rank whose message raised answers
with a `Failure`. Why ZMQ rather than a shared-memory ring: docs/architecture.md (measured).

Workers are spawned (never forked: the engine may hold threads or a device) as daemonic
processes, so they never outlive the process that started them; each also exits when its parent
dies without stopping it (`exit_when_orphaned`). The driver waits on the reply socket *and* on the
workers' sentinels, so a worker that dies during a call fails it at once with
`ExecutorDeadError` (its rank and exit code); a monitor thread reports a death between calls
through the failure callbacks (the engine-core process then stops).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from pagellm.child_processes import exit_when_orphaned, join_or_kill
from pagellm.config import EngineConfig
from pagellm.executor import wire
from pagellm.executor.abstract import Executor
from pagellm.executor.errors import ExecutorDeadError, WorkerError
from pagellm.executor.worker_host import OUTPUT_RANK, WorkerHost
from pagellm.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 5.0
_MONITOR_INTERVAL_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_worker(
    config: EngineConfig,
    rank: int,
    init_method: str,
    step_address: str,
    reply_address: str,
    parent_pid: int,
) -> None:
    """A worker process's entry point (a `multiprocessing` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when its workers stop
    threading.Thread(target=exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    ctx = zmq.Context()
    steps, replies = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    steps.connect(step_address)
    replies.connect(reply_address)
    host: WorkerHost | None = None
    try:
        try:
            host = WorkerHost(config, rank, local_rank=rank, init_method=init_method)
        except Exception as exc:
            logger.exception("Worker rank %d failed to start", rank)
            replies.send(
                wire.encoder.encode(wire.Failure(-1, rank, f"{type(exc).__name__}: {exc}"))
            )
            raise SystemExit(1) from None
        replies.send(wire.encoder.encode(wire.Ready(rank)))
        while True:
            msg = wire.driver_decoder.decode(steps.recv())
            if isinstance(msg, wire.Stop):
                return
            reply = host.handle(msg)
            if reply is not None:
                replies.send(wire.encoder.encode(reply))
    finally:
        if host is not None:
            host.close()
        steps.close(linger=0)
        replies.close(linger=2000)
        ctx.term()


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """A daemonic process (the engine core under ``pagellm serve``) may not start processes
    through `multiprocessing`; the flag is lifted while the workers start. They stay bound to
    it: they are daemonic themselves, and exit when orphaned."""
    me = multiprocessing.current_process()
    daemon = me.daemon
    if daemon:
        me.daemon = False
    try:
        yield
    finally:
        if daemon:
            me.daemon = True


def _stop_workers(procs: list[BaseProcess], sockets: list[zmq.Socket], ipc_dir: str) -> None:
    """Ask every worker to stop, then insist (terminate, kill); close the sockets. A module
    function so that the finalizer does not keep the executor alive."""
    try:
        stop = wire.encoder.encode(wire.Stop())
        for sock in sockets[1:]:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(stop, zmq.NOBLOCK)
        for proc in procs:
            if proc.pid is None:
                continue
            join_or_kill(proc, _STOP_TIMEOUT_S, f"Worker {proc.name}")
    finally:
        for sock in sockets:
            sock.close(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        world_size = self.config.parallel.world_size
        self.ipc_dir = tempfile.mkdtemp(prefix="pagellm-workers-")
        reply_address = f"ipc://{os.path.join(self.ipc_dir, 'replies')}"
        self.ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self.reply_socket = self.ctx.socket(zmq.PULL)
        self.reply_socket.setsockopt(zmq.RCVHWM, 0)
        self.reply_socket.bind(reply_address)
        self.step_sockets: list[zmq.Socket] = []
        init_method = f"tcp://127.0.0.1:{free_port()}"
        spawn = multiprocessing.get_context("spawn")
        self.procs: list[BaseProcess] = []
        for rank in range(world_size):
            address = f"ipc://{os.path.join(self.ipc_dir, f'steps-{rank}')}"
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.bind(address)
            self.step_sockets.append(sock)
            args = (self.config, rank, init_method, address, reply_address, os.getpid())
            self.procs.append(
                spawn.Process(
                    target=run_worker, args=args, name=f"pagellm-worker-{rank}", daemon=True
                )
            )
        self._finalizer = weakref.finalize(
            self, _stop_workers, self.procs, [self.reply_socket, *self.step_sockets], self.ipc_dir
        )
        self._seq = 0
        self._raised_seqs: set[int] = set()
        self._late_failures: list[wire.Failure] = []
        self._dead: ExecutorDeadError | None = None
        self._closing = False
        self._poller = zmq.Poller()
        self._poller.register(self.reply_socket, zmq.POLLIN)
        with _children_allowed():
            for proc in self.procs:
                proc.start()
        for proc in self.procs:
            self._poller.register(proc.sentinel, zmq.POLLIN)
        try:
            self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._monitor, name="pagellm-worker-monitor", daemon=True).start()

    @property
    def worker_pids(self) -> list[int | None]:
        return [proc.pid for proc in self.procs]

    def _wait_until_ready(self) -> None:
        ready: set[int] = set()
        while len(ready) < len(self.procs):
            msg = self._recv()
            if isinstance(msg, wire.Failure):
                raise WorkerError(f"Worker rank {msg.rank} failed to start: {msg.message}")
            if isinstance(msg, wire.Ready):
                ready.add(msg.rank)

    def _death(self) -> ExecutorDeadError | None:
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                return ExecutorDeadError(
                    f"Worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                )
        return None

    def _monitor(self) -> None:
        """Between calls nobody waits on the workers: report a death to the failure callbacks.
        A sentinel may read ready before its process is reaped: then look again shortly."""
        sentinels = [proc.sentinel for proc in self.procs]
        while not self._closing:
            if not wait(sentinels, timeout=_MONITOR_INTERVAL_S):
                continue
            death = self._death()
            if death is None:
                time.sleep(_MONITOR_INTERVAL_S / 10)
            elif not self._closing:
                logger.error("%s", death)
                self._dead = self._dead or death
                self._report_failure(str(death))
                return

    def _recv(self) -> wire.WorkerMsg:
        """The next reply; raises `ExecutorDeadError` as soon as a worker has exited."""
        sock = self.reply_socket
        while True:
            if self._dead is not None:
                raise ExecutorDeadError(*self._dead.args)
            events = dict(self._poller.poll())
            if len(events) > (sock in events):  # a sentinel: a worker has exited
                self._dead = self._death()
            elif sock in events:
                return wire.worker_decoder.decode(sock.recv())

    def _broadcast(self, msg: wire.DriverMsg) -> None:
        self._dead = self._dead or self._death()
        if self._dead is not None:
            raise ExecutorDeadError(*self._dead.args)
        frame = wire.encoder.encode(msg)
        for sock in self.step_sockets:
            self._send(sock, frame)

    def _send(self, sock: zmq.Socket, frame: bytes) -> None:
        """Send without blocking on a dead worker. A PUSH socket whose only peer has exited has
        nowhere to queue and blocks a send forever; and a death can land between `_broadcast`'s
        look and the send (`Process.join` in one thread returns early when another thread's
        ``waitpid`` reaped the child: the monitor's). So wait for room in short polls, looking
        for a death in between."""
        while True:
            try:
                sock.send(frame, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            self._dead = self._dead or self._death()
            if self._dead is not None:
                raise ExecutorDeadError(*self._dead.args)
            sock.poll(int(_MONITOR_INTERVAL_S * 1000), zmq.POLLOUT)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _fail(self, failure: wire.Failure) -> WorkerError:
        self._raised_seqs.add(failure.seq)
        return WorkerError(f"Worker rank {failure.rank}: {failure.message}\n{failure.traceback}")

    def _step(self, msg: wire.ExecuteModel | wire.LaunchModel | wire.CollectOutput) -> Any:
        """Broadcast a step and wait for the output rank's answer. Another rank's failure is
        raised once seen: with this step if it came before the answer, else with the next."""
        self._broadcast(msg)
        while True:
            reply = self._recv()
            if isinstance(reply, wire.Failure):
                if reply.rank == OUTPUT_RANK and reply.seq == msg.seq:
                    raise self._fail(reply)
                if reply.seq not in self._raised_seqs:
                    self._late_failures.append(reply)
            elif isinstance(reply, wire.StepDone) and reply.seq == msg.seq:
                break
        late = [f for f in self._late_failures if f.seq not in self._raised_seqs]
        self._late_failures.clear()
        if late:
            raise self._fail(late[0])
        return reply.output

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._step(wire.ExecuteModel(self._next_seq(), scheduler_output))

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        self._step(wire.LaunchModel(self._next_seq(), scheduler_output))

    def collect_output(self) -> ModelRunnerOutput:
        return self._step(wire.CollectOutput(self._next_seq()))

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = ()
    ) -> list[Any]:
        """Only `Worker` method names cross the process boundary (no pickled functions)."""
        if not isinstance(method, str):
            raise TypeError(
                "MultiprocExecutor.collective_rpc takes a Worker method name: functions are not "
                "sent to worker processes (no pickle on the wire)."
            )
        seq = self._next_seq()
        self._broadcast(wire.Call(seq, method, list(args)))
        results: dict[int, Any] = {}
        failures: list[wire.Failure] = []
        while len(results) + len(failures) < len(self.procs):
            reply = self._recv()
            if isinstance(reply, wire.Failure) and reply.seq == seq:
                failures.append(reply)
            elif isinstance(reply, wire.Failure):
                self._late_failures.append(reply)
            elif isinstance(reply, wire.CallResult) and reply.seq == seq:
                results[reply.rank] = reply.result
        if failures:
            raise self._fail(min(failures, key=lambda f: f.rank))
        returns = wire.method_hints(Worker, method).get("return")
        return [wire.convert(results[rank], returns) for rank in range(len(self.procs))]

    def shutdown(self) -> None:
        self._closing = True
        self._finalizer()
