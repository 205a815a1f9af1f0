"""The "grpc+verbs" transport: gRPC control plane, UCX data plane.

gRPC carries what is rare: the hello that exchanges UCX worker addresses
(so no UCX listener port is needed and any UCX_TLS works, shared memory
included) and liveness pings. Every call then travels over UCX: a control
message with the header and small buffers, and each bulk buffer as its own
UCX message, received in place (rendezvous) into its final array. Bulk
request buffers are sent only after the server accepts the frame's declared
size, so an oversized frame is refused before anything is allocated.

UCX picks RDMA verbs where InfiniBand/RoCE hardware and a verbs-enabled UCX
exist, TCP or shared memory otherwise; ``status`` reports what UCX may use
(the PyPI wheel of UCX has no verbs support: see the README). Endpoint error
handling is off because it disables shared memory; a dead peer is detected
through the control plane (pings while a call waits) instead.

Options (plugins.toml ``[options."grpc+verbs"]``): ``tls`` (UCX_TLS, e.g.
"tcp,self" or "sm,self"; default all), ``net_devices`` (UCX_NET_DEVICES),
``bulk_bytes`` (buffers from this size on travel as their own message;
default 64 KiB), ``idle_slot_seconds`` (a client silent this long loses its
connection state; default 600), ``compiled`` (false: drive small calls in
Python instead of the C helper ``_ucp``; default true, used when it was built).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import itertools
import operator
import secrets
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.envelope import BULK, INLINE_BUDGET, REPLY_LIMIT, interleave
from clusterwire.pending import FairConnections
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
from clusterwire.transports._grpc_common.door import peer_host
from clusterwire.transports._grpc_common.server import ControlServer
from clusterwire.transports._grpc_common.status import abort, grpc_error
from clusterwire.transports.verbs import wire
from clusterwire.transports.verbs.address_check import AddressChecker
from clusterwire.transports.verbs.engine import NO_REPLY_YET, NOT_SENT, REPLIED, UcxEngine

_SERVICE = "clusterwire.Verbs"
_CONTROL_LIMIT = wire.LAYOUT.max_bytes(INLINE_BUDGET)
_PING_AFTER = 1.0
_BULK_WAIT = 60.0
_HELLO = struct.Struct(f"<I{wire.KEY_BYTES}s")  # slot, slot key


class _Waiter:
    """Collects the messages of one call as the engine delivers them."""

    __slots__ = ("_engine", "messages", "error", "_keys")

    def __init__(self, engine: UcxEngine) -> None:
        self._engine = engine
        self.messages: dict[int, np.ndarray] = {}
        self.error: BaseException | None = None
        self._keys: dict[int, int] = {}  # tag -> expectation key, until its message arrived

    def expect(self, tag: int, limit: int) -> None:
        """Receive the message tagged ``tag`` (at most ``limit`` bytes) into ``messages``."""
        self._keys[tag] = self._engine.expect(tag, (1 << 64) - 1, limit, self.deliver)

    def deliver(self, error: BaseException | None, sender_tag: int, buffer: np.ndarray) -> None:
        """Keep a delivered message (or the first error)."""
        if error is not None and self.error is None:
            self.error = error
        else:
            self.messages[sender_tag] = buffer

    def has(self, tag: int) -> Callable[[], bool]:
        """A test of whether the message tagged ``tag`` has arrived."""
        return functools.partial(operator.contains, self.messages, tag)

    def wait_for(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Drive the engine until ``ready()`` or an error (False after ``timeout`` seconds)."""
        return self._engine.wait(lambda: ready() or self.error is not None, timeout)

    def cancel(self) -> None:
        """Stop expecting the messages that did not arrive."""
        for tag, key in self._keys.items():
            if tag not in self.messages:
                self._engine.cancel(key)


class VerbsListener(Listener):
    """gRPC hello/ping service plus UCX request handling for one handler."""

    def __init__(self, transport: VerbsTransport, address: str, handler: Handler,
                 options: ListenOptions):
        self._transport = transport
        self._engine = transport.engine
        self._handler = handler
        self._limit = options.max_message_bytes
        self._security = options.security
        self._control = ControlServer(address, _SERVICE, {
            "Hello": grpc.unary_unary_rpc_method_handler(self._hello),
            "Ping": grpc.unary_unary_rpc_method_handler(self._ping),
            "Bye": grpc.unary_unary_rpc_method_handler(self._bye),
        }, options, "verbs-control", "grpc+verbs", max_workers=4)
        self._address = self._control.address
        self._endpoints: dict[int, tuple[Any, bytes, str]] = {}  # slot -> endpoint, key, peer
        # The slots by peer (the Hello's IP address), at most max_connections, fairly shared.
        self._shares: FairConnections[int] = FairConnections(options.max_connections)
        self._last_seen: dict[int, float] = {}  # slot -> time of its last request or ping
        self._max_connections = options.max_connections
        self._active: set[tuple[Any, int]] = set()  # (endpoint, reply tag) being served
        transport.addresses.start()
        self._engine.serve(options.max_workers)
        transport.slots.open()
        self._lock = threading.Lock()
        self._stopped = False
        self._started = False

    @property
    def address(self) -> str:
        return self._address

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._control.start()

    def _known_slot(self, request: bytes) -> int | None:
        """The slot a (slot, key) request names, if the key matches (caller holds the lock)."""
        if len(request) != _HELLO.size:
            return None
        slot, key = _HELLO.unpack(request)
        endpoint, known, _ = self._endpoints.get(slot, (None, b"", ""))
        if endpoint is None or not hmac.compare_digest(key, known):
            return None
        return slot

    def _ping(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Liveness, and whether the client's slot still exists (b"\x01") or not (b"\x00")."""
        with self._lock:
            slot = self._known_slot(request)
            if slot is not None:
                self._last_seen[slot] = time.monotonic()
        return b"\x00" if slot is None else b"\x01"

    def _bye(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """A client closed its channel: free its slot (it proves it with the slot key)."""
        with self._lock:
            slot = self._known_slot(request)
            if slot is not None:
                self._forget(slot)
        return b""

    def _forget(self, slot: int) -> None:
        """Drop a client's slot and close its endpoint (caller holds the lock)."""
        endpoint, _, _ = self._endpoints.pop(slot)
        self._shares.discard(slot)
        self._last_seen.pop(slot, None)
        self._transport.slots.remove(slot)
        self._engine.close_endpoint(endpoint)

    def _reap_idle(self) -> None:
        """Free the slots of clients silent for ``idle_slot_seconds`` (killed without a bye).

        A live client that was merely silent finds out through a ping on its
        next call and reconnects; that call never ran, so it is retried.
        """
        cutoff = time.monotonic() - self._transport.idle_slot_seconds
        busy = {wire.split_tag(tag)[1] for _, tag in self._active}
        for slot in [s for s, seen in self._last_seen.items() if seen < cutoff and s not in busy]:
            self._forget(slot)

    def _hello(self, client_address: bytes, context: grpc.ServicerContext) -> bytes:
        if not self._transport.addresses.usable(client_address):
            abort(context, errors.InvalidArgumentError(
                "Hello needs a valid UCX worker address of the client."))
        try:
            endpoint = self._engine.connect(client_address)
        except errors.OpError as err:
            abort(context, errors.UnavailableError(err.message))
        peer = peer_host(context.peer())
        with self._lock:
            self._reap_idle()
            slot = None if self._stopped else self._transport.slots.add(self._on_request)
            admitted, displaced = (False, None) if slot is None else \
                self._shares.add(slot, peer)
            if not admitted:
                if slot is not None:
                    self._transport.slots.remove(slot)
                self._engine.close_endpoint(endpoint)
                if slot is None:
                    abort(context, errors.UnavailableError("The server is stopping."))
                abort(context, errors.ResourceExhaustedError(
                    f"The server holds its max_connections ({self._max_connections}) clients, "
                    "and no other peer holds more than this one: close idle channels, or "
                    "raise max_connections."))
            if displaced is not None:  # its client finds out by a ping and says Hello again
                self._forget(displaced)
            key = secrets.token_bytes(wire.KEY_BYTES)
            self._endpoints[slot] = (endpoint, key, peer)
            self._last_seen[slot] = time.monotonic()
        return _HELLO.pack(slot, key) + self._engine.address

    def _on_request(self, slot: int, transfer: int, control: np.ndarray) -> None:
        """A request control message arrived: serve it on a serving thread of the engine."""
        self._engine.submit(functools.partial(self._serve, slot, transfer, control))

    def _serve(self, slot: int, transfer: int, message: np.ndarray) -> None:
        reply_tag = wire.tag(wire.RESPONSE, slot, transfer)
        with self._lock:
            endpoint, key, peer = self._endpoints.get(slot, (None, b"", ""))
            if endpoint is None:
                return
            self._last_seen[slot] = time.monotonic()
            self._active.add((endpoint, reply_tag))
        engine, codec = self._engine, self._transport.codec
        bulk: list[int] = []
        sent: list[BaseException | None] = []  # outcomes of the bulk sends
        try:
            _, sender_key, header, kinds, lengths, inline = codec.decode(message, self._limit)
            if not hmac.compare_digest(sender_key, key):
                return  # not from the client that authenticated this slot: drop it
            if BULK in kinds:
                inline = self._receive_bulk(endpoint, slot, transfer, kinds, lengths, inline)
            try:
                response = self._handler(Frame(header, inline, peer=peer))
            except Exception as err:
                raise errors.InternalError(f"Handler failed: {type(err).__name__}: {err}") from None
            reply, bulk = codec.encode(response.header, response.buffers,
                                       self._transport.bulk_bytes, INLINE_BUDGET, wire.NO_KEY, 0)
            engine.send(endpoint, reply, reply_tag)
            for index in bulk:
                engine.send(endpoint, memoryview(response.buffers[index]).cast("B"),
                            wire.tag(wire.RESPONSE_DATA, slot, transfer, index), sent.append)
        except errors.OpError as err:
            engine.send(endpoint, wire.encode_error(err.error_code, err.message), reply_tag)
        finally:
            with self._lock:
                self._active.discard((endpoint, reply_tag))
        if len(sent) < len(bulk):
            # This thread carries the transfer to its end, as bare UCX code would: left to
            # the serving threads, it hopped between them (two shared most 64 MiB gets).
            with contextlib.suppress(errors.CancelledError):
                engine.wait(lambda: len(sent) == len(bulk) or endpoint.closed, _BULK_WAIT)

    def _receive_bulk(self, endpoint, slot: int, transfer: int, kinds: Sequence[int],
                      lengths: Sequence[int], inline: list[memoryview]) -> list[Any]:
        """The request's buffers: its inline ones and its bulk ones, received now."""
        wanted = {wire.tag(wire.REQUEST_DATA, slot, transfer, i): lengths[i]
                  for i, k in enumerate(kinds) if k == BULK}
        waiter = _Waiter(self._engine)
        for t, n in wanted.items():
            waiter.expect(t, n)
        self._engine.send(endpoint, b"go", wire.tag(wire.GO, slot, transfer))
        if not waiter.wait_for(lambda: len(waiter.messages) == len(wanted), _BULK_WAIT):
            waiter.cancel()
            raise errors.DeadlineExceededError("The request's bulk buffers did not arrive.")
        if waiter.error is not None:
            raise errors.InvalidArgumentError(f"Bulk buffer failed: {waiter.error}")
        return interleave(kinds, inline, (waiter.messages[t] for t in wanted))

    def drain(self) -> None:
        self._control.drain()

    def report_ready(self, ready: bool) -> None:
        self._control.report_ready(ready)

    def connections(self) -> int:
        with self._lock:
            return len(self._endpoints)

    def stop(self, grace: float | None = None) -> None:
        with self._lock:
            self._stopped = True
            endpoints, self._endpoints = dict(self._endpoints), {}
            self._shares = FairConnections(self._max_connections)
            active, self._active = list(self._active), set()
        # Calls still running are answered CancelledError before the endpoints close.
        sent = threading.Semaphore(0)
        for endpoint, reply_tag in active:
            self._engine.send(endpoint, wire.encode_error(
                errors.CANCELLED, f"The server at {self._address} stopped during the call."),
                reply_tag, lambda _: sent.release())
        for _ in active:
            sent.acquire(timeout=1.0)
        self._control.stop(grace)
        for slot, (endpoint, _, _) in endpoints.items():
            self._transport.slots.remove(slot)
            self._engine.close_endpoint(endpoint)


class _Slots:
    """Engine-wide slot numbers of client connections, dispatching request messages."""

    def __init__(self, engine: UcxEngine):
        self._engine = engine
        self._handlers: dict[int, Callable[[int, int, np.ndarray], None]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._opened = False

    def open(self) -> None:
        """Start receiving request messages (idempotent; a listener needs it)."""
        with self._lock:
            if self._opened:
                return
            self._opened = True
        self._engine.expect(wire.tag(wire.REQUEST, 0, 0), wire.KIND_MASK, _CONTROL_LIMIT,
                            self._dispatch, standing=True)

    def add(self, handler: Callable[[int, int, np.ndarray], None]) -> int:
        with self._lock:
            if len(self._handlers) >= wire.MAX_SLOTS - 1:
                raise errors.ResourceExhaustedError("Too many grpc+verbs client connections.")
            slot = next(self._ids) % (wire.MAX_SLOTS - 1) + 1
            while slot in self._handlers:
                slot = next(self._ids) % (wire.MAX_SLOTS - 1) + 1
            self._handlers[slot] = handler
            return slot

    def count(self) -> int:
        """Client connections this process serves."""
        with self._lock:
            return len(self._handlers)

    def remove(self, slot: int) -> None:
        with self._lock:
            self._handlers.pop(slot, None)

    def _dispatch(self, error: BaseException | None, sender_tag: int, buffer: np.ndarray) -> None:
        _, slot, transfer, _ = wire.split_tag(sender_tag)
        with self._lock:
            handler = self._handlers.get(slot)
        if handler is not None and error is None:
            handler(slot, transfer, buffer)


class VerbsChannel(Channel):
    """A client of one grpc+verbs listener: hello over gRPC, then calls over UCX."""

    def __init__(self, transport: VerbsTransport, address: str, security: Security):
        split_host_port(address)
        self._transport = transport
        self._engine = transport.engine
        self._address = address
        self._metadata = token_metadata(security)
        self._security = security
        self._grpc = open_channel(address, security)
        self._hello = self._grpc.unary_unary(f"/{_SERVICE}/Hello")
        self._ping = self._grpc.unary_unary(f"/{_SERVICE}/Ping")
        self._bye = self._grpc.unary_unary(f"/{_SERVICE}/Bye")
        self._lock = threading.Lock()
        self._connection: tuple[int, bytes, Any] | None = None
        self._closed = False

    def _connect(self, timeout: float | None) -> tuple[int, bytes, Any]:
        connection = self._connection  # the common case, without the lock
        if connection is not None and not self._closed:
            return connection
        with self._lock:
            if self._closed:
                raise errors.CancelledError(f"Channel to {self._address} is closed.")
            if self._connection is None:
                try:
                    reply = self._hello(self._engine.address, timeout=timeout,
                                        metadata=self._metadata)
                except grpc.RpcError as err:
                    raise grpc_error(err, self._address, self._security) from None
                slot, key = _HELLO.unpack_from(reply)
                endpoint = self._engine.connect(reply[_HELLO.size:])
                self._connection = (slot, key, endpoint)
            return self._connection

    def _drop_connection(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            self._engine.close_endpoint(connection[2])

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        slot, key, endpoint = self._connect(timeout)
        engine, transport = self._engine, self._transport
        transfer = engine.next_transfer()
        codec = transport.codec
        message, bulk = codec.encode(frame.header, frame.buffers, transport.bulk_bytes,
                                     INLINE_BUDGET, key, 0)
        waiter = _Waiter(engine)
        response_tag = wire.tag(wire.RESPONSE, slot, transfer)
        try:
            if bulk:
                self._send_with_bulk(waiter, endpoint, message, slot, transfer, frame.buffers,
                                     bulk, deadline)
                self._wait(waiter, waiter.has(response_tag), deadline)
            else:
                request_tag = wire.tag(wire.REQUEST, slot, transfer)
                patience = _PING_AFTER if deadline is None else \
                    min(_PING_AFTER, deadline - time.monotonic())
                sent = engine.exchange(endpoint, message, request_tag, response_tag,
                                       _CONTROL_LIMIT, waiter.deliver, max(patience, 0))
                if sent == NOT_SENT:
                    waiter.expect(response_tag, _CONTROL_LIMIT)
                    engine.send(endpoint, message, request_tag)
                elif sent == NO_REPLY_YET:
                    waiter.expect(response_tag, _CONTROL_LIMIT)
                if sent != REPLIED or waiter.error is not None:
                    self._wait(waiter, waiter.has(response_tag), deadline,
                               ping_first=sent != NOT_SENT)
            status, _, header, kinds, lengths, inline = codec.decode(
                waiter.messages[response_tag], REPLY_LIMIT)
            if status:
                raise errors.error_from_code(status, header.decode(errors="replace"))
            if BULK not in kinds:
                return Frame(header, inline)
            wanted = {wire.tag(wire.RESPONSE_DATA, slot, transfer, i): lengths[i]
                      for i, k in enumerate(kinds) if k == BULK}
            for t, n in wanted.items():
                waiter.expect(t, n)
            self._wait(waiter, lambda: all(t in waiter.messages for t in wanted), deadline)
            return Frame(header, interleave(kinds, inline, (waiter.messages[t] for t in wanted)))
        finally:
            waiter.cancel()

    def _send_with_bulk(self, waiter: _Waiter, endpoint, message: bytes, slot: int,
                        transfer: int, buffers: Sequence[Any], bulk: list[int],
                        deadline: float | None) -> None:
        """Send a request with bulk buffers: its control message, then (once the server
        accepted the frame's size) each bulk buffer."""
        engine = self._engine
        response_tag = wire.tag(wire.RESPONSE, slot, transfer)
        go_tag = wire.tag(wire.GO, slot, transfer)
        waiter.expect(response_tag, _CONTROL_LIMIT)
        waiter.expect(go_tag, 16)
        engine.send(endpoint, message, wire.tag(wire.REQUEST, slot, transfer))
        self._wait(waiter, lambda: go_tag in waiter.messages or response_tag in waiter.messages,
                   deadline)
        if go_tag in waiter.messages:
            for index in bulk:
                engine.send(endpoint, memoryview(buffers[index]).cast("B"),
                            wire.tag(wire.REQUEST_DATA, slot, transfer, index))

    def _wait(self, waiter: _Waiter, ready: Callable[[], bool], deadline: float | None,
              ping_first: bool = False) -> None:
        """Wait for ``ready``; ping the server while waiting long, so a dead peer fails fast.

        ``ping_first``: the caller already waited a ping's interval.
        """
        if waiter.error is None and ready():
            return
        next_ping = time.monotonic() + (0 if ping_first else _PING_AFTER)
        while True:
            now = time.monotonic()
            step = next_ping - now if deadline is None else min(next_ping, deadline) - now
            if waiter.wait_for(ready, max(step, 0)):
                if waiter.error is not None:
                    raise errors.UnavailableError(f"UCX transfer failed: {waiter.error}")
                return
            if self._closed:
                raise errors.CancelledError(f"Channel to {self._address} was closed.")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise errors.DeadlineExceededError(f"No response from {self._address} in time.")
            if now >= next_ping:
                self._check_alive()
                next_ping = time.monotonic() + _PING_AFTER

    def _check_alive(self) -> None:
        with self._lock:
            connection = self._connection
        request = _HELLO.pack(connection[0], connection[1]) if connection else b""
        try:
            known = self._ping(request, timeout=2.0, metadata=self._metadata)
        except grpc.RpcError as err:
            self._drop_connection()
            error = grpc_error(err, self._address, self._security)
            raise errors.UnavailableError(
                f"The server at {self._address} stopped answering: {error.message}") from None
        except ValueError:  # the gRPC channel was closed under us
            raise errors.CancelledError(f"Channel to {self._address} was closed.") from None
        if connection is not None and known == b"\x00":
            self._drop_connection()
            raise ConnectionFailed(
                f"The server at {self._address} no longer knows this connection (idle too long, "
                "or restarted); the request was not run. Retry to reconnect.")

    def close(self) -> None:
        self._closed = True
        with self._lock:
            connection = self._connection
        if connection is not None:
            with contextlib.suppress(grpc.RpcError, ValueError):  # best effort: server may be gone
                self._bye(_HELLO.pack(connection[0], connection[1]), timeout=1.0,
                          metadata=self._metadata)
        self._drop_connection()
        self._grpc.close()


class VerbsTransport(Transport):
    """gRPC control plane, UCX data plane; one UCX engine per process."""

    protocol = "grpc+verbs"

    def __init__(self, options: Mapping[str, Any] | None = None):
        reader = OptionReader(self.protocol, options)
        tls = reader.text("tls")
        net_devices = reader.text("net_devices")
        self.bulk_bytes = reader.positive("bulk_bytes", 64 << 10, integer=True)
        self.idle_slot_seconds = reader.positive("idle_slot_seconds", 600)
        compiled = reader.flag("compiled", True)
        reader.finish()
        self.engine = UcxEngine(tls, net_devices, compiled)
        #: Encodes and decodes control messages: the C helper's functions, or wire's.
        self.codec = self.engine.compiled or wire
        self.slots = _Slots(self.engine)
        self.addresses = AddressChecker()

    def listen(self, address: str, handler: Handler, options: ListenOptions) -> Listener:
        return VerbsListener(self, address, handler, options)

    def connect(self, address: str, security: Security | None = None) -> Channel:
        return VerbsChannel(self, address, security or Security())

    def info(self) -> dict[str, str]:
        return {"control": "grpc (hello, liveness)", "data": "ucx",
                "clients": str(self.slots.count()), **self.engine.info()}

