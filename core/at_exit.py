"""Stop the servers still running when the interpreter exits, before thread pools close.

At exit, Python runs threading's exit hooks (among them concurrent.futures',
which makes every thread pool refuse new work) before atexit functions and
``weakref.finalize`` callbacks. A request reaching a gRPC server in between
kills the server's polling thread, and stopping that server afterwards
waits forever: a script that never called ``stop()`` (TF's examples do not)
would hang at exit. Servers therefore make their stop finalizer with
``stop_at_exit``, whose hook is registered after concurrent.futures' own and
so runs before it (the hooks run last-registered first).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_finalizers: list[weakref.finalize] = []
_hooked = False


def stop_at_exit(owner: object, stop: Callable[..., Any], *args: Any) -> weakref.finalize:
    """``weakref.finalize(owner, stop, *args)``, also called at interpreter exit before
    thread pools close (``detach()`` it to stop the owner yourself)."""
    global _hooked
    finalizer = weakref.finalize(owner, stop, *args)
    with _lock:
        if not _hooked:
            import concurrent.futures.thread  # noqa: F401  (its hook must be registered first)

            threading._register_atexit(_stop_all)
            _hooked = True
        _finalizers[:] = [f for f in _finalizers if f.alive]
        _finalizers.append(finalizer)
    return finalizer


def _stop_all() -> None:
    with _lock:
        finalizers = _finalizers[::-1]  # the newest first, as weakref.finalize does
        _finalizers.clear()
    for finalizer in finalizers:
        finalizer()
