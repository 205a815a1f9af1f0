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
* A task of another host (its address is none of this host's, which a Unix name cannot
  reach): a request to it fails at once with FailedPreconditionError saying so, rather than
  being retried as unreachable until its deadline.

The wire format (both connection kinds) is described in ``wire``. Received buffers
are read-only; ``.copy()`` an array to modify it. Options (plugins.toml
``[options."grpc+local"]``): ``segment_bytes`` (buffers from this size on travel as
segments; default 64 KiB); ``reply_pool_bytes`` (the reusable reply segments kept for one
client process, ``pool``; default 64 MiB, 0: a fresh sealed segment for every reply).

Modules: this one holds the listener, the channel and the transport; ``calls`` the
call connections (both ends); ``segments`` the data plane (which buffers travel in
segments, the received buffers, segment connections); ``unix`` the Unix socket
helpers; ``sealed`` the memfd segments; ``pool`` the reply segments a listener reuses
for each client process; ``wire`` the message layouts.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import grpc

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.envelope import INLINE_BUDGET, REPLY_LIMIT
from clusterwire.pending import FairConnections, PendingConnections
from clusterwire.security import Security
from clusterwire.thread_pool import WorkSlots, parked
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
from clusterwire.transports._grpc_common.status import abort, grpc_error
from clusterwire.transports.local import pool, sealed, unix, wire
from clusterwire.transports.local.calls import CallConnection, CallPool
from clusterwire.transports.local.probe import other_protocol
from clusterwire.transports.local.segments import (
    SegmentPeer,
    plan_buffers,
    received_buffers,
)

_METHOD = "/clusterwire.Local/Call"
#: How long a call under TLS waits for its reply's segments when it has no deadline.
_SEGMENT_WAIT = 10.0
#: How long a gRPC call waits for its client's segment connection (its HELLO races it).
_HELLO_WAIT = 2.0
#: The largest control message on the gRPC port.
_CONTROL_LIMIT = wire.LAYOUT.max_bytes(INLINE_BUDGET)


def _unregister_and_shutdown(selector: selectors.BaseSelector, conn: socket.socket) -> None:
    """Stop watching a pending connection and close it."""
    selector.unregister(conn)
    unix.shutdown(conn)


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
            "grpc+local",
            max_receive_bytes=_CONTROL_LIMIT)
        self._address = self._control.address
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._unix.bind(unix.socket_name(self._address))
        except OSError as err:
            self._unix.close()
            self._control.stop(None)
            raise errors.UnavailableError(
                f"Could not bind the shared-memory socket of {self._address}: {err}") from None
        self._unix.listen(64)
        self._unix.setblocking(False)
        self._clients: dict[int, SegmentPeer] = {}  # by client id, after their hello
        # Every Unix connection past its hello: segment connections and call connections, at
        # most max_connections, shared fairly between peers (uids: clusterwire.pending).
        self._connections: FairConnections[SegmentPeer | CallConnection] = FairConnections(
            options.max_connections)
        #: Calls served over call connections so far.
        self.unix_calls = 0
        self._calls = threading.Condition(threading.Lock())  # for the three below
        self._busy = 0  # call connections running a call
        self._draining = False  # stop() began: call connections take no new call
        self.slots = WorkSlots(options.max_workers)
        #: The reply segments of each client process's call connections (``pool``).
        self.pools = pool.PoolRegistry(transport.reply_pool_bytes)
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
        return unix.socket_name(self._address)

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


    def begin(self, connection: CallConnection) -> bool:
        """``connection`` starts running a call; False (not to run) once stopping."""
        with self._calls:
            if self._draining:
                return False
            connection.busy = True
            self._busy += 1
            self.unix_calls += 1
            return True

    def end(self, connection: CallConnection) -> bool:
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
                    now = time.monotonic()
                    # Idle pools are looked at every LINGER_S at least: a connection closing
                    # (its pool going idle) does not wake this thread.
                    deadlines = [d for d in (pending.next_deadline(), self.pools.expire(now))
                                 if d is not None] + [now + pool.LINGER_S]
                    wait = max(min(deadlines) - time.monotonic(), 0)
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
                    unix.shutdown(conn)

    def _accept_pending(self, selector: selectors.BaseSelector,
                        pending: PendingConnections[socket.socket]) -> None:
        """Accept every queued connection as pending, closing one over the cap."""
        while not self._stopped.is_set():
            try:
                conn, _ = self._unix.accept()
            except OSError:  # BlockingIOError: none left; others: the socket is shut down
                return
            peer = unix.peer_name(conn)
            if not self._admits(peer):  # refused before reading anything; a call
                # connection reads why
                self._refuse(conn, errors.RESOURCE_EXHAUSTED, self._full_message())
                continue
            conn.setblocking(False)
            evicted = pending.add(conn, peer, time.monotonic())
            if evicted is not None:
                _unregister_and_shutdown(selector, evicted)
            selector.register(conn, selectors.EVENT_READ)

    def _hello(self, conn: socket.socket) -> None:
        """Admit ``conn`` if its first message is a HELLO with the token, else close it."""
        try:
            message, fds, _, _ = socket.recv_fds(conn, wire.MAX_UNIX_MESSAGE,
                                                 wire.MAX_FDS_PER_MESSAGE)
        except OSError:
            unix.shutdown(conn)
            return
        try:
            op, client_id, count, token = wire.decode_unix(message)
            if op not in (wire.HELLO, wire.CALLS) or count or fds or not client_id:
                raise errors.InvalidArgumentError("the first message is not a HELLO")
        except errors.OpError:  # also the empty message of a closed connection
            unix.close_all(fds)
            unix.shutdown(conn)
            return
        if op == wire.CALLS:
            self._admit_calls(conn, token)
        else:
            self._admit_segments(conn, client_id, token)

    def _admit_segments(self, conn: socket.socket, client_id: int, token: bytes) -> None:
        """Admit a segment connection that showed the token (it then replaces the client's
        earlier one), else close it."""
        try:
            # Segments are accepted only on a connection that showed the token.
            self._security.check_token(token or None)
        except errors.OpError:
            unix.shutdown(conn)
            return
        name = unix.peer_name(conn)
        if not self._admits(name):
            unix.shutdown(conn)
            return
        conn.setblocking(True)
        peer = SegmentPeer(conn, client_id, on_close=self.forget, peer=name)
        old = None
        with self._clients_lock:
            admitted, closing = self._add(peer, name)
            if admitted:
                old = self._clients.get(client_id)
                self._clients[client_id] = peer
                self._clients_lock.notify_all()
        if not admitted:  # others were admitted since the check
            peer.close()
        for connection in [*closing, old]:
            if connection is not None:
                connection.close()

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
        connection, closing, peer = None, [], unix.peer_name(conn)
        with self._clients_lock:
            if not self._stopped.is_set():
                candidate = CallConnection(self, conn, peer)
                admitted, closing = self._add(candidate, peer)
                connection = candidate if admitted else None
        for displaced in closing:  # its call in flight, if any, fails: its client retries
            displaced.close()
        if connection is None:
            self._refuse(conn, errors.RESOURCE_EXHAUSTED, self._full_message())
            return
        conn.setblocking(True)
        try:
            conn.send(wire.encode_unix(wire.READY, 0, 0), socket.MSG_DONTWAIT)
        except OSError:
            connection.close()
            conn.close()
            return
        connection.start()

    def _add(self, connection: SegmentPeer | CallConnection, peer: str
             ) -> tuple[bool, list[SegmentPeer | CallConnection]]:
        """Count ``connection`` of ``peer`` (under _clients_lock) after forgetting, when the
        table is full, the connections whose clients have gone: whether it was counted, and
        the connections the caller closes (gone, displaced)."""
        closing = self._forget_hung_up()
        admitted, displaced = self._connections.add(connection, peer)
        return admitted, closing + ([displaced] if displaced is not None else [])

    def _forget_hung_up(self) -> list[SegmentPeer | CallConnection]:
        """When max_connections are counted, forget those whose client closed its end but
        whose thread has not run since (a busy host), so that they do not count against a
        new connection; the caller closes them. Under _clients_lock."""
        if not self._connections.full():
            return []
        gone = [c for c in self._connections if unix.hung_up(c.sock)]
        for connection in gone:
            self._connections.discard(connection)
        return gone

    def _admits(self, peer: str) -> bool:
        """Whether a connection of ``peer`` past its hello would be admitted now."""
        with self._clients_lock:
            closing = self._forget_hung_up()
            admits = self._connections.admits(peer)
        for connection in closing:
            connection.close()
        return admits

    def _full_message(self) -> str:
        return (f"The grpc+local server at {self._address} refused the connection: it holds "
                f"its max_connections ({self._max_connections}), and no other peer (user) "
                "holds more than this one.")

    @staticmethod
    def _refuse(conn: socket.socket, code: int, text: str) -> None:
        """Tell a connection why it is refused (best effort, never blocking), then close it."""
        unix.send_error(conn, 0, code, text)
        unix.shutdown(conn)

    def forget(self, connection: SegmentPeer | CallConnection) -> None:
        """A connection closed: it no longer counts against max_connections."""
        with self._clients_lock:
            self._connections.discard(connection)
            if (isinstance(connection, SegmentPeer)
                    and self._clients.get(connection.client_id) is connection):
                del self._clients[connection.client_id]

    def drain(self) -> None:
        self._control.drain()

    def report_ready(self, ready: bool) -> None:
        self._control.report_ready(ready)

    def connections(self) -> int:
        with self._clients_lock:
            return len(self._connections)

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
            calls = [c for c in self._connections if isinstance(c, CallConnection)]
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
        self.pools.close()

    def _call(self, message: bytes, context: grpc.ServicerContext) -> bytes:
        # The control server's interceptor checked the token before the request was read.
        try:
            control = wire.LAYOUT.decode(message, self._limit)
            client_id, transfer_id = control.fields
            peer = self._clients.get(client_id)  # a dict read needs no lock
            if peer is None:
                with parked(), self._clients_lock:
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
            # idle for message_idle_timeout_seconds is dropped, and until then this thread
            # waits parked (it holds none of the max_workers threads).
            fds = []
            if segments:
                with parked():
                    fds = peer.inbox.take(transfer_id, segments, self._segment_wait)
            request = Frame(control.header, received_buffers(control, fds), peer=peer.peer)
            response = self._handler(request)
            views, kinds, places, fds = plan_buffers(response.buffers, self.segment_bytes)
            peer.send_segments(transfer_id, fds)
            return wire.LAYOUT.encode((0, transfer_id), response.header, views, kinds, places)
        except errors.OpError as err:
            abort(context, err)
        except OSError as err:
            abort(context, errors.UnavailableError(f"shared-memory connection failed: {err}"))


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
        self._peer: SegmentPeer | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._pool = CallPool(address, security, self._client_id)  # calls without TLS
        _channels.add(self)

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's call connections (closing only the
        child's copies), so that the two processes never share one."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._pool.after_fork()

    # -- calls over gRPC (TLS) --------------------------------------------------------

    def _segment_peer(self) -> SegmentPeer:
        peer = self._peer
        if peer is not None and not peer.inbox.closed and not self._closed.is_set():
            return peer
        with self._lock:
            if self._closed.is_set():
                raise errors.CancelledError(f"Channel to {self._address} is closed.")
            if self._peer is None or self._peer.inbox.closed:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    sock.connect(unix.socket_name(self._address))
                except OSError as err:
                    sock.close()
                    elsewhere = unix.another_host(self._address) or other_protocol(
                        self._address, self._security, None)
                    if elsewhere is not None:
                        raise elsewhere from None
                    raise ConnectionFailed(
                        f"cannot reach a grpc+local server at {self._address} on this host "
                        f"({err}); grpc+local connects only tasks of the same host.") from None
                peer = SegmentPeer(sock)
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
        peer = self._segment_peer()
        transfer_id = next(self._ids)
        try:
            views, kinds, places, fds = plan_buffers(frame.buffers, self._transport.segment_bytes)
            peer.send_segments(transfer_id, fds)
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
        control = wire.LAYOUT.decode(reply, REPLY_LIMIT)
        segments = wire.segments(control)
        remaining = _SEGMENT_WAIT if deadline is None else max(deadline - time.monotonic(), 0.01)
        fds = peer.inbox.take(transfer_id, segments, remaining) if segments else []
        return Frame(control.header, received_buffers(control, fds))

    # -- the Channel interface ----------------------------------------------------------

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        if self._closed.is_set():
            raise errors.CancelledError(f"Channel to {self._address} is closed.")
        if self._tls:  # the TLS handshake decides who may call: calls go through gRPC
            return self._call_grpc(frame, timeout)
        return self._pool.call(frame, timeout, self._transport.segment_bytes)

    def close(self) -> None:
        self._closed.set()
        self._pool.close()  # wakes the calls waiting on its connections (CancelledError)
        with self._lock:
            peer, self._peer = self._peer, None
            channel = self._channel
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
        self.reply_pool_bytes = reader.number("reply_pool_bytes", 64 << 20, 0, 1 << 40,
                                              integer=True)
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
                "segment_bytes": str(self.segment_bytes),
                "reply_pool_bytes": str(self.reply_pool_bytes)}
