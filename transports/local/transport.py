"""The "grpc+local" transport: gRPC control plane, shared-memory data plane, same host only.

* Same process: a channel whose listener lives in this process calls the
  handler directly. Read-only (immutable) buffers are handed over as they
  are, writable ones are copied once into read-only memory, so neither side
  can change the other's data; a stored tensor is returned without any copy.
* Other process on this host: control messages and small buffers travel in
  one gRPC unary call; larger buffers travel as sealed memfd segments whose
  descriptors pass over a Unix socket (SCM_RIGHTS) beside the gRPC
  connection. A receiver maps a segment read-only and uses it in place;
  a segment received once is re-sent by descriptor, never copied again.
  Nothing is ever named in /dev/shm: the kernel frees a segment with its
  last descriptor or mapping, also when a process is SIGKILLed.

Received buffers are read-only; ``.copy()`` an array to modify it.
Options (plugins.toml ``[options."grpc+local"]``): ``segment_bytes``
(buffers from this size on travel as segments; default 64 KiB).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.envelope import BULK, INLINE, INLINE_BUDGET, Envelope, check_total, inline_kinds
from clusterwire.pending import PendingConnections
from clusterwire.security import Security
from clusterwire.transport import (
    Channel,
    ConnectionFailed,
    Frame,
    Handler,
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
_in_process: dict[str, LocalListener] = {}
_in_process_lock = threading.Lock()


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


def _frozen(buffers: Sequence[Any], threshold: int, seal_immutable: bool) -> list[Any]:
    """Buffers safe to hand to another party in this process: sealed, shared or copied.

    Large mutable buffers are copied into a sealed segment rather than private
    memory: the same one copy, and a later cross-process send of the buffer
    passes its descriptor. With ``seal_immutable`` (requests, whose buffers
    the server may store) large immutable buffers are sealed too, so every
    later cross-process get of a stored tensor passes a descriptor instead of
    copying; otherwise immutable buffers are shared.
    """
    frozen = []
    for buffer in buffers:
        large = memoryview(buffer).nbytes >= threshold
        shareable = sealed.is_immutable(buffer) and not (large and seal_immutable)
        if shareable or sealed.locate(buffer) is not None:
            frozen.append(memoryview(buffer).toreadonly())
        elif large:
            view = memoryview(buffer).cast("B")
            fd, _ = sealed.create_packed([view])
            frozen.append(sealed.open_segment(fd)[:view.nbytes])  # the segment is padded
        else:
            frozen.append(sealed.frozen_copy(buffer))
    return frozen


class LocalListener(Listener):
    """gRPC control listener plus a Unix socket for segment descriptors."""

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
        self._connections: set[_UnixPeer] = set()  # every Unix connection past its hello
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

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._control.start()
        self._acceptor.start()
        with _in_process_lock:
            _in_process[self._address] = self

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
            if full:  # refused before reading anything: the client's HELLO fails
                _shutdown(conn)
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
            if op != wire.HELLO or count or fds or not client_id:
                raise errors.InvalidArgumentError("the first message is not a HELLO")
            # Segments are accepted only on a connection that showed the token.
            self._security.check_token(token or None)
        except errors.OpError:  # also the empty message of a closed connection
            _close_all(fds)
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

    def _forget(self, peer: _UnixPeer) -> None:
        with self._clients_lock:
            self._connections.discard(peer)
            if self._clients.get(peer.client_id) is peer:
                del self._clients[peer.client_id]

    def _register(self, client_id: int, peer: _UnixPeer) -> None:
        with self._clients_lock:
            old = self._clients.get(client_id)
            self._clients[client_id] = peer
            self._clients_lock.notify_all()
        if old is not None:
            old.close()

    def stop(self, grace: float | None = None) -> None:
        with _in_process_lock:
            if _in_process.get(self._address) is self:
                del _in_process[self._address]
        self._stopped.set()
        self._control.stop(grace)
        with contextlib.suppress(OSError):
            self._unix.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        if self._started:
            self._acceptor.join(10)
        self._unix.close()  # releases the name
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

    @property
    def shortcut_allowed(self) -> bool:
        """In-process calls skip the wire; not under TLS, whose handshake must decide."""
        return self._security.tls is None

    def call_in_process(self, frame: Frame, timeout: float | None,
                        cancelled: threading.Event, security: Security) -> Frame:
        """Serve ``frame`` from this process, zero-copy for immutable buffers."""
        self._security.check_token(security.token)
        if self._stopped.is_set():
            raise ConnectionFailed(f"The server at {self._address} is stopped.")
        check_total(frame.payload_bytes, self._limit)
        request = Frame(frame.header,
                        _frozen(frame.buffers, self._transport.segment_bytes, True))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            future = self._pool.submit(self._handler, request)
        except RuntimeError:  # the pool shut down
            raise errors.CancelledError(f"The server at {self._address} stopped.") from None
        finished = threading.Event()
        future.add_done_callback(lambda _: finished.set())
        # Wake at once on completion; check for close/stop/deadline between short waits.
        while not finished.wait(0.05):
            if self._stopped.is_set():
                raise errors.CancelledError(f"The server at {self._address} stopped.")
            if cancelled.is_set():
                raise errors.CancelledError("The channel was closed.")
            if deadline is not None and time.monotonic() > deadline:
                raise errors.DeadlineExceededError(f"No response within {timeout} s.")
        try:
            response = future.result()
        except Exception as err:
            raise errors.InternalError(f"Handler failed: {type(err).__name__}: {err}") from None
        return Frame(response.header,
                     _frozen(response.buffers, self._transport.segment_bytes, False))


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
        self._security = security
        self._channel = open_channel(address, security, _CONTROL_LIMIT)
        self._unary = self._channel.unary_unary(_METHOD, _registered_method=True)
        self._peer: _UnixPeer | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()

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

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        with _in_process_lock:
            local = _in_process.get(self._address)
        if self._closed.is_set():
            raise errors.CancelledError(f"Channel to {self._address} is closed.")
        if local is not None and local.shortcut_allowed:
            return local.call_in_process(frame, timeout, self._closed, self._security)
        deadline = None if timeout is None else time.monotonic() + timeout
        peer = self._unix_peer()
        transfer_id = next(self._ids)
        try:
            views, kinds, places, fds = _plan(frame.buffers, self._transport.segment_bytes)
            _send_segments(peer, transfer_id, fds)
            reply = self._unary(
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

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            peer, self._peer = self._peer, None
        if peer is not None:
            peer.close()
        self._channel.close()


class LocalTransport(Transport):
    """Same-host transport: in-process hand-off or sealed shared-memory segments."""

    protocol = "grpc+local"

    def __init__(self, options: Mapping[str, Any] | None = None):
        reader = OptionReader(self.protocol, options)
        self.segment_bytes = reader.positive("segment_bytes", 64 << 10, integer=True)
        reader.finish()
        sealed.raise_fd_limit()

    def listen(self, address: str, handler: Handler, options: ListenOptions) -> Listener:
        return LocalListener(self, address, handler, options)

    def connect(self, address: str, security: Security | None = None) -> Channel:
        return LocalChannel(self, address, security or Security())

    def info(self) -> dict[str, str]:
        return {"control": "grpc", "data": "in-process hand-off / sealed memfd segments",
                "segment_bytes": str(self.segment_bytes)}
