"""Waiting in the main thread without delaying signal handlers."""

from __future__ import annotations

import threading
import time

# CPython runs signal handlers in the main thread only, and a signal the kernel
# delivers to another thread (gRPC's, UCX's) does not interrupt the main
# thread's lock wait: an unbounded Event.wait() could sleep through Ctrl-C or
# SIGTERM for good. Waiting in slices bounds that delay.
_SLICE_SECONDS = 0.2


def wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)``, waking at least every 0.2 s so signal handlers run."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        slice_seconds = _SLICE_SECONDS
        if deadline is not None:
            slice_seconds = min(slice_seconds, deadline - time.monotonic())
            if slice_seconds <= 0:
                return event.is_set()
        if event.wait(slice_seconds):
            return True
