"""Requests to a server of this process, served without its transport.

A worker process that opens a ``Session`` on its own server (TensorFlow's ``LocalMaster``
case), a task forwarding to a task of the same process, or a data consumer beside its
worker reach that server's ``Shell`` directly: no socket, no serialization of tensor bytes,
no transport threads. Every ``RequestClient`` looks here first, by protocol and address.

What stays the same as over the wire:

* the listener shell's policy: admission (``max_concurrent_calls``), drain and stop, error
  mapping; ``max_message_bytes``;
* security: the cluster token is checked (constant time) as on the wire. Under TLS, only
  a caller with the server's own credentials (certificate, key and CA: the server's own
  process, e.g. its forwarding or a Session given the server's configuration) skips the
  transport; any other caller goes through it and its TLS handshake;
* deadlines and cancellation: a request that may wait (a remote function, a barrier, a
  forwarded request, a data-service long poll) runs on the shell's own threads while the
  caller waits for its deadline, its client's ``close()`` or the server's stop;
  a request the handler says is served at once (a get, put, delete, list or status, also
  one forwarded to another task, whose forward is given the caller's deadline) runs in the
  caller's thread;
* buffer ownership: neither side may change the other's data. A request's writable
  buffers are copied once, read-only ones are shared; a response's buffers are shared
  read-only when the handler marks them frozen (a stored tensor: a 64 MiB get copies
  nothing), else copied like a request's.

Values received this way are read-only arrays; ``.copy()`` one to modify it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from clusterwire.security import Security
from clusterwire.transport import Buffer


class InProcessShell(Protocol):
    """What this module and its callers need of a server's ``clusterwire.shell.Shell``
    (which registers itself here, so this module may not import it)."""

    def takes_in_process(self, security: Security) -> bool:
        """Whether a caller of this process with ``security`` skips the transport."""

    def in_process_channel(self, security: Security, closing: threading.Event) -> Any:
        """The channel (``clusterwire.transport.Channel``) of a caller of this process."""


_shells: dict[tuple[str, str], InProcessShell] = {}
_lock = threading.Lock()
_caller = threading.local()  # .serving, .deadline: the in-process caller this thread serves


_inherited: list[str] = []  # in a forked child: the targets its parent served


def _forget_after_fork() -> None:
    """A forked child has a copy of the servers' state but none of their threads or
    sockets: it must reach them over the wire, never serve itself from a stale copy."""
    global _lock
    _inherited.extend(f"{protocol}://{address}" for protocol, address in _shells)
    _shells.clear()
    _lock = threading.Lock()  # it may have been held by a parent thread at the fork


os.register_at_fork(after_in_child=_forget_after_fork)


def register(protocol: str, address: str, shell: InProcessShell) -> None:
    """Make ``shell`` the in-process server of ``protocol://address``."""
    with _lock:
        _shells[protocol, address] = shell


def unregister(shell: InProcessShell) -> None:
    """Forget every address ``shell`` was registered under."""
    with _lock:
        for key in [key for key, known in _shells.items() if known is shell]:
            del _shells[key]


def inherited_servers() -> list[str]:
    """In a process forked from one that ran clusterwire servers: their targets
    (``protocol://address``). None of their threads, nor gRPC's, came along, so gRPC may not
    work here; empty in any other process."""
    return list(_inherited)


def lookup(protocol: str, address: str) -> InProcessShell | None:
    """The shell serving ``protocol://address`` in this process, if any."""
    return _shells.get((protocol, address))


class serving_until:  # noqa: N801 - used as a function: ``with serving_until(deadline):``
    """Mark this thread as serving an in-process caller whose deadline (``time.monotonic``)
    is ``deadline``: requests it sends on ask for no more than the time left. (A class, not
    a generator context manager: it is on every in-process call's path.)"""

    __slots__ = ("_deadline",)

    def __init__(self, deadline: float | None):
        self._deadline = deadline

    def __enter__(self) -> None:
        _caller.serving, _caller.deadline = True, self._deadline

    def __exit__(self, *exc_info: object) -> None:
        _caller.serving, _caller.deadline = False, None


def serving() -> bool:
    """True while this thread serves a caller of this process (``serving_until``)."""
    return getattr(_caller, "serving", False)


def time_left() -> float | None:
    """Seconds left for the in-process caller this thread serves; None if it serves none
    (or the caller has no deadline)."""
    deadline = getattr(_caller, "deadline", None)
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def is_immutable(buffer: Any) -> bool:
    """True when no one can write the memory behind ``buffer`` (safe to share, not copy).

    A buffer type whose memory is read-only by construction (e.g. a sealed shared-memory
    mapping) says so with a true class attribute ``clusterwire_immutable``.
    """
    base = buffer
    while base is not None:
        if isinstance(base, bytes) or getattr(type(base), "clusterwire_immutable", False):
            return True
        if isinstance(base, memoryview):
            if not base.readonly:
                return False
            base = base.obj
        elif isinstance(base, np.ndarray):
            if base.flags.writeable:
                return False
            if base.base is None:  # a read-only array owning its memory
                return True
            base = base.base
        else:
            return False
    return False


def frozen_copy(buffer: Buffer) -> np.ndarray:
    """A read-only private copy of ``buffer``."""
    copy = np.frombuffer(memoryview(buffer).cast("B"), np.uint8).copy()
    copy.flags.writeable = False
    return copy


def hand_over(buffers: Sequence[Buffer], frozen: bool = False,
              keep: Callable[[Buffer], Buffer | None] | None = None) -> list[Buffer]:
    """``buffers`` as another party of this process may hold them: what ``keep`` (a
    transport's ``Transport.keep``) makes of one, else read-only views of memory no one
    writes (all of it when ``frozen``) and private copies of the rest."""
    held = []
    for buffer in buffers:
        kept = keep(buffer) if keep is not None else None
        if kept is None:
            kept = (memoryview(buffer).toreadonly() if frozen or is_immutable(buffer)
                    else frozen_copy(buffer))
        held.append(kept)
    return held
