"""A ROUTER socket shared by a listener's worker threads.

zmq sockets are not thread-safe, so every zmq call on the socket happens under one lock,
and the thread waiting for a request (the listener's leader: one at a time) blocks in
``poll`` on the socket's ``ZMQ_FD`` (outside the lock), never inside libzmq. That lets the
thread that receives a request also run the handler and send the reply: no hand-off
between threads on the path of a call.

libzmq signals ``ZMQ_FD`` for a connection's next message only once a read (or a
``ZMQ_EVENTS`` query) has found the socket empty, and any zmq call may consume a pending
signal (a reply's send too). So a thread reads again (``block=False``) after its last
zmq call before it waits or parks: ``receive`` asks ``ZMQ_EVENTS`` before it waits.
After a wake-up it reads at once: a request is what wakes it, nearly always.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading

import zmq

from clusterwire_zmq.sockets import NOBLOCK, readable, recv_parts, send_parts


class SharedRouter:
    """A bound ROUTER socket: ``receive`` from any thread, ``send`` from any thread."""

    def __init__(self, sock: zmq.Socket, max_parts: int):
        """``max_parts``: a message of more parts is received as its first ``max_parts + 1``
        (see ``recv_parts``)."""
        self._sock = sock
        self._max_parts = max_parts
        self._fd = sock.getsockopt(zmq.FD)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._stop_r, self._stop_w = os.pipe()
        self._waiting = 0
        self._stopping = False
        self._closed = False

    def poller(self) -> select.epoll | None:
        """A waiting set for one thread's ``receive`` calls (one per thread, closed with it);
        None once ``interrupt`` was called (``close`` may have closed the descriptors)."""
        with self._lock:
            if self._stopping:
                return None
            poller = select.epoll()
            poller.register(self._fd, select.EPOLLIN)
            poller.register(self._stop_r, select.EPOLLIN)
            return poller

    def receive(self, poller: select.epoll, block: bool = True) -> list[zmq.Frame] | None:
        """The next message (routing id first); None once ``interrupt`` was called, or at
        once when nothing is pending and ``block`` is false."""
        woken = False
        while True:
            with self._lock:
                if self._stopping:
                    return None
                if woken:
                    try:
                        return recv_parts(self._sock, NOBLOCK, self._max_parts)
                    except zmq.Again:  # woken by another of libzmq's commands
                        pass
                if readable(self._sock):
                    return recv_parts(self._sock, NOBLOCK, self._max_parts)
                if not block:
                    return None
                self._waiting += 1
            try:
                poller.poll()
            finally:
                with self._lock:
                    self._waiting -= 1
                    if self._stopping:  # close() waits for the last waiter
                        self._idle.notify_all()
            woken = True

    def send(self, parts: list) -> None:
        """Send one message (routing id first); dropped once the socket is closed."""
        with self._lock:
            if self._closed:
                return
            try:  # noqa: SIM105  (contextlib.suppress: three more Python calls per reply)
                send_parts(self._sock, parts, NOBLOCK)
            except zmq.ZMQError:  # a ROUTER drops replies to gone peers
                pass

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
            # A monitor's reader closes after this; libzmq would block on its dead pipe.
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._sock.close(linger=linger_ms)
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
