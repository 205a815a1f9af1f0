"""The zmq channel: a pool of DEALER connections, one call at a time on each.

A call borrows an idle connection (or opens one), sends, and waits for its reply on that
connection in its own thread, so concurrent calls never hand messages between threads.
zmq connects lazily and never reports a dead peer to a DEALER, so each connection starts
with a HELLO/WELCOME handshake (which also brings the listener's size limit), and every
wait also watches the socket's monitor events (refused, handshake failed, disconnected)
and the channel's cancel pipe, which ``close`` writes to: the handshake polls all three,
a call looks at the other two between slices of a blocking receive (``await_call_reply``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from clusterwire import errors
from clusterwire.security import Security
from clusterwire.transport import Channel, ConnectionFailed, Frame, HandshakeFailed
from clusterwire_zmq import wire
from clusterwire_zmq.auth import configure_client, refuse_tls
from clusterwire_zmq.endpoints import connect_endpoint
from clusterwire_zmq.options import Settings
from clusterwire_zmq.sockets import NOBLOCK, readable, recv_parts, send_parts

_NO_LIMIT = 1 << 62
#: How long a call's receive waits inside libzmq before it looks for a close or a lost peer.
_SLICE_MS = 50
_SLICE_SECONDS = _SLICE_MS / 1000
#: A link idle for less than this is taken without reading its monitor first: its call
#: ended that recently, and a loss in between is noticed during the call (within a slice).
_FRESH_SECONDS = 0.001
_RCVTIMEO = int(zmq.RCVTIMEO)
_LOST = {
    zmq.EVENT_CONNECT_RETRIED: "connection refused or failed",
    zmq.EVENT_CLOSED: "connection closed",
    zmq.EVENT_DISCONNECTED: "connection lost",
}
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | _HANDSHAKE_FAILED | sum(_LOST))
_monitor_ids = itertools.count()


class _Link:
    """One DEALER connection with its monitor; used by one call at a time."""

    def __init__(self, context: zmq.Context, endpoint: str, ipv6: bool, settings: Settings,
                 security: Security | None, cancel_fd: int, address: str):
        self.address = address
        self.sock = context.socket(zmq.DEALER)
        self.events = context.socket(zmq.PAIR)
        try:
            settings.configure(self.sock, ipv6)
            configure_client(self.sock, security)
            # A failed link is replaced, never reconnected by libzmq: a link left retrying
            # would emit monitor events forever.
            self.sock.setsockopt(zmq.RECONNECT_IVL, -1)
            self.events.setsockopt(zmq.LINGER, 0)
            # For the same reason as in close(): a full monitor pipe would block too.
            self.events.setsockopt(zmq.RCVHWM, 0)
            monitor = f"inproc://clusterwire-zmq-monitor-{next(_monitor_ids)}"
            self.sock.monitor(monitor, _EVENTS)
            self.events.connect(monitor)
            self.sock.connect(endpoint)
        except BaseException:
            self.close()
            raise
        self.poller = zmq.Poller()
        for item in (self.sock, self.events, cancel_fd):
            self.poller.register(item, zmq.POLLIN)
        self.cancel_fd = cancel_fd
        self._cancelled = select.poll()  # poll, not select: descriptors may be over 1023
        self._cancelled.register(cancel_fd, select.POLLIN)
        self.reached = False  # the TCP connection is up
        self.connected = False  # the ZMTP handshake succeeded
        self.limit: int | None = None  # the listener's max_message_bytes, from WELCOME
        self.idle_since = 0.0  # time.monotonic() when its last call ended
        self._receive_timeout = -1  # the socket's RCVTIMEO (ms): libzmq's default, forever

    def close(self) -> None:
        # Detach the monitor first: libzmq sends monitor events with blocking sends from
        # the I/O thread, and the socket's teardown events, sent to a monitor whose reader
        # is gone, would block every connection of the context.
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.sock.close(linger=0)
        self.events.close(linger=0)

    def stale(self) -> bool:
        """Whether the connection dropped while the link sat idle."""
        try:
            while readable(self.events):
                self._on_event(sent=False)
        except errors.UnavailableError:
            return True
        return False

    def handshake(self, request_id: int, deadline: float | None) -> None:
        """HELLO -> WELCOME: the listener is alive; learn its limit."""
        hello = wire.encode(wire.HELLO, request_id, b"", [], 0)
        while True:
            try:
                send_parts(self.sock, hello, NOBLOCK)
                break
            except zmq.Again:  # libzmq dropped the pipe (handshake refused): events say why
                self._await_writable(deadline)
        welcome = self._await_welcome(request_id, deadline)
        if welcome.kind == wire.REPLY and welcome.status:  # refused: over max_connections
            raise errors.error_from_code(welcome.status,
                                         welcome.header.decode("utf-8", "replace"))
        if welcome.kind != wire.WELCOME:
            raise errors.InvalidArgumentError(
                f"{self.address} answered HELLO with a kind {welcome.kind} message.")
        self.limit = wire.welcome_limit(welcome)
        # WELCOME proves the ZMTP handshake, whose monitor event may still be unread.
        self.reached = self.connected = True

    def send(self, parts: list) -> None:
        try:
            send_parts(self.sock, parts, NOBLOCK)
        except zmq.Again:
            raise ConnectionFailed(f"Cannot send to {self.address}: not connected.") from None

    def _await_writable(self, deadline: float | None) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLOUT)
        poller.register(self.events, zmq.POLLIN)
        poller.register(self.cancel_fd, zmq.POLLIN)
        ready = dict(poller.poll(self._milliseconds(deadline, sent=False)))
        if self.cancel_fd in ready:
            raise errors.CancelledError(f"The zmq channel to {self.address} was closed.")
        if self.events in ready:
            self._on_event(sent=False)

    def _await_welcome(self, request_id: int, deadline: float | None) -> wire.Message:
        """The answer to HELLO ``request_id``; the error a failure, timeout or close stands for."""
        while True:
            ready = dict(self.poller.poll(self._milliseconds(deadline, sent=False)))
            if self.sock in ready:
                message = wire.decode(recv_parts(self.sock), _NO_LIMIT)
                if message.request_id == request_id:
                    return message
            elif self.cancel_fd in ready:
                raise errors.CancelledError(f"The zmq channel to {self.address} was closed.")
            elif self.events in ready:
                self._on_event(sent=False)

    def await_call_reply(self, request_id: int, deadline: float | None) -> wire.Message:
        """The reply to call ``request_id`` on a connected link, waiting inside libzmq.

        A blocking receive is the bare library's own wait: polling the socket, the
        monitor and the cancel pipe together cost a third of a small call. So the
        receive waits in slices of ``_SLICE_MS`` and the rest is looked at between them:
        a close or a lost peer is noticed within a slice.
        """
        while True:
            timeout = _SLICE_MS
            if deadline is not None and deadline - time.monotonic() < _SLICE_SECONDS:
                timeout = min(timeout, self._milliseconds(deadline, sent=True))
            if timeout != self._receive_timeout:
                self.sock.setsockopt(_RCVTIMEO, timeout)
                self._receive_timeout = timeout
            try:
                parts = recv_parts(self.sock)
            except zmq.Again:
                if self._cancelled.poll(0):
                    raise errors.CancelledError(
                        f"The zmq channel to {self.address} was closed.") from None
                try:
                    while readable(self.events):
                        self._on_event(sent=True)
                except errors.UnavailableError:
                    # The reply may have been queued after the receive timed out and before
                    # the loss was read (a server that answered, then stopped).
                    reply = self._queued_reply(request_id)
                    if reply is None:
                        raise
                    return reply
                continue
            message = wire.decode(parts, _NO_LIMIT)
            if message.request_id == request_id:
                return message

    def _queued_reply(self, request_id: int) -> wire.Message | None:
        """The reply to ``request_id`` if libzmq holds it already (without waiting)."""
        while True:
            try:
                message = wire.decode(recv_parts(self.sock, NOBLOCK), _NO_LIMIT)
            except zmq.Again:
                return None
            if message.request_id == request_id:
                return message

    def _milliseconds(self, deadline: float | None, sent: bool) -> int | None:
        """A poll timeout until ``deadline``; the timeout's error once it has passed."""
        if deadline is None:
            return None
        remaining = deadline - time.monotonic()
        if remaining > 0:
            return max(1, int(remaining * 1000))
        if not self.connected:
            raise ConnectionFailed(
                f"Cannot connect to {self.address}: no zmq connection within the deadline.")
        what = "call" if sent else "handshake"
        raise errors.DeadlineExceededError(
            f"The {what} to {self.address} did not finish within its deadline.")

    def _on_event(self, sent: bool) -> None:
        event = parse_monitor_message(self.events.recv_multipart())["event"]
        if event == zmq.EVENT_CONNECTED:
            self.reached = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise errors.UnauthenticatedError(
                f"The zmq listener at {self.address} refused this client's cluster token.")
        elif event & _HANDSHAKE_FAILED or (self.reached and not self.connected):
            # Reached over TCP, dropped before ZMTP completed: something else listens there.
            raise HandshakeFailed(
                f"The ZMTP handshake with {self.address} failed: not a clusterwire zmq "
                "listener, or one with other security settings.")
        elif sent:
            raise errors.UnavailableError(
                f"zmq peer {self.address}: {_LOST.get(event)} while a call was in flight.")
        else:
            raise ConnectionFailed(f"Cannot reach {self.address} over zmq: {_LOST.get(event)}.")


class ZmqChannel(Channel):
    """A channel to one zmq listener, shared between threads."""

    def __init__(self, context: zmq.Context, address: str, settings: Settings,
                 security: Security | None = None):
        refuse_tls(security)
        self._endpoint, self._ipv6 = connect_endpoint(address)
        self._security = security
        self._context = context
        self._address = address
        self._settings = settings
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._idle: list[_Link] = []
        self._users = 0
        self._closed = False
        # Written once by close(), never read: wakes every wait of every link.
        self._cancel_r, self._cancel_w = os.pipe()

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        views = wire.byte_views(frame.buffers)
        header = frame.header if isinstance(frame.header, bytes) else bytes(frame.header)
        link = self._checkout()
        keep = False
        try:
            if link.limit is None:
                link.handshake(next(self._ids), deadline)
            total = sum(v.nbytes for v in views)
            if total > link.limit:
                keep = True
                raise errors.ResourceExhaustedError(
                    f"Frame of {total} bytes exceeds the limit of {link.limit} bytes "
                    f"(max_message_bytes) of the zmq listener at {self._address}.")
            request_id = next(self._ids)
            link.send(wire.encode(wire.REQUEST, request_id, header, views,
                                  self._settings.inline_bytes))
            reply = link.await_call_reply(request_id, deadline)
            keep = True
        finally:
            self._checkin(link, keep)
        if reply.status:
            raise errors.error_from_code(reply.status, reply.header.decode("utf-8", "replace"))
        if reply.kind != wire.REPLY:
            raise errors.InvalidArgumentError(
                f"{self._address} answered a request with a kind {reply.kind} message.")
        return Frame(reply.header, reply.buffers)

    def _checkout(self) -> _Link:
        with self._lock:
            if self._closed:
                raise errors.CancelledError(f"The zmq channel to {self._address} is closed.")
            self._users += 1
            now = time.monotonic()
            while self._idle:
                link = self._idle.pop()
                if now - link.idle_since < _FRESH_SECONDS or not link.stale():
                    return link
                link.close()
        try:
            return _Link(self._context, self._endpoint, self._ipv6, self._settings,
                         self._security, self._cancel_r, self._address)
        except BaseException:
            self._checkin(None, False)
            raise

    def _checkin(self, link: _Link | None, keep: bool) -> None:
        with self._lock:
            self._users -= 1
            if keep and link is not None and not self._closed:
                link.idle_since = time.monotonic()
                self._idle.append(link)
                link = None
            release = self._closed and self._users == 0
        if link is not None:
            link.close()
        if release:
            self._release_pipe()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, []
            os.write(self._cancel_w, b"\0")
            release = self._users == 0
        for link in idle:
            link.close()
        if release:
            self._release_pipe()

    def _release_pipe(self) -> None:
        with self._lock:
            fds, self._cancel_r, self._cancel_w = (self._cancel_r, self._cancel_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
