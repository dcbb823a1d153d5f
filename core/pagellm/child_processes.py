"""The lifetime of pagellm's child processes (the engine core, the worker ranks): they leave when
their parent dies (`exit_when_orphaned`), and their parent stops them asked, then forced
(`join_or_kill`)."""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)

_PARENT_CHECK_INTERVAL_S = 1.0


def exit_when_orphaned(parent_pid: int) -> None:
    """If the parent dies without shutting us down, nobody will: leave too (a sent step output
    would otherwise block forever on a socket with no reader). Run in a daemon thread."""
    while True:
        time.sleep(_PARENT_CHECK_INTERVAL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def join_or_kill(proc: BaseProcess, timeout_s: float, what: str) -> None:
    """Wait ``timeout_s`` for a process already asked to stop, then terminate it, wait as long
    again, then kill it."""
    proc.join(timeout_s)
    if proc.exitcode is None:
        logger.warning("%s did not stop in %.0f s: terminating", what, timeout_s)
        proc.terminate()
        proc.join(timeout_s)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
