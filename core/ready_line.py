"""The ``CLUSTERWIRE_READY <target>`` line a server process prints on stdout once it serves.

Launchers read it (``clusterwire.local_cluster.await_ready``); several servers often share
one stdout (``srun``, ``mpirun``, a shell's ``&``, threads of one process). ``print`` writes
the text and its newline separately, which an unbuffered stdout (``python -u``,
``PYTHONUNBUFFERED``) passes on as two writes: another process's line can land between
them. ``say_ready`` writes the whole line in one ``write`` instead, which a pipe keeps whole
(a line is far under ``PIPE_BUF``).
"""

from __future__ import annotations

import os
import sys
import threading

READY_PREFIX = "CLUSTERWIRE_READY "

_LOCK = threading.Lock()


def say_ready(target: str) -> None:
    """Write ``CLUSTERWIRE_READY <target>`` and its newline to stdout in one piece."""
    line = f"{READY_PREFIX}{target}\n"
    with _LOCK:
        sys.stdout.flush()  # what was printed before goes first
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):
            sys.stdout.write(line)  # a stream without a descriptor (captured output)
            sys.stdout.flush()
            return
        os.write(fd, line.encode())
