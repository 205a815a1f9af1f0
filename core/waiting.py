"""Waiting in the main thread without delaying signal handlers."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

# CPython runs signal handlers in the main thread only, and a signal the kernel
# delivers to another thread (gRPC's, UCX's) does not interrupt the main
# thread's lock wait: an unbounded Event.wait() could sleep through Ctrl-C or
# SIGTERM for good. So the main thread waits in select() on a pipe that both the
# signal wakeup fd (written by CPython's C handler, in whichever thread it runs)
# and the event (through a relay thread) write to: it wakes for either, and for
# nothing else.


def wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)``; in the main thread, a signal's handler runs as soon as the
    signal arrives, whichever thread the kernel handed it to."""
    if threading.current_thread() is not threading.main_thread():
        return event.wait(timeout)
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    guard = threading.Lock()
    closed = False

    def relay() -> None:
        event.wait(timeout)
        with guard:
            if not closed:
                with contextlib.suppress(BlockingIOError):
                    os.write(write, b"\0")

    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        threading.Thread(target=relay, daemon=True, name="clusterwire-wait-relay").start()
        while not event.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            select.select([read], [], [], left)  # handlers run on the way out
            with contextlib.suppress(BlockingIOError):
                os.read(read, 512)
        return event.is_set()
    finally:
        signal.set_wakeup_fd(previous)
        with guard:
            closed = True
            os.close(read)
            os.close(write)
