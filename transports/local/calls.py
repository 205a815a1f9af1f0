"""Call connections of grpc+local (no TLS): one Unix SOCK_SEQPACKET connection a call in flight.

Both ends: the listener serves each connection on a thread of its own
(``CallConnection``), running the handler inline under a work slot and answering on
the same connection; a channel keeps a LIFO pool of idle connections (``CallPool``) and
waits for each answer in the calling thread. The messages are described in ``wire``.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections import deque
from typing import NoReturn, Protocol

from clusterwire import errors
from clusterwire.envelope import REPLY_LIMIT, Envelope
from clusterwire.security import Security
from clusterwire.thread_pool import WorkSlots, serve_parking
from clusterwire.transport import ConnectionFailed, Frame, Handler, HandshakeFailed
from clusterwire.transports._grpc_common.call_pool import IdleConnections, PooledConnection, left
from clusterwire.transports.local import unix, wire
from clusterwire.transports.local.pool import PoolRegistry
from clusterwire.transports.local.probe import other_protocol
from clusterwire.transports.local.segments import (
    check_descriptors,
    plan_buffers,
    received_buffers,
)


class CallListener(Protocol):
    """What a ``CallConnection`` needs of the listener that accepted it (grpc+local's
    ``LocalListener``, which imports this module)."""

    slots: WorkSlots
    pools: PoolRegistry
    idle_timeout: float

    @property
    def address(self) -> str: ...

    @property
    def handler(self) -> Handler: ...

    @property
    def limit(self) -> int: ...

    @property
    def segment_bytes(self) -> int: ...

    def begin(self, connection: CallConnection) -> bool:
        """``connection`` starts running a call; False (not to run) once stopping."""

    def end(self, connection: CallConnection) -> bool:
        """``connection``'s call was answered; False if it is to close (stopping)."""

    def forget(self, connection: CallConnection) -> None:
        """Drop the closed ``connection``."""



class CallConnection:
    """The listener's side of one call connection: a thread of its own reads a call, runs
    the handler inline under a work slot and answers on the same connection, one call at
    a time. A call has one answer: the handler's, or ``CancelledError`` from ``stop``."""

    def __init__(self, listener: CallListener, sock: socket.socket, peer: str):
        """``peer``: who the client is (``unix.peer_name``), given to each request."""
        self.sock = sock
        self.peer = peer
        self._listener = listener
        self._lock = threading.Lock()  # one answer per call
        self._packet_limit = unix.packet_limit(sock)
        self._process = unix.peer_process(sock)
        self._pool = listener.pools.acquire(self._process)
        self._pool_held = True  # until close() gives it back (under _lock)
        self.call_id = 0  # the call read last
        self.busy = False  # running a call (under the listener's lock)
        self._answered = True
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="clusterwire-local-calls")

    def start(self) -> None:
        """Start serving the connection on its own thread."""
        self._thread.start()

    def _serve(self) -> None:
        listener = self._listener
        serve_parking(listener.slots)
        try:
            while True:
                try:
                    op, ident, body, fds = unix.read_message(
                        self.sock, idle_timeout=listener.idle_timeout,
                        on_release=self._pool.release)
                except (unix.Garbage, unix.Closed, OSError):
                    return
                if op != unix.CONTROL:  # READY or ERROR: a client never sends them
                    unix.close_all(fds)
                    return
                try:
                    control = wire.LAYOUT.decode(body, listener.limit)
                    ident = control.fields[1]
                    check_descriptors(control, fds)
                except errors.OpError as err:  # answered; the connection stays usable
                    unix.close_all(fds)
                    fields = wire.LAYOUT.peek_fields(body)
                    unix.send_error(self.sock, ident or (fields[1] if fields else 0),
                                    err.error_code, err.message)
                    continue
                self.call_id = ident
                self._answered = False  # before begin(): from then on stop() may cancel it
                if not listener.begin(self):
                    unix.close_all(fds)
                    unix.send_error(self.sock, ident, errors.UNAVAILABLE,
                                    f"The server at {listener.address} is stopping; the "
                                    "call was not run.")
                    return
                answered = self._answer(ident, *self._run(ident, control, fds))
                if not listener.end(self) or not answered:
                    return
        finally:
            self.close()

    def _run(self, ident: int, control: Envelope, fds: list[int]
             ) -> tuple[bytes | None, list[int], int, str]:
        """(reply message, its descriptors, error code, error text) for one call."""
        listener = self._listener
        try:
            buffers = received_buffers(control, fds)  # takes (and on failure closes) fds
            if not listener.slots.acquire():
                raise errors.CancelledError(f"The server at {listener.address} stopped.")
            try:
                response = listener.handler(Frame(control.header, buffers, peer=self.peer))
            finally:
                listener.slots.release()
            views, kinds, places, out = plan_buffers(
                response.buffers, listener.segment_bytes,
                lambda packed: self._pool.pack(packed, self))
            try:
                return (wire.LAYOUT.encode((0, ident), response.header, views, kinds, places),
                        out, 0, "")
            except BaseException:
                unix.close_all(out)
                raise
        except errors.OpError as err:
            return None, [], err.error_code, err.message
        except Exception as err:  # the handler's bug: an error answer, not a dead connection
            return None, [], errors.INTERNAL, f"Handler failed: {type(err).__name__}: {err}"

    def _answer(self, ident: int, message: bytes | None, fds: list[int], code: int,
                text: str) -> bool:
        """Send the call's answer unless ``stop`` gave it already; False if the connection
        failed (the client left, or does not read its answers)."""
        try:
            with self._lock:
                if self._answered:
                    return False
                self._answered = True
                if message is None:
                    self.sock.send(wire.encode_error(ident, code, text), socket.MSG_DONTWAIT)
                else:  # never blocks: a client that does not read its answers is dropped
                    unix.send_message(self.sock, ident, message, fds, self._packet_limit)
            return True
        except OSError:
            return False
        finally:
            unix.close_all(fds)

    def cancel(self) -> None:
        """Answer the running call with CancelledError (the handler's late answer is
        dropped) and close the connection."""
        with self._lock:
            if not self._answered:
                self._answered = True
                unix.send_error(self.sock, self.call_id, errors.CANCELLED,
                                f"The server at {self._listener.address} stopped during "
                                "the call.")
        self.close()

    def close(self) -> None:
        """Shut the connection down (wakes its thread); the listener forgets it, and its
        client process's reply pool one user (once)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._listener.forget(self)
        with self._lock:
            held, self._pool_held = self._pool_held, False
        if held:
            self._pool.forget(self)
            self._listener.pools.release(self._process, self._pool)
        if threading.current_thread() is self._thread:
            self.sock.close()


class ClientConnection(PooledConnection):
    """A channel's call connection (``PooledConnection``) on a SEQPACKET socket."""

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
        self.packet_limit = unix.packet_limit(sock)


class CallPool:
    """A channel's calls over call connections to one listener: a LIFO pool of idle
    connections (one per call in flight; those idle for a while are closed), and each
    call's answer awaited in the calling thread."""

    def __init__(self, address: str, security: Security, client_id: int):
        self._address = address
        self._security = security
        self._client_id = client_id
        self._ids = itertools.count(1)
        self._connections: IdleConnections[ClientConnection] = IdleConnections(address)
        #: Inodes of the listener's reply segments no longer mapped here, named in a RELEASE
        #: before the next call on any connection (the listener keeps one pool for all of
        #: this process's); appended by finalizers, from any thread.
        self._released: deque[int] = deque()

    def after_fork(self) -> None:
        """In a forked child: forget the parent's call connections (closing only the
        child's copies), so that the two processes never share one."""
        self._connections.after_fork()

    def _connect(self, deadline: float | None) -> ClientConnection:
        """A new call connection, admitted by the listener (nothing of a call sent yet)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                unix.connect(sock, unix.socket_name(self._address), left(deadline))
                sock.settimeout(left(deadline))  # a Python timeout until admitted
            except TimeoutError:
                raise errors.DeadlineExceededError(
                    f"Connecting to the grpc+local server at {self._address} took past the "
                    "deadline (its accept queue is full).") from None
            except OSError as err:
                elsewhere = unix.another_host(self._address) or other_protocol(
                    self._address, self._security, deadline)
                if elsewhere is not None:
                    raise elsewhere from None
                raise ConnectionFailed(
                    f"cannot reach a grpc+local server at {self._address} on this host "
                    f"({err.strerror}); grpc+local connects only tasks of the same "
                    "host.") from None
            connection = ClientConnection(sock)
            self._connections.add(connection)
        except BaseException:
            sock.close()
            raise
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                # Refused at accept (max_connections): its reason is queued for us to read.
                sock.send(wire.encode_unix(wire.CALLS, self._client_id, 0,
                                           self._security.token or b""))
            op, _, body, _ = unix.read_message(sock)
        except TimeoutError:
            self._discard(connection)
            raise errors.DeadlineExceededError(
                f"The grpc+local server at {self._address} did not admit the connection "
                "within the deadline.") from None
        except (OSError, unix.Closed, unix.Garbage) as err:
            self._fail(connection, ConnectionFailed(
                f"The grpc+local server at {self._address} closed the connection at once "
                f"({type(err).__name__}): it is stopping, or not a grpc+local server."))
        except BaseException:
            self._discard(connection)
            raise
        if op == wire.READY:
            sock.settimeout(None)  # blocking: calls wait with a kernel timeout (arm)
            return connection
        self._discard(connection)
        if op != wire.ERROR:
            raise ConnectionFailed(f"The grpc+local server at {self._address} answered the "
                                   "connection with something else than READY.")
        code, text = body
        if code == errors.UNAVAILABLE:  # it requires TLS: retrying cannot help
            raise HandshakeFailed(text)
        raise errors.error_from_code(code, text)

    def _take(self, deadline: float | None) -> tuple[ClientConnection, bool]:
        """An idle call connection (most recently used first), else a new one; and whether
        it was idle (then the listener may have closed it meanwhile)."""
        connection = self._connections.take()
        if connection is not None:
            return connection, True
        return self._connect(deadline), False

    def _put_back(self, connection: ClientConnection) -> None:
        self._connections.put_back(connection)

    def _discard(self, connection: ClientConnection) -> None:
        self._connections.discard(connection)

    def _fail(self, connection: ClientConnection, error: Exception) -> NoReturn:
        """Close ``connection`` after a failure and raise ``error``, or CancelledError if
        the channel was closed (closing it made the connection fail)."""
        self._discard(connection)
        raise self._connections.closed_error(error) from None

    def call(self, frame: Frame, timeout: float | None, segment_bytes: int) -> Frame:
        """Send ``frame`` on a pooled connection and wait for its answer (buffers from
        ``segment_bytes`` on travel as segments)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ident = next(self._ids)
        views, kinds, places, fds = plan_buffers(frame.buffers, segment_bytes)
        try:
            message = wire.LAYOUT.encode((0, ident), frame.header, views, kinds, places)
            while True:
                connection, reused = self._take(deadline)
                try:
                    left(deadline)
                except errors.DeadlineExceededError:
                    self._put_back(connection)
                    raise
                try:
                    self._send_released(connection, deadline)
                    unix.send_message(connection.sock, ident, message, fds,
                                      connection.packet_limit, deadline)
                    break
                except OSError as err:  # also TimeoutError
                    # A SEQPACKET message goes whole or not at all: the call was not sent.
                    if isinstance(err, TimeoutError):
                        self._fail(connection, errors.DeadlineExceededError(
                            f"No room to send within {timeout} s."))
                    if (reused and isinstance(err, (BrokenPipeError, ConnectionResetError))
                            and not self._connections.closed):
                        self._discard(connection)
                        continue  # the listener closed this idle one: take another
                    self._fail(connection, ConnectionFailed(
                        f"Sending to the grpc+local server at {self._address} failed: {err}"))
        finally:
            unix.close_all(fds)
        return self._reply(connection, ident, deadline, timeout)

    def _reply(self, connection: ClientConnection, ident: int, deadline: float | None,
               timeout: float | None) -> Frame:
        """Wait in this thread for call ``ident``'s answer on ``connection``."""
        try:
            connection.arm(deadline)
            op, answered, body, fds = unix.read_message(connection.sock, deadline)
        except TimeoutError:  # its answer may still come: the connection is not reused
            self._discard(connection)
            raise errors.DeadlineExceededError(f"No response within {timeout} s.") from None
        except ConnectionResetError:
            # The listener closed the connection with the call unread: it did not run.
            self._fail(connection, ConnectionFailed(
                f"The grpc+local server at {self._address} closed the connection before "
                "reading the call."))
        except (OSError, unix.Closed, unix.Garbage) as err:
            self._fail(connection, errors.UnavailableError(
                f"The connection to the grpc+local server at {self._address} failed during "
                f"the call ({type(err).__name__}: {err})."))
        if op == wire.ERROR:
            code, text = body
            if code in (errors.CANCELLED, errors.UNAVAILABLE):  # it closes the connection
                self._discard(connection)
            else:
                self._put_back(connection)
            if code == errors.UNAVAILABLE:  # only for a call it did not run
                raise ConnectionFailed(text)
            raise errors.error_from_code(code, text)
        try:
            if op != unix.CONTROL:
                raise errors.UnavailableError(
                    f"The grpc+local server at {self._address} sent an unexpected message.")
            control = wire.LAYOUT.decode(body, REPLY_LIMIT)
            if control.fields[1] != ident or (answered and answered != ident):
                raise errors.UnavailableError(
                    f"The grpc+local server at {self._address} answered call "
                    f"{control.fields[1]} to call {ident}.")
            check_descriptors(control, fds)
        except BaseException:
            unix.close_all(fds)
            self._discard(connection)
            raise
        self._put_back(connection)
        return Frame(control.header, received_buffers(control, fds, self._released.append))

    def _send_released(self, connection: ClientConnection, deadline: float | None) -> None:
        """Tell the listener (on ``connection``) which of its reply segments this process
        released since the last call."""
        if self._released:
            inodes = []
            with contextlib.suppress(IndexError):  # emptied by another thread meanwhile
                while self._released:
                    inodes.append(self._released.popleft())
            unix.send_releases(connection.sock, inodes, deadline)

    def close(self) -> None:
        """Close every connection: calls waiting on one end with CancelledError."""
        self._connections.close()
