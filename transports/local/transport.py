"""The "grpc+local" transport: Unix-socket calls, shared-memory data plane, same host only.

* Same process: the core reaches a server of its own process without the transport
  (``clusterwire.in_process``); ``LocalTransport.keep`` puts a large buffer it stores in
  a sealed segment, so later sends of it to other processes pass a descriptor.
* Other process on this host (no TLS): a call travels entirely over a Unix
  SOCK_SEQPACKET *call connection* to the listener's abstract Unix name: the
  control message (header and small buffers) and the descriptors of its sealed
  memfd segments go in one ``sendmsg``, and the reply comes back on the same
  connection to the calling thread (no thread hand-off on either side). A
  channel keeps a small LIFO pool of idle call connections (one per call in
  flight; those idle for a while are closed); the listener serves each on a
  thread of its own, running the handler inline under one of ``max_workers``
  work slots that a ``parked()`` wait gives back (``clusterwire.thread_pool``).
  A connection authenticates once, with the token in its first message, before
  anything else of it is read. Larger buffers travel as sealed memfd segments:
  a receiver maps a segment read-only and uses it in place; a segment received
  once is re-sent by descriptor, never copied again. Nothing is ever named in
  /dev/shm: the kernel frees a segment with its last descriptor or mapping,
  also when a process is SIGKILLed.
* Under TLS (``security.tls``) calls stay on the gRPC port (one unary call each,
  so the TLS handshake decides who may call), with segment descriptors passed
  over a Unix *segment connection* beside it; a listener with TLS refuses call
  connections. The gRPC port always serves (TLS clients, other clients).

The wire format (both connection kinds) is described in ``wire``. Received buffers
are read-only; ``.copy()`` an array to modify it. Options (plugins.toml
``[options."grpc+local"]``): ``segment_bytes`` (buffers from this size on travel as
segments; default 64 KiB).
"""

from __future__ import annotations

import array
import contextlib
import errno
import itertools
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.envelope import BULK, INLINE, INLINE_BUDGET, Envelope, inline_kinds
from clusterwire.pending import PendingConnections
from clusterwire.security import Security
from clusterwire.thread_pool import WorkSlots, serve_parking
from clusterwire.transport import (
    Channel,
    ConnectionFailed,
    Frame,
    Handler,
    HandshakeFailed,
    Listener,
    ListenOptions,
    Transport,
)
from clusterwire.transport_options import OptionReader
from clusterwire.transports._grpc_common.client import open_channel, token_metadata
from clusterwire.transports._grpc_common.server import ControlServer
from clusterwire.transports._grpc_common.status import grpc_error, status_code
from clusterwire.transports.local import sealed, wire

_METHOD = "/clusterwire.Local/Call"
_SEGMENT_WAIT = 10.0
_HELLO_WAIT = 2.0
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_MAX_HELD_FDS = 65536
_CONTROL_LIMIT = wire.LAYOUT.max_bytes(INLINE_BUDGET)
#: A channel closes call connections idle for this long (when it next returns one).
_IDLE_CONNECTION_S = 30.0
#: Socket buffer wanted on call connections: a SEQPACKET message must fit the sender's.
_SOCKET_BUFFER = 4 * wire.MAX_PACKET


def _unix_name(address: str) -> str:
    return f"\0clusterwire-local:{address}"


class _Inbox:
    """Descriptors received on one Unix connection, by transfer id, until claimed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[int, list[int]] = {}
        self._closed = False

    def add(self, ident: int, fds: list[int]) -> None:
        with self._cond:
            held = sum(len(v) for v in self._items.values())
            if self._closed or held + len(fds) > _MAX_HELD_FDS:
                _close_all(fds)
                raise errors.ResourceExhaustedError("Too many unclaimed segments.")
            self._items.setdefault(ident, []).extend(fds)
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """True once the connection closed."""
        return self._closed

    def take(self, ident: int, count: int, timeout: float) -> list[int]:
        with self._cond:
            arrived = self._cond.wait_for(
                lambda: self._closed or len(self._items.get(ident, ())) >= count, timeout)
            if self._closed:
                raise errors.UnavailableError("The shared-memory connection closed.")
            if not arrived:
                raise errors.DeadlineExceededError(
                    f"{count} shared-memory segment(s) of transfer {ident} did not arrive.")
            fds = self._items.pop(ident)
        if len(fds) != count:
            _close_all(fds)
            raise errors.InvalidArgumentError("More segments than the frame declares.")
        return fds

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for fds in self._items.values():
                _close_all(fds)
            self._items.clear()
            self._cond.notify_all()


def _peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix connection."""
    credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(credentials)[1]


def _unregister_and_shutdown(selector: selectors.BaseSelector, conn: socket.socket) -> None:
    selector.unregister(conn)
    _shutdown(conn)


def _shutdown(sock: socket.socket) -> None:
    """Shut down and close ``sock``; shutdown wakes threads blocked on it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


_CONTROL = 0  # what _read returns for a control message (no op of the wire's)
_ANCILLARY = socket.CMSG_SPACE(wire.MAX_FDS_PER_MESSAGE * 4)
_RECV_FLAGS = socket.MSG_CMSG_CLOEXEC
_TIMEVAL = struct.Struct("ll")


class _Garbage(Exception):
    """A message that is not this protocol: the connection it came on is closed."""


class _Closed(Exception):
    """The peer closed the connection (end of file)."""


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors of a received message's ancillary data (SCM_RIGHTS)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", data[:len(data) - len(data) % 4])
    return fds


def _recv(sock: socket.socket, deadline: float | None = None,
          received: Any = None) -> tuple[bytes, list[int]]:
    """One message and its descriptors (close-on-exec), on a blocking socket.

    ``_Closed`` at end of file; ``ConnectionResetError`` if the peer closed with our last
    message unread (whatever it sent before that is returned first); ``_Garbage`` if the
    message or its descriptors were truncated. A client's connection has a receive timeout
    (``_ClientConnection.arm``): when it expires before ``deadline``, the wait goes on;
    after it, ``TimeoutError``. ``received``: what a first ``recvmsg`` returned or raised.
    """
    while True:
        if received is None:
            try:
                received = sock.recvmsg(wire.MAX_PACKET, _ANCILLARY, _RECV_FLAGS)
            except (BlockingIOError, ConnectionResetError) as err:
                received = err
        if isinstance(received, BlockingIOError):  # the receive timeout expired
            left = None if deadline is None else deadline - time.monotonic()
            if left is None or left <= 0:
                raise TimeoutError("timed out")
            _set_receive_timeout(sock, left)
            received = None
            continue
        if isinstance(received, ConnectionResetError):
            # Linux reports the reset before the messages still queued: read those first.
            received = sock.recvmsg(wire.MAX_PACKET, _ANCILLARY,
                                    _RECV_FLAGS | socket.MSG_DONTWAIT)
            if not received[0]:
                _close_all(_descriptors(received[1]))
                raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        break
    message, ancillary, flags, _ = received
    fds = _descriptors(ancillary) if ancillary else []
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        _close_all(fds)
        raise _Garbage("truncated message")
    if not message:
        _close_all(fds)
        raise _Closed
    return message, fds


def _set_receive_timeout(sock: socket.socket, seconds: float) -> float:
    """Make a blocking socket's receives give up after ``seconds`` (0: never); returns it.

    A kernel timeout (SO_RCVTIMEO) rather than Python's: a socket with a Python timeout
    polls before every receive, which costs a call about as much as the receive itself.
    """
    whole = int(seconds)
    micro = int((seconds - whole) * 1e6)
    if seconds and not whole and not micro:
        micro = 1  # 0 would mean "no timeout"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(whole, micro))
    return seconds


def _readable(sock: socket.socket, timeout: float, events: int = select.POLLIN) -> bool:
    """Whether ``sock`` is ready (to read) within ``timeout`` seconds (None: no limit)."""
    poller = select.poll()
    poller.register(sock, events)
    return bool(poller.poll(None if timeout is None else max(int(timeout * 1000), 1)))


def _read(sock: socket.socket, deadline: float | None = None,
          idle_timeout: float | None = None) -> tuple[int, int, Any, list[int]]:
    """Read one message of a call connection, with the SEGMENTS messages before it.

    Returns (op, id, body, descriptors): op READY; ERROR with body (code, text); or
    ``_CONTROL``, body the control message (bytes, or a view of the sealed segment an
    INDIRECT message names; id 0 for a plain one: its envelope has it). The caller owns
    the descriptors. Raises ``_Garbage`` (anything else, or ``idle_timeout`` seconds
    without the rest of a call whose segments came), ``_Closed``, ``TimeoutError`` (past
    ``deadline``) and ``OSError``, closing what it received.
    """
    # The common message first, in as few steps as it takes: a control message alone.
    try:
        received = sock.recvmsg(wire.MAX_PACKET, _ANCILLARY, _RECV_FLAGS)
    except (BlockingIOError, ConnectionResetError) as err:
        received = err
    else:
        if not received[1] and not received[2] and received[0][:4] == wire.CONTROL_MAGIC:
            return _CONTROL, 0, received[0], []
    held: list[int] = []
    try:
        while True:
            if received is None and held and idle_timeout is not None and not _readable(
                    sock, idle_timeout):
                raise _Garbage("a call's segments came, then nothing")
            message, fds = _recv(sock, deadline, received)
            received = None
            if fds:
                held += fds
            if message[:4] == wire.CONTROL_MAGIC:
                return _CONTROL, 0, message, held
            try:
                op, ident, count, payload = wire.decode_unix(message)
            except errors.InvalidArgumentError:
                raise _Garbage("not a grpc+local message") from None
            if count != len(fds) or len(held) > _MAX_HELD_FDS:
                raise _Garbage("descriptors other than declared")
            if op == wire.SEGMENTS:
                continue
            if op == wire.INDIRECT and fds:
                try:
                    length = wire.indirect_length(payload)
                    held.remove(fds[0])
                    segment = sealed.open_segment(fds[0])  # owns (and closes) the descriptor
                except errors.InvalidArgumentError as err:
                    raise _Garbage(err.message) from None
                if length > segment.nbytes:
                    raise _Garbage("an indirect message longer than its segment")
                return _CONTROL, ident, memoryview(segment)[:length], held
            if op == wire.ERROR and not held:
                try:
                    return op, ident, wire.decode_error(payload), held
                except errors.InvalidArgumentError:
                    raise _Garbage("malformed error message") from None
            if op == wire.READY and not held:
                return op, ident, None, held
            raise _Garbage(f"unexpected message (op {op})")
    except BaseException:
        _close_all(held)
        raise


def _send_one(sock: socket.socket, message: bytes, fds: list[int],
              deadline: float | None | bool) -> None:
    """Send one message without blocking; ``deadline`` False: BlockingIOError if there is
    no room, else wait for room until ``deadline`` (None: for as long as it takes)."""
    while True:
        try:
            if fds:
                socket.send_fds(sock, [message], fds, socket.MSG_DONTWAIT)
            else:
                sock.send(message, socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            if deadline is False:
                raise
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not _readable(sock, left, select.POLLOUT)):
                raise TimeoutError("no room to send") from None
            if left is None:
                _readable(sock, None, select.POLLOUT)


def _send(sock: socket.socket, ident: int, message: bytes, fds: Sequence[int],
          packet_limit: int, deadline: float | None | bool = False) -> None:
    """Send a control message and its descriptors on a call connection (the caller keeps
    its copies of the descriptors): SEGMENTS messages first for those past one message's
    share, and the message itself in a sealed segment (INDIRECT) past ``packet_limit``.
    ``deadline``: as for ``_send_one`` (the listener never waits: False)."""
    if not fds and len(message) <= packet_limit:  # the common case, in one step
        try:
            sock.send(message, socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            pass
    indirect = len(message) > packet_limit
    room = wire.MAX_FDS_PER_MESSAGE - indirect
    split = max(len(fds) - room, 0)
    for start in range(0, split, wire.MAX_FDS_PER_MESSAGE):
        part = list(fds[start:min(start + wire.MAX_FDS_PER_MESSAGE, split)])
        _send_one(sock, wire.encode_unix(wire.SEGMENTS, ident, len(part)), part, deadline)
    own = list(fds[split:])
    if not indirect:
        _send_one(sock, message, own, deadline)
        return
    fd, _ = sealed.create_packed([memoryview(message)])
    try:
        _send_one(sock, wire.encode_indirect(ident, len(own) + 1, len(message)), [fd, *own],
                  deadline)
    finally:
        os.close(fd)


def _packet_limit(sock: socket.socket) -> int:
    """The longest message ``sock`` sends as one packet (its send buffer bounds it)."""
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < _SOCKET_BUFFER:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return max(min(wire.MAX_PACKET, buffer - 1024), 1024)


class _UnixPeer:
    """One SOCK_SEQPACKET connection past its HELLO: a reader thread filling an inbox, and a
    locked sender. Only SEGMENTS messages may follow; anything else closes the connection."""

    def __init__(self, sock: socket.socket, client_id: int = 0, on_close=None):
        self.sock = sock
        self._on_close = on_close
        self.inbox = _Inbox()
        self._send_lock = threading.Lock()
        self.client_id = client_id
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="clusterwire-local-unix")
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                message, fds, _, _ = socket.recv_fds(self.sock, wire.MAX_UNIX_MESSAGE,
                                                     wire.MAX_FDS_PER_MESSAGE)
                try:
                    op, ident, count, _ = wire.decode_unix(message)
                    if op != wire.SEGMENTS or count != len(fds):
                        raise errors.InvalidArgumentError("not a SEGMENTS message")
                except errors.OpError:  # also the empty message of a closed connection
                    _close_all(fds)
                    break
                self.inbox.add(ident, fds)
        except (OSError, errors.OpError):
            pass
        self.close()

    def send(self, op: int, ident: int, fds: Sequence[int] = (), payload: bytes = b"") -> None:
        with self._send_lock:
            if not fds:
                self.sock.sendmsg([wire.encode_unix(op, ident, 0, payload)])
            for start in range(0, len(fds), wire.MAX_FDS_PER_MESSAGE):
                part = list(fds[start:start + wire.MAX_FDS_PER_MESSAGE])
                socket.send_fds(self.sock, [wire.encode_unix(op, ident, len(part))], part)

    def close(self) -> None:
        self.inbox.close()
        _shutdown(self.sock)
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(self)


def _plan(buffers: Sequence[Any], threshold: int
          ) -> tuple[list[memoryview], list[int], list[tuple[int, int]] | None, list[int]]:
    """How a frame's buffers travel: (views, kinds, (segment, offset) places, descriptors).

    Small buffers go inline. A buffer lying in a segment received earlier is
    re-sent by that segment's descriptor; the other bulk buffers are packed
    into one new sealed segment. The caller owns (and closes) the descriptors.
    """
    views = [memoryview(b).cast("B") for b in buffers]
    kinds = inline_kinds(views, threshold)
    if BULK not in kinds:  # the common small frame: no segment to look for
        return views, kinds, None, []
    places: list[tuple[int, int]] = []
    fds: list[int] = []
    segments: dict[int, int] = {}  # id(mapping) -> its index in fds
    to_pack: list[int] = []
    try:
        for index, (buffer, kind) in enumerate(zip(buffers, kinds, strict=True)):
            if kind == INLINE:
                places.append((0, 0))
                continue
            found = sealed.locate(buffer)
            if found is None:
                to_pack.append(index)
                places.append((0, 0))
                continue
            mapping, offset = found
            if id(mapping) not in segments:
                segments[id(mapping)] = len(fds)
                fds.append(os.dup(mapping.fd))
            places.append((segments[id(mapping)], offset))
        if to_pack:
            fd, offsets = sealed.create_packed([views[i] for i in to_pack])
            fds.append(fd)
            for index, offset in zip(to_pack, offsets, strict=True):
                places[index] = (len(fds) - 1, offset)
    except BaseException:
        _close_all(fds)
        raise
    return views, kinds, places, fds


def _send_segments(peer: _UnixPeer, ident: int, fds: list[int]) -> None:
    """Send the planned descriptors (then close our copies)."""
    try:
        if fds:
            peer.send(wire.SEGMENTS, ident, fds)
    finally:
        _close_all(fds)


def _received(control: Envelope, fds: list[int]) -> list[Any]:
    """The buffers of a control message: inline slices and views of mapped segments."""
    if not control.places and not fds:  # every buffer inline
        inline = control.inline.toreadonly()
        if len(control.lengths) == 1:
            return [inline]
        views, offset = [], 0
        for length in control.lengths:
            views.append(inline[offset:offset + length])
            offset += length
        return views
    segments = []
    try:
        while fds:
            segments.append(sealed.open_segment(fds.pop(0)))
    except BaseException:
        _close_all(fds)
        raise
    buffers, offset = [], 0
    inline = control.inline.toreadonly()
    places = control.places or itertools.repeat((0, 0))  # none when every buffer is inline
    for kind, length, (segment, start) in zip(control.kinds, control.lengths, places,
                                               strict=False):
        if kind == INLINE:
            buffers.append(inline[offset:offset + length])
            offset += length
            continue
        if segment >= len(segments) or start + length > segments[segment].nbytes:
            raise errors.InvalidArgumentError(
                f"Malformed frame: buffer at segment {segment} offset {start} length {length} "
                "lies outside the received segments.")
        buffers.append(segments[segment][start:start + length])
    return buffers


class _CallConnection:
    """The listener's side of one call connection: a thread of its own reads a call, runs
    the handler inline under a work slot and answers on the same connection, one call at
    a time. A call has one answer: the handler's, or ``CancelledError`` from ``stop``."""

    def __init__(self, listener: LocalListener, sock: socket.socket):
        self.sock = sock
        self._listener = listener
        self._lock = threading.Lock()  # one answer per call
        self._packet_limit = _packet_limit(sock)
        self.call_id = 0  # the call read last
        self.busy = False  # running a call (under the listener's lock)
        self._answered = True
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="clusterwire-local-calls")

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        listener = self._listener
        serve_parking(listener.slots)
        try:
            while True:
                try:
                    op, ident, body, fds = _read(self.sock, idle_timeout=listener.idle_timeout)
                except (_Garbage, _Closed, OSError):
                    return
                if op != _CONTROL:  # READY or ERROR: a client never sends them
                    _close_all(fds)
                    return
                try:
                    control = wire.LAYOUT.decode(body, listener.limit)
                    ident = control.fields[1]
                    if wire.segments(control) != len(fds):
                        raise errors.InvalidArgumentError(
                            f"Malformed frame: {len(fds)} segment descriptors, the frame "
                            f"refers to {wire.segments(control)}.")
                except errors.OpError as err:  # answered; the connection stays usable
                    _close_all(fds)
                    fields = wire.LAYOUT.peek_fields(body)
                    self._answer_error(ident or (fields[1] if fields else 0), err.error_code,
                                       err.message)
                    continue
                self.call_id = ident
                self._answered = False  # before begin(): from then on stop() may cancel it
                if not listener.begin(self):
                    _close_all(fds)
                    self._answer_error(ident, errors.UNAVAILABLE,
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
            buffers = _received(control, fds)  # takes (and on failure closes) fds
            if not listener.slots.acquire():
                raise errors.CancelledError(f"The server at {listener.address} stopped.")
            try:
                response = listener.handler(Frame(control.header, buffers))
            finally:
                listener.slots.release()
            views, kinds, places, out = _plan(response.buffers, listener.segment_bytes)
            try:
                return (wire.LAYOUT.encode((0, ident), response.header, views, kinds, places),
                        out, 0, "")
            except BaseException:
                _close_all(out)
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
                    _send(self.sock, ident, message, fds, self._packet_limit)
            return True
        except OSError:
            return False
        finally:
            _close_all(fds)

    def _answer_error(self, ident: int, code: int, text: str) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(wire.encode_error(ident, code, text), socket.MSG_DONTWAIT)

    def cancel(self) -> None:
        """Answer the running call with CancelledError (the handler's late answer is
        dropped) and close the connection."""
        with self._lock:
            if not self._answered:
                self._answered = True
                self._answer_error(self.call_id, errors.CANCELLED,
                                   f"The server at {self._listener.address} stopped during "
                                   "the call.")
        self.close()

    def close(self) -> None:
        """Shut the connection down (wakes its thread); the listener forgets it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._listener.forget(self)
        if threading.current_thread() is self._thread:
            self.sock.close()


class LocalListener(Listener):
    """A Unix SOCK_SEQPACKET listener for call and segment connections, beside a gRPC
    control listener (calls under TLS, and any other gRPC client)."""

    def __init__(self, transport: LocalTransport, address: str, handler: Handler,
                 options: ListenOptions):
        self._transport = transport
        self._handler = handler
        self._limit = options.max_message_bytes
        self._security = options.security
        self._control = ControlServer(
            address, "clusterwire.Local",
            {"Call": grpc.unary_unary_rpc_method_handler(self._call)}, options, "local",
            max_receive_bytes=_CONTROL_LIMIT)
        self._address = self._control.address
        self._pool = self._control.pool
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._unix.bind(_unix_name(self._address))
        except OSError as err:
            self._unix.close()
            self._control.stop(None)
            raise errors.UnavailableError(
                f"Could not bind the shared-memory socket of {self._address}: {err}") from None
        self._unix.listen(64)
        self._unix.setblocking(False)
        self._clients: dict[int, _UnixPeer] = {}  # by client id, after their hello
        # Every Unix connection past its hello: segment connections and call connections.
        self._connections: set[_UnixPeer | _CallConnection] = set()
        #: Calls served over call connections so far.
        self.unix_calls = 0
        self._calls = threading.Condition(threading.Lock())  # for the three below
        self._busy = 0  # call connections running a call
        self._draining = False  # stop() began: call connections take no new call
        self.slots = WorkSlots(options.max_workers)
        self.idle_timeout = options.message_idle_timeout_seconds
        self._max_connections = options.max_connections
        self._max_pending = max(options.max_pending_connections, 1)
        self._handshake_timeout = options.handshake_timeout_seconds
        self._segment_wait = options.message_idle_timeout_seconds
        self._clients_lock = threading.Condition()
        self._stopped = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True,
                                          name="clusterwire-local-accept")
        self._started = False

    @property
    def address(self) -> str:
        return self._address

    @property
    def unix_address(self) -> str:
        """The abstract name of the Unix socket (SOCK_SEQPACKET) beside the gRPC port."""
        return _unix_name(self._address)

    # What a call connection's thread uses.
    @property
    def handler(self) -> Handler:
        return self._handler

    @property
    def limit(self) -> int:
        """max_message_bytes."""
        return self._limit

    @property
    def segment_bytes(self) -> int:
        return self._transport.segment_bytes

    def begin(self, connection: _CallConnection) -> bool:
        """``connection`` starts running a call; False (not to run) once stopping."""
        with self._calls:
            if self._draining:
                return False
            connection.busy = True
            self._busy += 1
            self.unix_calls += 1
            return True

    def end(self, connection: _CallConnection) -> bool:
        """``connection``'s call was answered; False if it is to close (stopping)."""
        with self._calls:
            connection.busy = False
            self._busy -= 1
            if self._draining:
                self._calls.notify_all()
                return False
            return True

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._control.start()
        self._acceptor.start()

    def _accept(self) -> None:
        """Accept Unix connections and read each one's HELLO on this one thread.

        Until its HELLO has shown the token a connection is pending: it has no thread and
        does not count against max_connections; it is closed once handshake_timeout_seconds
        pass, and when a new one would exceed max_pending_connections the oldest pending one
        of the peer (uid) holding the most is closed (``clusterwire.pending``), so silent
        connections cannot lock token holders out.
        """
        pending: PendingConnections[socket.socket] = PendingConnections(
            self._max_pending, self._handshake_timeout)
        with selectors.DefaultSelector() as selector:
            selector.register(self._unix, selectors.EVENT_READ)
            try:
                while not self._stopped.is_set():
                    deadline = pending.next_deadline()
                    wait = None if deadline is None else max(deadline - time.monotonic(), 0)
                    for key, _ in selector.select(wait):
                        if key.fileobj is self._unix:
                            self._accept_pending(selector, pending)
                        elif pending.discard(key.fileobj):  # not evicted by an accept above
                            selector.unregister(key.fileobj)
                            self._hello(key.fileobj)
                    for conn in pending.expire(time.monotonic()):
                        _unregister_and_shutdown(selector, conn)
            finally:
                for conn in pending:
                    _shutdown(conn)

    def _accept_pending(self, selector: selectors.BaseSelector,
                        pending: PendingConnections[socket.socket]) -> None:
        """Accept every queued connection as pending, closing one over the cap."""
        while not self._stopped.is_set():
            try:
                conn, _ = self._unix.accept()
            except OSError:  # BlockingIOError: none left; others: the socket is shut down
                return
            with self._clients_lock:
                full = len(self._connections) >= self._max_connections
            if full:  # refused before reading anything; a call connection reads why
                self._refuse(conn, errors.RESOURCE_EXHAUSTED, self._full_message())
                continue
            conn.setblocking(False)
            evicted = pending.add(conn, _peer_uid(conn), time.monotonic())
            if evicted is not None:
                _unregister_and_shutdown(selector, evicted)
            selector.register(conn, selectors.EVENT_READ)

    def _hello(self, conn: socket.socket) -> None:
        """Admit ``conn`` if its first message is a HELLO with the token, else close it."""
        try:
            message, fds, _, _ = socket.recv_fds(conn, wire.MAX_UNIX_MESSAGE,
                                                 wire.MAX_FDS_PER_MESSAGE)
        except OSError:
            _shutdown(conn)
            return
        try:
            op, client_id, count, token = wire.decode_unix(message)
            if op not in (wire.HELLO, wire.CALLS) or count or fds or not client_id:
                raise errors.InvalidArgumentError("the first message is not a HELLO")
        except errors.OpError:  # also the empty message of a closed connection
            _close_all(fds)
            _shutdown(conn)
            return
        if op == wire.CALLS:
            self._admit_calls(conn, token)
            return
        try:
            # Segments are accepted only on a connection that showed the token.
            self._security.check_token(token or None)
        except errors.OpError:
            _shutdown(conn)
            return
        with self._clients_lock:
            full = len(self._connections) >= self._max_connections
        if full:
            _shutdown(conn)
            return
        conn.setblocking(True)
        peer = _UnixPeer(conn, client_id, on_close=self._forget)
        with self._clients_lock:
            self._connections.add(peer)
        self._register(client_id, peer)

    def _admit_calls(self, conn: socket.socket, token: bytes) -> None:
        """Admit a call connection that showed the token (answer READY and give it a thread),
        or answer why not (ERROR) and close it."""
        if self._security.tls is not None:
            self._refuse(conn, errors.UNAVAILABLE,
                         f"The grpc+local server at {self._address} requires TLS: configure "
                         "this client for TLS (its calls then go through the TLS port).")
            return
        try:
            self._security.check_token(token or None)
        except errors.UnauthenticatedError as err:
            self._refuse(conn, errors.UNAUTHENTICATED, err.message)
            return
        connection = None
        with self._clients_lock:
            if len(self._connections) < self._max_connections and not self._stopped.is_set():
                conn.setblocking(True)
                connection = _CallConnection(self, conn)
                self._connections.add(connection)
        if connection is None:
            self._refuse(conn, errors.RESOURCE_EXHAUSTED, self._full_message())
            return
        try:
            conn.send(wire.encode_unix(wire.READY, 0, 0), socket.MSG_DONTWAIT)
        except OSError:
            connection.close()
            conn.close()
            return
        connection.start()

    def _full_message(self) -> str:
        return (f"The grpc+local server at {self._address} refused the connection: it holds "
                f"its max_connections ({self._max_connections}).")

    @staticmethod
    def _refuse(conn: socket.socket, code: int, text: str) -> None:
        """Tell a connection why it is refused (best effort, never blocking), then close it."""
        with contextlib.suppress(OSError):
            conn.send(wire.encode_error(0, code, text), socket.MSG_DONTWAIT)
        _shutdown(conn)

    def forget(self, connection: _UnixPeer | _CallConnection) -> None:
        """A connection closed: it no longer counts against max_connections."""
        self._forget(connection)

    def _forget(self, peer: _UnixPeer | _CallConnection) -> None:
        with self._clients_lock:
            self._connections.discard(peer)
            if isinstance(peer, _UnixPeer) and self._clients.get(peer.client_id) is peer:
                del self._clients[peer.client_id]

    def _register(self, client_id: int, peer: _UnixPeer) -> None:
        with self._clients_lock:
            old = self._clients.get(client_id)
            self._clients[client_id] = peer
            self._clients_lock.notify_all()
        if old is not None:
            old.close()

    def stop(self, grace: float | None = None) -> None:
        self._stopped.set()
        deadline = time.monotonic() + (grace or 0.0)
        # The gRPC port drains (for the same grace) while the call connections do.
        control = threading.Thread(target=self._control.stop, args=(grace,), daemon=True,
                                   name="clusterwire-local-stop")
        control.start()
        with contextlib.suppress(OSError):
            self._unix.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        if self._started:
            self._acceptor.join(10)
        self._unix.close()  # releases the name: new connections are refused from here on
        with self._clients_lock:
            calls = [c for c in self._connections if isinstance(c, _CallConnection)]
        with self._calls:
            self._draining = True  # idle call connections take no new call: close them
            idle = [c for c in calls if not c.busy]
        for connection in idle:
            connection.close()
        with self._calls:
            self._calls.wait_for(lambda: self._busy == 0, max(deadline - time.monotonic(), 0))
            running = [c for c in calls if c.busy]
        for connection in running:  # past the grace: answered CancelledError
            connection.cancel()
        self.slots.close()  # calls still waiting for a slot end without running
        control.join()
        with self._clients_lock:
            peers, self._clients = list(self._connections), {}
        for peer in peers:
            peer.close()

    def _call(self, message: bytes, context: grpc.ServicerContext) -> bytes:
        # The control server's interceptor checked the token before the request was read.
        try:
            control = wire.LAYOUT.decode(message, self._limit)
            client_id, transfer_id = control.fields
            peer = self._clients.get(client_id)  # a dict read needs no lock
            if peer is None:
                with self._clients_lock:
                    # The client's HELLO races its first call: give the Unix reader a moment.
                    self._clients_lock.wait_for(lambda: client_id in self._clients,
                                                _HELLO_WAIT)
                    peer = self._clients.get(client_id)
            segments = wire.segments(control)
            if peer is None:
                raise errors.ResourceExhaustedError(
                    "No shared-memory connection from this client: the server refused it "
                    f"(over its max_connections, {self._max_connections}) or the client is "
                    "not on this host (grpc+local connects only tasks of the same host).")
            # Sent before the call, so they are there unless the client stalls: a transfer
            # idle for message_idle_timeout_seconds frees this thread.
            fds = (peer.inbox.take(transfer_id, segments, self._segment_wait)
                   if segments else [])
            request = Frame(control.header, _received(control, fds))
            response = self._handler(request)
            views, kinds, places, fds = _plan(response.buffers, self._transport.segment_bytes)
            _send_segments(peer, transfer_id, fds)
            return wire.LAYOUT.encode((0, transfer_id), response.header, views, kinds, places)
        except errors.OpError as err:
            context.abort(grpc.StatusCode(status_code(err.error_code)), err.message)
        except OSError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"shared-memory connection failed: {err}")


class _ClientConnection:
    """A channel's call connection: used by one call at a time, idle in the channel's pool
    between calls."""

    __slots__ = ("sock", "packet_limit", "idle_since", "receive_timeout")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.packet_limit = _packet_limit(sock)
        self.idle_since = 0.0
        self.receive_timeout = 0.0  # SO_RCVTIMEO in seconds (0: none)

    def arm(self, deadline: float | None) -> None:
        """Set the receive timeout so a wait for the answer returns by ``deadline`` (None:
        never gives up). Kept when it is already a little shorter than the time left, so a
        steady stream of calls with the same timeout costs no system call (a receive that
        times out early waits again, ``_recv``)."""
        if deadline is None:
            if self.receive_timeout:
                self.receive_timeout = _set_receive_timeout(self.sock, 0)
            return
        left = deadline - time.monotonic()
        if not 0.9 * left <= self.receive_timeout <= left:
            self.receive_timeout = _set_receive_timeout(self.sock, max(0.95 * left, 1e-6))


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no deadline); DeadlineExceededError if none left."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise errors.DeadlineExceededError("The deadline passed before the call was sent.")
    return left


class LocalChannel(Channel):
    """A channel to a grpc+local listener of this host (or of this process)."""

    def __init__(self, transport: LocalTransport, address: str, security: Security):
        split_host_port(address)
        self._transport = transport
        self._address = address
        self._security = security
        self._metadata = token_metadata(security)
        self._client_id = secrets.randbits(63) + 1
        self._ids = itertools.count(1)
        self._tls = security.tls is not None
        self._channel: grpc.Channel | None = None  # under TLS only, opened on first use
        self._unary = None
        self._peer: _UnixPeer | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._idle: list[_ClientConnection] = []  # call connections, most recently used last
        self._open: set[_ClientConnection] = set()  # idle and in use
        _channels.add(self)

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's call connections (closing only the
        child's copies), so that the two processes never share one."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        connections, self._open, self._idle = self._open, set(), []
        for connection in connections:
            connection.sock.close()

    # -- calls over Unix call connections (no TLS) ----------------------------------

    def _connect(self, deadline: float | None) -> _ClientConnection:
        """A new call connection, admitted by the listener (nothing of a call sent yet)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(_left(deadline))  # a Python timeout until admitted
            try:
                sock.connect(_unix_name(self._address))
            except TimeoutError:
                raise errors.DeadlineExceededError(
                    f"Connecting to the grpc+local server at {self._address} took past the "
                    "deadline (its accept queue is full).") from None
            except OSError as err:
                raise ConnectionFailed(
                    f"cannot reach a grpc+local server at {self._address} on this host "
                    f"({err.strerror}); grpc+local connects only tasks of the same "
                    "host.") from None
            connection = _ClientConnection(sock)
            with self._lock:
                if self._closed.is_set():
                    raise errors.CancelledError(f"Channel to {self._address} is closed.")
                self._open.add(connection)
        except BaseException:
            sock.close()
            raise
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                # Refused at accept (max_connections): its reason is queued for us to read.
                sock.send(wire.encode_unix(wire.CALLS, self._client_id, 0,
                                           self._security.token or b""))
            op, _, body, _ = _read(sock)
        except TimeoutError:
            self._discard(connection)
            raise errors.DeadlineExceededError(
                f"The grpc+local server at {self._address} did not admit the connection "
                "within the deadline.") from None
        except (OSError, _Closed, _Garbage) as err:
            self._discard(connection)
            if self._closed.is_set():
                raise errors.CancelledError(f"Channel to {self._address} was closed.") from None
            raise ConnectionFailed(
                f"The grpc+local server at {self._address} closed the connection at once "
                f"({type(err).__name__}): it is stopping, or not a grpc+local server.") from None
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

    def _take(self, deadline: float | None) -> tuple[_ClientConnection, bool]:
        """An idle call connection (most recently used first), else a new one; and whether
        it was idle (then the listener may have closed it meanwhile)."""
        with self._lock:
            if self._closed.is_set():
                raise errors.CancelledError(f"Channel to {self._address} is closed.")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(deadline), False

    def _put_back(self, connection: _ClientConnection) -> None:
        """Return a healthy connection to the pool; close those idle too long."""
        now = time.monotonic()
        connection.idle_since = now
        stale = []
        with self._lock:
            if self._closed.is_set():
                stale.append(connection)
                self._open.discard(connection)
            else:
                self._idle.append(connection)
                while self._idle and now - self._idle[0].idle_since > _IDLE_CONNECTION_S:
                    stale.append(self._idle.pop(0))
                    self._open.discard(stale[-1])
        for old in stale:
            _shutdown(old.sock)

    def _discard(self, connection: _ClientConnection) -> None:
        """Close a connection that failed or may still get a late answer."""
        with self._lock:
            self._open.discard(connection)
        _shutdown(connection.sock)

    def _call_unix(self, frame: Frame, timeout: float | None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        ident = next(self._ids)
        views, kinds, places, fds = _plan(frame.buffers, self._transport.segment_bytes)
        try:
            message = wire.LAYOUT.encode((0, ident), frame.header, views, kinds, places)
            while True:
                connection, reused = self._take(deadline)
                try:
                    _left(deadline)
                except errors.DeadlineExceededError:
                    self._put_back(connection)
                    raise
                try:
                    _send(connection.sock, ident, message, fds, connection.packet_limit,
                          deadline)
                    break
                except OSError as err:  # also TimeoutError
                    # A SEQPACKET message goes whole or not at all: the call was not sent.
                    self._discard(connection)
                    if self._closed.is_set():
                        raise errors.CancelledError(
                            f"Channel to {self._address} was closed.") from None
                    if isinstance(err, TimeoutError):
                        raise errors.DeadlineExceededError(
                            f"No room to send within {timeout} s.") from None
                    if reused and isinstance(err, (BrokenPipeError, ConnectionResetError)):
                        continue  # the listener closed this idle one: take another
                    raise ConnectionFailed(
                        f"Sending to the grpc+local server at {self._address} failed: "
                        f"{err}") from None
        finally:
            _close_all(fds)
        return self._reply(connection, ident, deadline, timeout)

    def _reply(self, connection: _ClientConnection, ident: int, deadline: float | None,
               timeout: float | None) -> Frame:
        """Wait in this thread for call ``ident``'s answer on ``connection``."""
        try:
            connection.arm(deadline)
            op, answered, body, fds = _read(connection.sock, deadline)
        except TimeoutError:  # its answer may still come: the connection is not reused
            self._discard(connection)
            raise errors.DeadlineExceededError(f"No response within {timeout} s.") from None
        except ConnectionResetError:
            # The listener closed the connection with the call unread: it did not run.
            self._discard(connection)
            if self._closed.is_set():
                raise errors.CancelledError(f"Channel to {self._address} was closed.") from None
            raise ConnectionFailed(
                f"The grpc+local server at {self._address} closed the connection before "
                "reading the call.") from None
        except (OSError, _Closed, _Garbage) as err:
            self._discard(connection)
            if self._closed.is_set():
                raise errors.CancelledError(f"Channel to {self._address} was closed.") from None
            raise errors.UnavailableError(
                f"The connection to the grpc+local server at {self._address} failed during "
                f"the call ({type(err).__name__}: {err}).") from None
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
            if op != _CONTROL:
                raise errors.UnavailableError(
                    f"The grpc+local server at {self._address} sent an unexpected message.")
            control = wire.LAYOUT.decode(body, 1 << 42)
            if control.fields[1] != ident or (answered and answered != ident):
                raise errors.UnavailableError(
                    f"The grpc+local server at {self._address} answered call "
                    f"{control.fields[1]} to call {ident}.")
            if wire.segments(control) != len(fds):
                raise errors.InvalidArgumentError(
                    f"Malformed frame: {len(fds)} segment descriptors, the frame refers to "
                    f"{wire.segments(control)}.")
        except BaseException:
            _close_all(fds)
            self._discard(connection)
            raise
        self._put_back(connection)
        return Frame(control.header, _received(control, fds))

    # -- calls over gRPC (TLS) --------------------------------------------------------

    def _unix_peer(self) -> _UnixPeer:
        peer = self._peer
        if peer is not None and not peer.inbox.closed and not self._closed.is_set():
            return peer
        with self._lock:
            if self._closed.is_set():
                raise errors.CancelledError(f"Channel to {self._address} is closed.")
            if self._peer is None or self._peer.inbox.closed:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    sock.connect(_unix_name(self._address))
                except OSError as err:
                    sock.close()
                    raise ConnectionFailed(
                        f"cannot reach a grpc+local server at {self._address} on this host "
                        f"({err}); grpc+local connects only tasks of the same host.") from None
                peer = _UnixPeer(sock)
                try:
                    peer.send(wire.HELLO, self._client_id, payload=self._security.token or b"")
                except OSError as err:
                    peer.close()
                    # Accepted, then closed before our hello: the server refused us.
                    raise errors.ResourceExhaustedError(
                        f"The grpc+local server at {self._address} refused the shared-memory "
                        f"connection ({err.strerror}): it is at its max_connections.") from None
                self._peer = peer
            return self._peer

    def _grpc_unary(self):
        with self._lock:
            if self._closed.is_set():
                raise errors.CancelledError(f"Channel to {self._address} is closed.")
            if self._unary is None:
                self._channel = open_channel(self._address, self._security, _CONTROL_LIMIT)
                self._unary = self._channel.unary_unary(_METHOD, _registered_method=True)
            return self._unary

    def _call_grpc(self, frame: Frame, timeout: float | None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        unary = self._grpc_unary()
        peer = self._unix_peer()
        transfer_id = next(self._ids)
        try:
            views, kinds, places, fds = _plan(frame.buffers, self._transport.segment_bytes)
            _send_segments(peer, transfer_id, fds)
            reply = unary(
                wire.LAYOUT.encode((self._client_id, transfer_id), frame.header, views, kinds,
                                   places),
                timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if self._closed.is_set():
                raise errors.CancelledError(f"Channel to {self._address} was closed.") from None
            raise grpc_error(err, self._address, self._security) from None
        except ValueError as err:  # grpc refuses calls on a closed channel
            raise errors.CancelledError(f"Channel to {self._address} is closed: {err}") from None
        except OSError as err:
            raise errors.UnavailableError(
                f"shared-memory connection to {self._address} failed: {err}") from None
        control = wire.LAYOUT.decode(reply, 1 << 42)
        segments = wire.segments(control)
        remaining = _SEGMENT_WAIT if deadline is None else max(deadline - time.monotonic(), 0.01)
        fds = peer.inbox.take(transfer_id, segments, remaining) if segments else []
        return Frame(control.header, _received(control, fds))

    # -- the Channel interface ----------------------------------------------------------

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        if self._closed.is_set():
            raise errors.CancelledError(f"Channel to {self._address} is closed.")
        if self._tls:  # the TLS handshake decides who may call: calls go through gRPC
            return self._call_grpc(frame, timeout)
        return self._call_unix(frame, timeout)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            peer, self._peer = self._peer, None
            connections, self._open = list(self._open), set()
            idle, self._idle = self._idle, []
            channel = self._channel
        for connection in connections:  # wakes the calls waiting on them (CancelledError)
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)
        for connection in idle:
            connection.sock.close()
        if peer is not None:
            peer.close()
        if channel is not None:
            channel.close()


_channels: weakref.WeakSet[LocalChannel] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for channel in list(_channels):
        channel._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LocalTransport(Transport):
    """Same-host transport: in-process hand-off or sealed shared-memory segments."""

    protocol = "grpc+local"

    def __init__(self, options: Mapping[str, Any] | None = None):
        reader = OptionReader(self.protocol, options)
        self.segment_bytes = reader.positive("segment_bytes", 64 << 10, integer=True)
        reader.finish()
        sealed.raise_fd_limit()

    def keep(self, buffer: Any) -> Any:
        """A large buffer from a caller of the server's own process is kept in a sealed
        segment (one copy, also of an immutable one): every later send of it to another
        process passes the segment's descriptor instead of copying it again."""
        if memoryview(buffer).nbytes < self.segment_bytes:
            return None
        if sealed.locate(buffer) is not None:
            return memoryview(buffer).toreadonly()
        view = memoryview(buffer).cast("B")
        fd, _ = sealed.create_packed([view])
        return sealed.open_segment(fd)[:view.nbytes]  # the segment is padded

    def listen(self, address: str, handler: Handler, options: ListenOptions) -> Listener:
        return LocalListener(self, address, handler, options)

    def connect(self, address: str, security: Security | None = None) -> Channel:
        return LocalChannel(self, address, security or Security())

    def info(self) -> dict[str, str]:
        return {"control": "unix seqpacket call connections (grpc unary under TLS)",
                "data": "in-process hand-off / sealed memfd segments",
                "segment_bytes": str(self.segment_bytes)}
