"""The "grpc" transport: frames over gRPC, bulk buffers as chunk streams.

Small frames (up to ``inline_bytes``) take one unary call each way, the
cheapest path gRPC has. Larger request frames are uploaded as a stream of
raw chunks; a larger response is announced in the unary reply and fetched,
so no message exceeds ``chunk_bytes`` (gRPC's 4 MiB cap never applies) and
no buffer passes through a protobuf field. The fetch reads the listener's
TCP bulk port (``bulk``: one kernel copy instead of grpcio's three) unless
the listener uses TLS or ``bulk_plane = "grpc"``, or the client cannot reach
that port; then it is a gRPC stream of chunks.

Options (plugins.toml ``[options.grpc]``): ``inline_bytes`` (default 1 MiB),
``chunk_bytes`` (default 1 MiB), ``fetch_ttl_seconds`` (default 60: how long
an announced response waits for its fetch), ``bulk_plane`` ("tcp", the
default, or "grpc": everything on the gRPC port), ``bulk_bytes`` (default
256 KiB: responses larger than this use the bulk port when there is one;
from about there on it beats a unary reply, whose bytes grpcio copies).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import grpc.experimental

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.security import Security
from clusterwire.transport import Channel, Frame, Handler, Listener, ListenOptions, Transport
from clusterwire.transports.grpc import framing
from clusterwire.transports.grpc.bulk import BulkClient, BulkServer, Unreachable
from clusterwire.transports.grpc.plumbing import (
    ControlServer,
    check_token,
    grpc_error,
    open_channel,
    status_code,
    token_metadata,
)

SERVICE = "clusterwire.Transport"
_CALL, _UPLOAD, _FETCH = (f"/{SERVICE}/{m}" for m in ("Call", "Upload", "Fetch"))
_CLIENT_LIMIT = 1 << 42
_BULK_PLANES = ("tcp", "grpc")
_BULK_RETRY_S = 30.0  # after the bulk port could not be reached, before it is tried again
_LOG = logging.getLogger(__name__)


def _message_limit(inline_bytes: int, chunk_bytes: int) -> int:
    return max(inline_bytes, chunk_bytes) + framing.MAX_HEADER_BYTES + (8 << 20)


class _Pending:
    """Announced responses waiting for their fetch, expiring after a TTL."""

    def __init__(self, ttl: float):
        self._ttl = ttl
        self._items: dict[int, tuple[float, list[memoryview]]] = {}
        self._lock = threading.Lock()

    def add(self, views: list[memoryview]) -> int:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (expiry, _) in self._items.items() if expiry < now]:
                del self._items[key]
            key = secrets.randbits(63) + 1  # unguessable: a fetch needs no other secret
            self._items[key] = (now + self._ttl, views)
            return key

    def take(self, key: int) -> list[memoryview] | None:
        with self._lock:
            item = self._items.pop(key, None)
        return None if item is None else item[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


class GrpcListener(Listener):
    """A gRPC server exposing Call / Upload / Fetch for one handler."""

    def __init__(self, transport: GrpcTransport, address: str, handler: Handler,
                 options: ListenOptions):
        self._transport = transport
        self._handler = handler
        self._limit = options.max_message_bytes
        self._pending = _Pending(transport.fetch_ttl)
        self._security = options.security
        limit = _message_limit(transport.inline_bytes, transport.chunk_bytes)
        # No maximum_concurrent_rpcs: gRPC's Python-side accounting costs ~45 us per call
        # here; the cluster service enforces max_concurrent_calls itself.
        self._control = ControlServer(
            address, self._security, SERVICE, {
                "Call": grpc.unary_unary_rpc_method_handler(self._call),
                "Upload": grpc.stream_unary_rpc_method_handler(self._upload),
                "Fetch": grpc.unary_stream_rpc_method_handler(self._fetch),
            }, options.max_workers, "grpc",
            [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", -1)],
            options.max_connections)
        self._bulk = None
        self._inline_response_bytes = transport.inline_bytes
        if transport.bulk_plane == "tcp" and self._security.tls is None:
            self._inline_response_bytes = min(transport.inline_bytes, transport.bulk_bytes)
            try:
                self._bulk = BulkServer(split_host_port(self.address)[0], self._pending.take,
                                        options.max_connections)
            except OSError as err:
                self._control.stop(None)
                raise errors.UnavailableError(
                    f"Could not open the bulk port beside {self.address}: {err}. Set "
                    "bulk_plane = \"grpc\" in [options.grpc] to serve everything on the gRPC "
                    "port.") from None

    @property
    def address(self) -> str:
        return self._control.address

    @property
    def bulk_port(self) -> int | None:
        """The TCP port large responses are fetched from, None when they stay on gRPC."""
        return self._bulk.port if self._bulk else None

    def start(self) -> None:
        self._control.start()
        if self._bulk:
            self._bulk.start()

    def stop(self, grace: float | None = None) -> None:
        # One grace for both: calls in flight, then the bulk fetches of their responses.
        deadline = time.monotonic() + (grace or 0.0)
        self._control.stop(grace)
        if self._bulk:
            self._bulk.stop(max(deadline - time.monotonic(), 0.0))
        self._pending.clear()

    def _respond(self, response: Frame) -> bytes:
        views = framing.buffer_views(response.buffers) if response.buffers else []
        if sum(map(len, views)) <= self._inline_response_bytes:
            return framing.encode_inline(response.header, views)
        fetch_id = self._pending.add(views)
        return framing.encode_prefix(response.header, [v.nbytes for v in views],
                                     framing.CONTINUED, fetch_id, self.bulk_port or 0)

    def _call(self, message: bytes, context: grpc.ServicerContext) -> bytes:
        check_token(context, self._security)
        try:
            prefix = framing.decode_prefix(message, self._limit)
            if prefix.flags != framing.INLINE:
                raise errors.InvalidArgumentError("Malformed frame: Call needs inline buffers.")
            request = Frame(prefix.header, framing.split_inline(message, prefix))
        except errors.OpError as err:
            context.abort(grpc.StatusCode(status_code(err.error_code)), err.message)
        return self._respond(self._handler(request))

    def _upload(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        check_token(context, self._security)
        try:
            first = next(messages, None)
            if first is None:
                raise errors.InvalidArgumentError("Malformed frame: empty upload.")
            prefix = framing.decode_prefix(first, self._limit)
            request = Frame(prefix.header, framing.assemble(messages, prefix.lengths))
        except errors.OpError as err:
            context.abort(grpc.StatusCode(status_code(err.error_code)), err.message)
        return self._respond(self._handler(request))

    def _fetch(self, message: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        check_token(context, self._security)
        key = int.from_bytes(message[:8], "little") if len(message) == 8 else 0
        views = self._pending.take(key)
        if views is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"No pending response {key}: it expired or was fetched already.")
        yield from framing.chunks(views, self._transport.chunk_bytes)


class GrpcChannel(Channel):
    """A gRPC channel to one listener."""

    def __init__(self, transport: GrpcTransport, address: str, security: Security):
        split_host_port(address)
        self._transport = transport
        self._address = address
        self._metadata = token_metadata(security)
        self._bulk = BulkClient(address)
        self._bulk_after = 0.0  # monotonic time from which the bulk port is tried again
        limit = _message_limit(transport.inline_bytes, transport.chunk_bytes)
        # Single-threaded unary streams: a fetch is read by the calling thread itself,
        # not through the channel's spin thread (which cost ~1 ms of CPU per MiB fetched).
        self._channel = open_channel(address, security, [
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", -1),
            (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)])
        self._unary = self._channel.unary_unary(_CALL, _registered_method=True)
        self._upload = self._channel.stream_unary(_UPLOAD, _registered_method=True)
        self._fetch = self._channel.unary_stream(_FETCH, _registered_method=True)

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        views = framing.buffer_views(frame.buffers) if frame.buffers else []
        try:
            if sum(map(len, views)) <= self._transport.inline_bytes:
                reply = self._unary(framing.encode_inline(frame.header, views), timeout=timeout,
                                    metadata=self._metadata)
            else:
                first = framing.encode_prefix(frame.header, [v.nbytes for v in views], 0)
                stream = itertools.chain(
                    [first], framing.chunks(views, self._transport.chunk_bytes))
                reply = self._upload(stream, timeout=timeout, metadata=self._metadata)
            prefix = framing.decode_prefix(reply, _CLIENT_LIMIT)
            if prefix.flags == framing.INLINE:
                return Frame(prefix.header, framing.split_inline(reply, prefix))
            if prefix.bulk_port and time.monotonic() >= self._bulk_after:
                try:
                    return Frame(prefix.header, self._bulk.fetch(
                        prefix.bulk_port, prefix.fetch_id, prefix.lengths, deadline))
                except Unreachable as err:
                    if err.lasting:
                        _LOG.warning("Fetching over gRPC for %.0f s: %s", _BULK_RETRY_S, err)
                        self._bulk_after = time.monotonic() + _BULK_RETRY_S
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            stream = self._fetch(prefix.fetch_id.to_bytes(8, "little"), timeout=remaining,
                                 metadata=self._metadata)
            return Frame(prefix.header, framing.assemble(iter(stream), prefix.lengths))
        except grpc.RpcError as err:
            raise grpc_error(err, self._address) from None
        except ValueError as err:  # grpc raises it for a closed channel
            raise errors.CancelledError(f"Channel to {self._address} is closed: {err}") from None

    def close(self) -> None:
        self._bulk.close()
        self._channel.close()


class GrpcTransport(Transport):
    """Frames over gRPC (HTTP/2), one process-wide instance."""

    protocol = "grpc"

    def __init__(self, options: Mapping[str, Any] | None = None):
        options = dict(options or {})
        self.inline_bytes = _positive(options.pop("inline_bytes", 1 << 20), "inline_bytes")
        self.chunk_bytes = _positive(options.pop("chunk_bytes", 1 << 20), "chunk_bytes")
        self.fetch_ttl = float(_positive(options.pop("fetch_ttl_seconds", 60), "fetch_ttl_seconds"))
        self.bulk_plane = options.pop("bulk_plane", "tcp")
        self.bulk_bytes = _positive(options.pop("bulk_bytes", 256 << 10), "bulk_bytes")
        if self.bulk_plane not in _BULK_PLANES:
            raise errors.InvalidArgumentError(
                f"grpc option bulk_plane must be one of {_BULK_PLANES}, got {self.bulk_plane!r}")
        if options:
            raise errors.InvalidArgumentError(
                f"Unknown option(s) for the grpc transport: {sorted(options)}; known: "
                "inline_bytes, chunk_bytes, fetch_ttl_seconds, bulk_plane, bulk_bytes.")

    def listen(self, address: str, handler: Handler, options: ListenOptions) -> Listener:
        return GrpcListener(self, address, handler, options)

    def connect(self, address: str, security: Security | None = None) -> Channel:
        return GrpcChannel(self, address, security or Security())

    def info(self) -> dict[str, str]:
        stream = f"grpc chunk stream ({self.chunk_bytes} B chunks)"
        if self.bulk_plane == "grpc":
            return {"control": "grpc", "data": stream}
        return {"control": "grpc", "data": f"tcp bulk port for responses; {stream} for uploads "
                                           "and under TLS"}


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise errors.InvalidArgumentError(f"grpc option {name} must be a positive number, "
                                          f"got {value!r}")
    return int(value)
