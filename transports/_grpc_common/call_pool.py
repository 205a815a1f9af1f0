"""A channel's call connections to one listener, kept in a LIFO pool: one connection per
call in flight, waiting for each answer in the calling thread.

What both call-connection data paths share (grpc+local's Unix call connections and the
grpc transport's TCP fast lane): the pool of idle connections (most recently used first,
so a steady caller keeps reusing one warm connection; connections idle for
``IDLE_CONNECTION_S`` are closed when one is next returned), the kernel receive timeout
that bounds each wait for an answer, and the deadline arithmetic.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Generic, TypeVar

from clusterwire import errors

#: A channel closes call connections idle for this long (when it next returns one).
IDLE_CONNECTION_S = 30.0
_TIMEVAL = struct.Struct("@ll")


def timeval(seconds: float) -> bytes:
    """A struct timeval of ``seconds`` for a socket timeout option (0: none)."""
    whole = int(seconds)
    micro = int((seconds - whole) * 1e6)
    if seconds and not whole and not micro:
        micro = 1  # 0 would mean "no timeout"
    return _TIMEVAL.pack(whole, micro)


def set_receive_timeout(sock: socket.socket, seconds: float) -> float:
    """Make a blocking socket's receives give up after ``seconds`` (0: never); returns it.

    A kernel timeout (SO_RCVTIMEO) rather than Python's: a socket with a Python timeout
    polls before every receive, which costs a call about as much as the receive itself.
    A receive that times out raises BlockingIOError.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(seconds))
    return seconds


def left(deadline: float | None,
         error: type[Exception] = errors.DeadlineExceededError) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic`` time; None: no deadline); ``error``
    (DeadlineExceededError, or e.g. TimeoutError where a socket's would be) if none left."""
    if deadline is None:
        return None
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise error("The deadline passed before the call was sent.")
    return remaining


class PooledConnection:
    """A channel's call connection: used by one call at a time, idle in the pool between
    calls."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.idle_since = 0.0
        self.receive_timeout = 0.0  # SO_RCVTIMEO in seconds (0: none)

    def arm(self, deadline: float | None) -> None:
        """Set the receive timeout so a wait for the answer returns by ``deadline`` (None:
        never gives up). Kept when it is already a little shorter than the time left, so a
        steady stream of calls with the same timeout costs no system call (a receive that
        times out early waits again)."""
        if deadline is None:
            if self.receive_timeout:
                self.receive_timeout = set_receive_timeout(self.sock, 0)
            return
        remaining = deadline - time.monotonic()
        if not 0.9 * remaining <= self.receive_timeout <= remaining:
            self.receive_timeout = set_receive_timeout(self.sock,
                                                       max(0.95 * remaining, 1e-6))


C = TypeVar("C", bound=PooledConnection)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class IdleConnections(Generic[C]):
    """The open call connections of one channel to one listener, and the idle ones among
    them (a LIFO stack)."""

    def __init__(self, address: str):
        self._address = address
        self._lock = threading.Lock()
        self._closed = False  # set once, by close()
        self._idle: list[C] = []  # most recently used last
        self._open: set[C] = set()  # idle and in use

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (the channel was closed)."""
        return self._closed

    def _raise_closed(self) -> None:
        raise errors.CancelledError(f"Channel to {self._address} is closed.")

    def take(self) -> C | None:
        """The most recently used idle connection, None if none; CancelledError once
        closed."""
        with self._lock:
            if self._closed:
                self._raise_closed()
            return self._idle.pop() if self._idle else None

    def add(self, connection: C) -> None:
        """Count a new connection as open (in use); CancelledError once closed (the caller
        closes it)."""
        with self._lock:
            if self._closed:
                self._raise_closed()
            self._open.add(connection)

    def put_back(self, connection: C) -> None:
        """Return a healthy connection to the pool; close those idle too long."""
        now = time.monotonic()
        connection.idle_since = now
        with self._lock:
            if self._closed:
                self._open.discard(connection)
                stale = [connection]
            else:
                self._idle.append(connection)
                if now - self._idle[0].idle_since <= IDLE_CONNECTION_S:
                    return
                stale = []
                while self._idle and now - self._idle[0].idle_since > IDLE_CONNECTION_S:
                    stale.append(self._idle.pop(0))
                    self._open.discard(stale[-1])
        for old in stale:
            _shutdown(old.sock)

    def discard(self, connection: C) -> None:
        """Close a connection that failed or may still get a late answer."""
        with self._lock:
            self._open.discard(connection)
        _shutdown(connection.sock)

    def closed_error(self, error: Exception) -> Exception:
        """``error``, or CancelledError if the channel was closed (closing it is what made
        the connection fail)."""
        if self._closed:
            return errors.CancelledError(f"Channel to {self._address} was closed.")
        return error

    def after_fork(self) -> None:
        """In a forked child: forget the parent's connections (closing only the child's
        copies), so that the two processes never share one."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        connections, self._open, self._idle = self._open, set(), []
        for connection in connections:
            connection.sock.close()

    def close(self) -> None:
        """Close every connection: calls waiting on one end (their receive fails)."""
        self._closed = True
        with self._lock:
            connections, self._open = list(self._open), set()
            idle, self._idle = self._idle, []
        for connection in connections:  # wakes the calls waiting on them
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)
        for connection in idle:
            connection.sock.close()
