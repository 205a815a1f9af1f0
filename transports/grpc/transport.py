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
from about there on it beats a unary reply, whose bytes grpcio copies), ``fast_lane``
(default false: true sends calls whose requests fit ``inline_bytes`` over the listener's
TCP fast lane instead of a unary call, see ``lane``; inside TLS when the listener has TLS,
``lane_tls``; refused with ``bulk_plane = "grpc"``).

Limits (``ListenOptions``): gRPC core enforces the connection limits
(``_grpc_common.server.connection_args``), with a token its port's door the pending
connections' (``_grpc_common.door``); calls without the token are refused before their
request is read. Upload and Fetch are streamed calls: at most
``max_workers - small_call_reserve`` work at once, the others are refused as
busy before anything is read and the channel sends them again until its
deadline. An upload works only while its chunks arrive; how many may be open,
how fast they and fetches must go and which upload makes room for a new one is
``uploads``.
A dropped upload gets DeadlineExceededError (a timeout, not a malformed frame:
sent again promptly, it would succeed); its buffers are allocated as their
bytes arrive, so it holds what it sent, not what it declared. The bulk port
applies the same limits itself (``bulk``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import grpc
import grpc.experimental

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.backoff import STREAM_BUSY
from clusterwire.envelope import (
    BULK,
    REPLY_LIMIT,
    Envelope,
    bulk_lengths,
    interleave,
    split_inline,
)
from clusterwire.security import Security
from clusterwire.thread_pool import WorkSlots
from clusterwire.transport import Channel, Frame, Handler, Listener, ListenOptions, Transport
from clusterwire.transport_options import OptionReader
from clusterwire.transports._grpc_common.client import open_channel, token_metadata
from clusterwire.transports._grpc_common.door import peer_host
from clusterwire.transports._grpc_common.server import ControlServer
from clusterwire.transports._grpc_common.status import abort, grpc_error, is_busy
from clusterwire.transports.grpc import framing
from clusterwire.transports.grpc.bulk import BulkClient, BulkServer, Unreachable
from clusterwire.transports.grpc.lane import LaneClient, LaneServer
from clusterwire.transports.grpc.relay import (
    Incoming,
    Relay,
    RelayPart,
    Verbatim,
    relay_of,
    verbatim_of,
)
from clusterwire.transports.grpc.uploads import Fetches, Upload, Uploads

SERVICE = "clusterwire.Transport"
_CALL, _UPLOAD, _FETCH, _LANE = (f"/{SERVICE}/{m}" for m in ("Call", "Upload", "Fetch", "Lane"))
_BULK_PLANES = ("tcp", "grpc")
_BULK_RETRY_S = 30.0  # after the bulk port could not be reached, before it is tried again
_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")
#: Failures of a lane ticket call that may pass: the lane is tried again at the next call.
_PASSING = frozenset((grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED))


def _message_limit(inline_bytes: int, chunk_bytes: int) -> int:
    """The largest gRPC message: an envelope with ``inline_bytes`` inline, or a chunk."""
    return max(framing.LAYOUT.max_bytes(inline_bytes), chunk_bytes)


class _Pending:
    """Announced responses waiting for their fetch, expiring after a TTL."""

    def __init__(self, ttl: float):
        self._ttl = ttl
        self._items: dict[int, tuple[float, list[memoryview] | Relay]] = {}
        self._lock = threading.Lock()

    def add(self, views: list[memoryview] | Relay) -> int:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (expiry, _) in self._items.items() if expiry < now]:
                del self._items[key]
            key = secrets.randbits(63) + 1  # unguessable: a fetch needs no other secret
            self._items[key] = (now + self._ttl, views)
            return key

    def take(self, key: int) -> list[memoryview] | Relay | None:
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
        self._stream_slots = _stream_slots(options)
        self._streams = WorkSlots(self._stream_slots)  # streamed calls working, not parked
        self._uploads = Uploads(options.max_concurrent_calls,
                                options.message_idle_timeout_seconds, self._streams)
        self._fetches = Fetches(options.message_idle_timeout_seconds)
        limit = _message_limit(transport.inline_bytes, transport.chunk_bytes)
        # No maximum_concurrent_rpcs: gRPC's Python-side accounting costs ~45 us per call
        # here; the cluster service enforces max_concurrent_calls itself.
        lane = transport.fast_lane
        methods = {
            "Call": grpc.unary_unary_rpc_method_handler(self._call),
            "Upload": grpc.stream_unary_rpc_method_handler(self._upload),
            "Fetch": grpc.unary_stream_rpc_method_handler(self._fetch),
        }
        if lane:
            methods["Lane"] = grpc.unary_unary_rpc_method_handler(self._lane_ticket)
        self._control = ControlServer(address, SERVICE, methods, options, "grpc", "grpc",
                                      max_receive_bytes=limit)
        self._bulk = None
        self._lane: LaneServer | None = None
        self._inline_response_bytes = transport.inline_bytes
        if transport.bulk_plane == "tcp" and self._security.tls is None:
            self._inline_response_bytes = min(transport.inline_bytes, transport.bulk_bytes)
            try:
                self._bulk = BulkServer(split_host_port(self.address)[0], self._pending.take,
                                        options)
            except OSError as err:
                self._control.stop(None)
                raise errors.UnavailableError(
                    f"Could not open the bulk port beside {self.address}: {err}. Set "
                    "bulk_plane = \"grpc\" in [options.grpc] to serve everything on the gRPC "
                    "port.") from None
        if lane:
            try:
                self._lane = LaneServer(split_host_port(self.address)[0], handler,
                                        self._respond, options,
                                        framing.LAYOUT.max_bytes(transport.inline_bytes),
                                        transport.fetch_ttl, self.address)
            except OSError as err:
                self.stop(None)
                raise errors.UnavailableError(
                    f"Could not open the fast lane's port beside {self.address}: {err}. Set "
                    "fast_lane = false in [options.grpc].") from None

    @property
    def address(self) -> str:
        return self._control.address

    @property
    def bulk_port(self) -> int | None:
        """The TCP port large responses are fetched from, None when they stay on gRPC."""
        return self._bulk.port if self._bulk else None

    @property
    def lane(self) -> LaneServer | None:
        """The fast lane (``lane``), None when it is off."""
        return self._lane

    def start(self) -> None:
        self._control.start()
        if self._bulk:
            self._bulk.start()
        if self._lane:
            self._lane.start()

    def drain(self) -> None:
        self._control.drain()

    def report_ready(self, ready: bool) -> None:
        self._control.report_ready(ready)

    def stop(self, grace: float | None = None) -> None:
        # One grace for both: calls in flight, then the bulk fetches of their responses.
        deadline = time.monotonic() + (grace or 0.0)
        if self._lane:  # at the same time as the gRPC port: its calls share the grace
            lane = threading.Thread(target=self._lane.stop, args=(grace,), daemon=True,
                                    name="clusterwire-grpc-lane-stop")
            lane.start()
        self._control.stop(grace)
        if self._lane:
            lane.join()
        if self._bulk:
            self._bulk.stop(max(deadline - time.monotonic(), 0.0))
        self._pending.clear()
        self._fetches.close()

    def _respond(self, response: Frame) -> bytes:
        verbatim = verbatim_of(response.header, response.buffers)
        if verbatim is not None:
            return verbatim
        relay = relay_of(response.buffers)
        if relay is not None:  # a forwarded response, passed on as it arrives
            if relay.nbytes > self._inline_response_bytes:
                return framing.encode_bulk(response.header, relay.lengths,
                                           self._pending.add(relay), self.bulk_port or 0)
            response = Frame(response.header, relay.read_all())
        views = framing.buffer_views(response.buffers) if response.buffers else []
        if sum(map(len, views)) <= self._inline_response_bytes:
            return framing.encode_inline(response.header, views)
        fetch_id = self._pending.add(views)
        return framing.encode_bulk(response.header, [v.nbytes for v in views], fetch_id,
                                   self.bulk_port or 0)

    def _admit(self, context: grpc.ServicerContext) -> None:
        """Take a slot for a streamed call's work, or refuse it as busy at once.

        Streamed calls get at most ``max_workers - small_call_reserve`` working threads, so
        calls without a streamed body (the token gate has refused unauthenticated ones
        before they took a thread) always find one. Waiting here would hold a thread too.
        The caller gives the slot back (``_streams.release``) from the same thread.
        """
        if not self._streams.try_acquire():
            abort(context, errors.ResourceExhaustedError(
                f"Busy: the {self._stream_slots} threads for streamed requests "
                "(max_workers - small_call_reserve) are all working."), busy=True)

    def _lane_ticket(self, message: bytes, context: grpc.ServicerContext) -> bytes:
        """A ticket for one fast-lane connection from the caller's peer (``lane``)."""
        return self._lane.ticket(peer_host(context.peer()))

    def _call(self, message: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            envelope = framing.LAYOUT.decode(message, self._limit)
            if BULK in envelope.kinds:
                raise errors.InvalidArgumentError("Malformed frame: Call needs inline buffers.")
            request = Frame(envelope.header, split_inline(envelope),
                            peer=peer_host(context.peer()))
        except errors.OpError as err:
            abort(context, err)
        return self._respond(self._handler(request))

    def _upload(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        connection = context.peer()
        peer = peer_host(connection)
        upload = self._uploads.open(messages, peer, connection)
        if upload is None:
            abort(context, errors.ResourceExhaustedError(
                f"Busy: it holds {self._uploads.limit} uploads open (max_concurrent_calls), "
                "none of which a new one may drop."), busy=True)
        try:
            self._admit(context)
            try:
                return self._respond(self._handler(self._received(upload, peer, context)))
            finally:
                self._streams.release()
        finally:
            self._uploads.close(upload)

    def _received(self, upload: Upload, peer: str, context: grpc.ServicerContext) -> Frame:
        """The frame an upload from ``peer`` carries, as its messages arrive (``uploads``)."""
        try:
            messages = upload.messages()
            first = next(messages, None)
            if first is None:
                raise errors.InvalidArgumentError("Malformed frame: empty upload.")
            envelope = framing.LAYOUT.decode(first, self._limit)
            return Frame(envelope.header, interleave(
                envelope.kinds, split_inline(envelope),
                framing.assemble(messages, bulk_lengths(envelope))), peer=peer)
        except errors.OpError as err:
            abort(context, err)

    def _fetch(self, message: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._admit(context)
        if not context.add_callback(self._streams.release):  # the call ended already
            self._streams.release()
        key = int.from_bytes(message[:8], "little") if len(message) == 8 else 0
        source = self._pending.take(key)
        if source is None:
            abort(context, errors.NotFoundError(
                f"No pending response {key}: it expired or was fetched already."))
        if not isinstance(source, Relay):
            yield from self._fetches.watch(
                context, framing.chunks(source, self._transport.chunk_bytes))
            return
        try:
            with source.open() as incoming:
                yield from self._fetches.watch(
                    context, (bytes(chunk) for chunk in incoming.chunks()))
        except errors.OpError as err:
            abort(context, errors.error_from_code(
                err.error_code, f"The task this response is forwarded from failed: {err.message}"))


class GrpcChannel(Channel):
    """A gRPC channel to one listener."""

    def __init__(self, transport: GrpcTransport, address: str, security: Security):
        split_host_port(address)
        self._transport = transport
        self._address = address
        self._security = security
        self._metadata = token_metadata(security)
        self._bulk = BulkClient(address)
        self._bulk_after = 0.0  # monotonic time from which the bulk port is tried again
        limit = _message_limit(transport.inline_bytes, transport.chunk_bytes)
        # Single-threaded unary streams: a fetch is read by the calling thread itself,
        # not through the channel's spin thread (which cost ~1 ms of CPU per MiB fetched).
        # A local subchannel pool: this channel's own connection, not one shared with every
        # channel of the process to the same address (whose slow link would slow them all).
        self._channel = open_channel(address, security, limit, [
            (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
            ("grpc.use_local_subchannel_pool", 1)])
        self._unary = self._channel.unary_unary(_CALL, _registered_method=True)
        self._upload = self._channel.stream_unary(_UPLOAD, _registered_method=True)
        self._fetch = self._channel.unary_stream(_FETCH, _registered_method=True)
        self._lane: LaneClient | None = None
        if transport.fast_lane:
            self._lane = LaneClient(address, self._lane_ticket, limit, security.tls)
            self._ticket_call = self._channel.unary_unary(_LANE, _registered_method=True)

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        envelope = framing.LAYOUT.decode(self._reply(frame, timeout), REPLY_LIMIT)
        if BULK not in envelope.kinds:
            return Frame(envelope.header, split_inline(envelope))
        with self._errors():
            return Frame(envelope.header, interleave(
                envelope.kinds, split_inline(envelope), self._fetched(envelope, deadline)))

    def _reply(self, frame: Frame, timeout: float | None) -> Any:
        """Send ``frame``; the reply message (an envelope whose bulk buffers, if any, are
        still to be fetched)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        views = framing.buffer_views(frame.buffers) if frame.buffers else []
        small = sum(map(len, views)) <= self._transport.inline_bytes
        if small and self._lane is not None:  # raises clusterwire errors itself
            reply = self._lane.call(framing.inline_parts(frame.header, views), deadline)
            if reply is not None:
                return reply
            if deadline is not None:  # over gRPC, in the time left
                timeout = max(deadline - time.monotonic(), 0.001)
        with self._errors():
            if small:
                reply = self._unary(framing.encode_inline(frame.header, views),
                                    timeout=timeout, metadata=self._metadata)
            else:
                first = framing.encode_bulk(frame.header, [v.nbytes for v in views])
                reply = self._streamed(lambda remaining: self._upload(
                    itertools.chain([first], framing.chunks(views, self._transport.chunk_bytes)),
                    timeout=remaining, metadata=self._metadata), deadline)
            return reply

    def _lane_ticket(self, timeout: float | None) -> bytes:
        """The listener's ``Lane`` reply; ``Unreachable`` (lasting unless the failure may
        pass) if it gave none."""
        try:
            return self._ticket_call(b"", timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            raise Unreachable(f"no lane ticket from {self._address}: {code}",
                              lasting=code not in _PASSING) from None

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """grpcio's exceptions as clusterwire errors."""
        try:
            yield
        except grpc.RpcError as err:
            raise grpc_error(err, self._address, self._security) from None
        except ValueError as err:  # grpc raises it for a closed channel
            raise errors.CancelledError(f"Channel to {self._address} is closed: {err}") from None

    def call_relayed(self, frame: Frame, timeout: float | None = None) -> Frame:
        """``call``, with a bulk response returned as a ``Relay`` (see ``relay``): fetched
        only when a listener of this transport sends it on, within ``timeout`` from then."""
        message = self._reply(frame, timeout)
        reply = framing.LAYOUT.decode(message, REPLY_LIMIT)
        if BULK not in reply.kinds:
            if type(message) is not bytes:  # a large lane reply, in a buffer of its own
                return Frame(reply.header, split_inline(reply))
            return Frame(reply.header, Verbatim(reply.header, split_inline(reply, copy=False),
                                                message))
        lengths = bulk_lengths(reply)
        budget = self._transport.fetch_ttl if timeout is None else timeout
        relay = Relay(lengths, lambda: self._incoming(reply, time.monotonic() + budget))
        return Frame(reply.header, [RelayPart(relay, index) for index in range(len(lengths))])

    def _incoming(self, envelope: Envelope, deadline: float) -> Incoming:
        """The announced response of ``envelope``, answered: from the bulk port, else a
        fetch stream."""
        return self._announced(
            envelope, lambda port, fetch_id, lengths: self._bulk.open_incoming(
                port, fetch_id, lengths, deadline, self._transport.chunk_bytes),
            lambda stream, lengths: _StreamIncoming(_started(stream), self._errors), deadline)

    def _fetched(self, envelope: Envelope, deadline: float | None) -> list:
        """The BULK buffers an envelope announced: from the bulk port, else a fetch stream."""
        return self._announced(
            envelope, lambda port, fetch_id, lengths: self._bulk.fetch(
                port, fetch_id, lengths, deadline),
            lambda stream, lengths: framing.assemble(iter(stream), lengths), deadline)

    def _announced(self, envelope: Envelope, from_port: Callable[[int, int, list[int]], _T],
                   from_stream: Callable[[Any, list[int]], _T], deadline: float | None) -> _T:
        """What ``envelope`` announced, read the one way chosen here: ``from_port(port,
        fetch id, lengths)`` from the bulk port unless it is backed off (or there is none),
        else ``from_stream(fetch stream, lengths)`` of a gRPC fetch call."""
        (bulk_port, fetch_id), lengths = envelope.fields, bulk_lengths(envelope)
        if bulk_port and time.monotonic() >= self._bulk_after:
            try:
                return from_port(bulk_port, fetch_id, lengths)
            except Unreachable as err:
                self._unreachable(err)
        ticket = fetch_id.to_bytes(8, "little")
        with self._errors():
            return self._streamed(lambda remaining: from_stream(
                self._fetch(ticket, timeout=remaining, metadata=self._metadata), lengths),
                deadline)

    def _unreachable(self, err: Unreachable) -> None:
        if err.lasting:
            _LOG.warning("Fetching over gRPC for %.0f s: %s", _BULK_RETRY_S, err)
            self._bulk_after = time.monotonic() + _BULK_RETRY_S

    def _streamed(self, start: Callable[[float | None], _T], deadline: float | None) -> _T:
        """``start(remaining seconds)`` of a streamed call, again (backing off, until the
        deadline) while the listener refuses it as busy, before reading any of it."""
        delay = STREAM_BUSY.start_s
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:
                return start(remaining)
            except grpc.RpcError as err:
                if not is_busy(err):
                    raise
                details = err.details() if hasattr(err, "details") else None
                if deadline is not None and deadline - time.monotonic() <= delay:
                    raise errors.DeadlineExceededError(
                        f"{self._address} had no thread free for a streamed request before "
                        f"the deadline: {details}") from None
            time.sleep(random.uniform(0.5, 1.0) * delay)
            delay = STREAM_BUSY.after(delay)

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        self._bulk.close()
        self._channel.close()


class GrpcTransport(Transport):
    """Frames over gRPC (HTTP/2), one process-wide instance."""

    protocol = "grpc"

    def __init__(self, options: Mapping[str, Any] | None = None):
        reader = OptionReader(self.protocol, options)
        self.inline_bytes = reader.positive("inline_bytes", 1 << 20, integer=True)
        self.chunk_bytes = reader.positive("chunk_bytes", 1 << 20, integer=True)
        self.fetch_ttl = reader.positive("fetch_ttl_seconds", 60)
        self.bulk_plane = reader.choice("bulk_plane", "tcp", _BULK_PLANES)
        self.bulk_bytes = reader.positive("bulk_bytes", 256 << 10, integer=True)
        self.fast_lane = reader.flag("fast_lane", False)
        reader.finish()
        if self.fast_lane and self.bulk_plane == "grpc":
            raise errors.InvalidArgumentError(
                "grpc option fast_lane = true needs bulk_plane = \"tcp\" (bulk_plane = "
                "\"grpc\" keeps every call on the gRPC port): drop one of the two.")

    def listen(self, address: str, handler: Handler, options: ListenOptions) -> Listener:
        return GrpcListener(self, address, handler, options)

    def connect(self, address: str, security: Security | None = None) -> Channel:
        return GrpcChannel(self, address, security or Security())

    def info(self) -> dict[str, str]:
        stream = f"grpc chunk stream ({self.chunk_bytes} B chunks)"
        if self.bulk_plane == "grpc":
            return {"control": "grpc", "data": stream}
        facts = {"control": "grpc", "data": f"tcp bulk port for responses; {stream} for "
                                            "uploads and under TLS"}
        if self.fast_lane:
            facts["small_calls"] = (f"tcp fast lane (requests up to {self.inline_bytes} B; "
                                    "inside TLS under TLS; grpc when the peer has none)")
        return facts


def _stream_slots(options: ListenOptions) -> int:
    """Threads for streamed calls: ``max_workers - small_call_reserve``, checked."""
    for name in ("handshake_timeout_seconds", "message_idle_timeout_seconds",
                 "max_pending_connections", "max_connections"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise errors.InvalidArgumentError(
                f"{name} must be a positive number, got {value!r}; set a positive {name} "
                "(or leave it out for the default).")
    slots = options.max_workers - options.small_call_reserve
    if options.small_call_reserve < 0 or slots < 1:
        raise errors.InvalidArgumentError(
            f"small_call_reserve ({options.small_call_reserve}) must be at least 0 and below "
            f"max_workers ({options.max_workers}), so streamed requests get a thread: lower "
            "small_call_reserve or raise max_workers.")
    return slots


class _StreamIncoming(Incoming):
    """A response being read from a gRPC fetch stream."""

    def __init__(self, messages: Iterator[bytes],
                 errors_of: Callable[[], contextlib.AbstractContextManager]):
        self._messages, self._errors_of = messages, errors_of

    def chunks(self) -> Iterator[bytes]:
        with self._errors_of():
            yield from self._messages

    def close(self) -> None:
        cancel = getattr(self._messages, "cancel", None)
        if cancel is not None:
            cancel()


def _started(messages: Iterator[bytes]) -> Iterator[bytes]:
    """``messages`` with the first one already received (so a refusal of the streamed call
    surfaces here, where ``_streamed`` retries it)."""
    messages = iter(messages)
    first = next(messages, None)
    return messages if first is None else itertools.chain([first], messages)
