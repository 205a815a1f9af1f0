"""A ROUTER socket shared by a listener's worker threads.

zmq sockets are not thread-safe, so every zmq call on the socket happens under one lock,
and a thread waiting for a request blocks in ``poll`` on the socket's ``ZMQ_FD`` (outside
the lock), never inside libzmq. That lets the thread that receives a request also run the
handler and send the reply: no hand-off between threads on the path of a call.

``ZMQ_FD`` is edge-triggered: any zmq call on the socket may consume its readiness. So
after every receive or send that leaves a request pending while other threads wait, the
caller pokes them through a pipe.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading

import zmq

from clusterwire_zmq.sockets import recv_parts, send_parts

_POLLIN = select.POLLIN


class SharedRouter:
    """A bound ROUTER socket: ``receive`` from any thread, ``send`` from any thread."""

    def __init__(self, sock: zmq.Socket):
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._wake_r, self._wake_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._waiting = 0
        self._stopping = False
        self._closed = False

    def poller(self) -> select.poll:
        """A poll object for one thread's ``receive`` calls (poll objects are not shared)."""
        poller = select.poll()
        for fd in (self._fd, self._wake_r, self._stop_r):
            poller.register(fd, _POLLIN)
        return poller

    def receive(self, poller: select.poll) -> list[zmq.Frame] | None:
        """The next message (routing id first), or None once ``interrupt`` was called."""
        while True:
            with self._lock:
                if self._stopping:
                    return None
                try:
                    parts = recv_parts(self._sock, zmq.NOBLOCK)
                except zmq.Again:
                    self._waiting += 1
                else:
                    poke = self._pending_for_waiters()
                    break
            self._wait(poller)
        if poke:
            self._poke()
        return parts

    def _wait(self, poller: select.poll) -> None:
        try:
            ready = poller.poll()
        finally:
            with self._lock:
                self._waiting -= 1
                self._idle.notify_all()
        if any(fd == self._wake_r for fd, _ in ready):
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)

    def _pending_for_waiters(self) -> bool:
        """Under the lock: a request is pending that waiting threads may not be told of."""
        return bool(self._waiting and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes them anyway
            os.write(self._wake_w, b"\0")

    def send(self, parts: list) -> None:
        """Send one message (routing id first); dropped once the socket is closed."""
        with self._lock:
            if self._closed:
                return
            try:
                send_parts(self._sock, parts, zmq.NOBLOCK)
            except zmq.ZMQError:
                return  # the peer is gone: ROUTER has nowhere to send, as after a disconnect
            poke = self._pending_for_waiters()
        if poke:
            self._poke()

    def interrupt(self) -> None:
        """Make every current and future ``receive`` return None."""
        with self._lock:
            self._stopping = True
        os.write(self._stop_w, b"\0")  # never read: wakes every poll from now on

    def close(self, linger_ms: int) -> None:
        """Close the socket once no thread waits on it; unsent replies get ``linger_ms``."""
        self.interrupt()
        with self._lock:
            self._idle.wait_for(lambda: self._waiting == 0, timeout=10)
            self._closed = True
            self._sock.close(linger=linger_ms)
        for fd in (self._wake_r, self._wake_w, self._stop_r, self._stop_w):
            os.close(fd)
