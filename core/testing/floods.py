"""Raw connections an unauthenticated peer holds open: shared by the transport conformance
kit (``clusterwire.testing.suite``) and the surface kit's hostile peer
(``clusterwire.testing.hostile_peer``)."""

from __future__ import annotations

import errno
import os
import resource
import socket
import time

#: The floods ``clusterwire.testing.hostile_peer`` runs.
FLOODS = ("silent", "reconnecting", "garbage", "h2_preface", "health_watch", "health_names")


def raise_descriptor_limit(needed: int) -> None:
    """Raise RLIMIT_NOFILE's soft limit to ``needed``; OSError if the hard one is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed or soft == resource.RLIM_INFINITY:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise OSError(errno.EMFILE, f"{needed} descriptors needed; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def require_descriptors(needed: int) -> None:
    """``raise_descriptor_limit`` for a test: skip it when the hard limit is lower."""
    import pytest

    try:
        raise_descriptor_limit(needed)
    except OSError as err:
        pytest.skip(err.strerror)


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the listener closed non-blocking ``sock`` (what it sent before is dropped)."""
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:  # reset by the peer
        return True
    return True


def connect(sock: socket.socket, address) -> None:
    """Connect ``sock``, retrying while a Unix listener's backlog is full (connect fails at
    once then, where TCP waits)."""
    deadline = time.monotonic() + 10
    while (code := sock.connect_ex(address)) == errno.EAGAIN and time.monotonic() < deadline:
        time.sleep(0.001)
    if code:
        raise OSError(code, f"cannot connect to {address!r}: {os.strerror(code)}")


class SilentFlood:
    """``count`` raw connections to ``address``, each sending ``greeting`` (nothing by
    default) once connected and nothing after; connecting (and greeting) may take
    ``timeout`` seconds each. With ``fill`` False, none is opened until ``reopen``.
    ``source``: the local address the connections are bound to (another peer's)."""

    def __init__(self, count: int, family: int, kind: int, address, greeting: bytes = b"",
                 timeout: float = 10.0, fill: bool = True, source: tuple | None = None):
        self.sockets: list[socket.socket] = []
        self._closed: set[socket.socket] = set()
        self._target = (family, kind, address)
        self._greeting = greeting
        self._source = source
        self._count, self._timeout = count, timeout
        #: Connections opened so far, reopened ones included.
        self.connects = 0
        try:
            for _ in range(count if fill else 0):
                self.sockets.append(self._open())
        except BaseException:
            self.close()
            raise

    def _open(self) -> socket.socket:
        family, kind, address = self._target
        sock = socket.socket(family, kind)
        try:
            sock.settimeout(self._timeout)
            if self._source is not None:
                sock.bind(self._source)
            connect(sock, address)
            if self._greeting:
                sock.sendall(self._greeting)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.connects += 1
        return sock

    def closed(self) -> int:
        """How many of the connections the listener has closed so far."""
        for sock in self.sockets:
            if sock not in self._closed and peer_closed(sock):
                self._closed.add(sock)
        return len(self._closed)

    def reopen(self, oldest: int = 0) -> int:
        """Replace the connections the listener closed, and the ``oldest`` ones still open,
        with new ones (a reconnecting flood); how many were opened."""
        self.closed()
        still_open = [sock for sock in self.sockets if sock not in self._closed]
        for sock in [*self._closed, *still_open[:oldest]]:
            sock.close()
        self.sockets, self._closed = still_open[oldest:], set()
        opened = 0
        try:
            while len(self.sockets) < self._count:
                self.sockets.append(self._open())
                opened += 1
        except OSError:
            pass  # the listener's backlog is full: the next round tries again
        return opened

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()

