"""`exit_when_orphaned`: a child process (the engine core, a worker rank) that outlives its parent
leaves too."""

from __future__ import annotations

import os
import time

_PARENT_CHECK_INTERVAL_S = 1.0


def exit_when_orphaned(parent_pid: int) -> None:
    """If the parent dies without shutting us down, nobody will: leave too (a sent step output
    would otherwise block forever on a socket with no reader). Run in a daemon thread."""
    while True:
        time.sleep(_PARENT_CHECK_INTERVAL_S)
        if os.getppid() != parent_pid:
            os._exit(1)
