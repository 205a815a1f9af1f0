"""The processes the kits and tests start as peers (a listener, a hostile server, a flood):
their parent ends them by closing their stdin."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def stop_on_stdin_close(stop: threading.Event) -> None:
    """Set ``stop`` once this process's stdin ends (its parent closed it, or died)."""
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True,
                     name="clusterwire-stdin-watch").start()


def run_threads(work: Callable[[threading.Event], None], threads: int,
                seconds: float) -> None:
    """Run ``work(stop)`` on ``threads`` threads until ``seconds`` pass or stdin ends, then
    set ``stop`` and return once every thread returned."""
    stop = threading.Event()
    running = [threading.Thread(target=work, args=(stop,), daemon=True)
               for _ in range(threads)]
    for thread in running:
        thread.start()
    stop_on_stdin_close(stop)
    stop.wait(seconds)
    stop.set()
    for thread in running:
        thread.join()
