"""The standard gRPC health service (``grpc.health.v1.Health``) of a control server, with
the same limits as any connection that has not shown the cluster token.

A probe carries no token, so health calls are answered without one; what bounds them:

* Only the names the server serves are answered: ``""`` and its own service names. Any other
  name is NOT_FOUND at once, for ``Check`` and ``Watch`` alike, and nothing is kept for it
  (``grpc_health``'s servicer keeps an entry for every name ever watched). A request longer
  than the longest served name's request is NOT_FOUND unparsed, but only once received whole:
  grpcio has no receive limit for one service's methods below the listener's (a server
  ignores per-method service config), so the listener's largest message is its bound.
* A request is read on the service's own few threads (never the server's workers), and one
  that has not arrived ``handshake_timeout_seconds`` after its call was taken is cancelled.
* A ``Watch`` without the token is pending, as an unauthenticated connection is
  (``clusterwire.pending``): it ends ``handshake_timeout_seconds`` after it began
  (DEADLINE_EXCEEDED), and at most ``max_pending_connections`` are open, a new one ending the
  oldest of the peer (IP address) holding the most (RESOURCE_EXHAUSTED). A ``Watch`` that
  presents the token lasts until the server stops. Watches are answered without a thread
  (grpcio's non-blocking streams). A call without the token also leaves its connection
  pending at the server's ``Door``, which closes it first when room is needed.

A peer without the token learns SERVING or NOT_SERVING, and which names are served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from clusterwire import errors
from clusterwire.pending import PendingConnections
from clusterwire.transport import ListenOptions
from clusterwire.transports._grpc_common.client import TOKEN_METADATA
from clusterwire.transports._grpc_common.door import Door

#: The health service's full name (its methods are ``/grpc.health.v1.Health/...``).
SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: Threads that read health requests (beside the server's workers, which they never take).
_THREADS = 2

_Send = Callable[[health_pb2.HealthCheckResponse | None], None]


class _Watch:
    """An open Watch stream: the callback that sends its responses (None ends it)."""

    __slots__ = ("context", "name", "send")

    def __init__(self, context: grpc.ServicerContext, name: str, send: _Send):
        self.context, self.name, self.send = context, name, send


class HealthService:
    """The health service of one control server serving ``served`` (service names)."""

    def __init__(self, served: Iterable[str], limits: ListenOptions, name: str,
                 door: Door | None = None):
        self._security = limits.security
        self._door = door
        self._timeout = limits.handshake_timeout_seconds
        self._started, self._ready = False, True
        self._status = dict.fromkeys(("", *served), NOT_SERVING)
        self._max_request = max(
            health_pb2.HealthCheckRequest(service=s).ByteSize() for s in self._status)
        self._watches: dict[str, set[_Watch]] = {s: set() for s in self._status}
        self._tokenless: PendingConnections[_Watch] = PendingConnections(
            limits.max_pending_connections, self._timeout)
        self._reads: dict[grpc.ServicerContext, float] = {}  # requests awaited: deadlines
        self._max_tokenless_calls = limits.max_pending_connections
        self._tokenless_calls = 0  # admitted by admit_tokenless, their handler not done
        self._draining = self._closed = False
        self._lock = threading.Condition()
        self._sending = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(_THREADS, f"clusterwire-{name}-health")
        self._reaper = threading.Thread(target=self._reap, daemon=True,
                                        name=f"clusterwire-{name}-health")

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's method handlers (for ``add_registered_method_handlers``).

        Both take the request as a stream, so grpcio reads nothing of it before the handler
        runs (on this service's threads) and can bound the wait."""
        serialize = health_pb2.HealthCheckResponse.SerializeToString

        def check(requests: Iterator[bytes], context: grpc.ServicerContext):
            authenticated = self._authenticated(context)  # the door is told before the read
            try:
                return health_pb2.HealthCheckResponse(
                    status=self._asked(requests, context)[1])
            finally:
                self._handled(authenticated)

        def watch(requests: Iterator[bytes], context: grpc.ServicerContext, send: _Send):
            authenticated = self._authenticated(context)
            try:
                self._watch(requests, context, send, authenticated)
            finally:
                self._handled(authenticated)

        for behavior in (check, watch):
            behavior.experimental_thread_pool = self._pool
        watch.experimental_non_blocking = True
        return {"Check": grpc.stream_unary_rpc_method_handler(
                    check, response_serializer=serialize),
                "Watch": grpc.stream_stream_rpc_method_handler(
                    watch, response_serializer=serialize)}

    def start(self) -> None:
        """Report SERVING for every served name (NOT_SERVING while not ``ready``)."""
        self._reaper.start()
        self._started = True
        self._set(SERVING if self._ready else NOT_SERVING)

    def ready(self, ready: bool) -> None:
        """Report SERVING (once started) or NOT_SERVING, until ``drain``."""
        self._ready = ready
        if self._started:
            self._set(SERVING if ready else NOT_SERVING)

    def drain(self) -> None:
        """Report NOT_SERVING from now on."""
        self._set(NOT_SERVING, last=True)

    def close(self) -> None:
        """End every watch and the service's threads (the server has stopped)."""
        with self._lock:
            self._closed = True
            ended = [w for watches in self._watches.values() for w in watches]
            for watch in ended:
                self._watches[watch.name].discard(watch)
                self._tokenless.discard(watch)
            self._lock.notify_all()
        for watch in ended:
            _end(watch, grpc.StatusCode.UNAVAILABLE, "The server stopped.")
        self._pool.shutdown(wait=False)

    # Responses are sent outside ``_lock``: grpcio's send waits for the server's thread,
    # which takes ``_lock`` when a watch ends. ``_sending`` keeps changes in order.
    def _set(self, status: int, last: bool = False) -> None:
        with self._sending:
            with self._lock:
                if self._draining:
                    return
                self._draining = last
                for name in self._status:
                    self._status[name] = status
                watches = [w for named in self._watches.values() for w in named]
            for watch in watches:
                watch.send(health_pb2.HealthCheckResponse(status=status))

    def _asked(self, requests: Iterator[bytes],
               context: grpc.ServicerContext) -> tuple[str, int]:
        """The name ``requests`` asks for and its status; aborts NOT_FOUND for another
        name, CANCELLED if the request has not arrived within the handshake timeout."""
        with self._lock:
            self._reads[context] = time.monotonic() + self._timeout
            self._lock.notify_all()
        try:
            request = next(requests, None)
        except grpc.RpcError:  # cancelled: the client left, or its request never came
            request = None
            context.abort(grpc.StatusCode.CANCELLED, "The health request did not arrive.")
        finally:
            with self._lock:
                self._reads.pop(context, None)
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "A health call needs a request.")
        if len(request) > self._max_request:
            context.abort(grpc.StatusCode.NOT_FOUND, "Unknown service.")
        try:
            name = health_pb2.HealthCheckRequest.FromString(request).service
        except DecodeError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "A malformed health request.")
        status = self._status.get(name)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "Unknown service.")
        return name, status

    def admit_tokenless(self) -> bool:
        """Whether a health call without the token may be taken now (the token gate asks,
        on gRPC's serving thread): at most ``max_pending_connections`` are read or
        registered at once, so a flood of streams waits in no queue."""
        with self._lock:
            if self._tokenless_calls >= self._max_tokenless_calls:
                return False
            self._tokenless_calls += 1
            return True

    def _handled(self, authenticated: bool) -> None:
        """A health call's handler is done (with a token gate, a tokenless one was admitted)."""
        if not authenticated and self._door:
            with self._lock:
                self._tokenless_calls -= 1

    def _watch(self, requests: Iterator[bytes], context: grpc.ServicerContext,
               send: _Send, authenticated: bool) -> None:
        name, _ = self._asked(requests, context)
        watch = _Watch(context, name, send)
        evicted = None
        with self._sending:
            with self._lock:
                if self._closed:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "The server stopped.")
                status = self._status[name]
                # False if the call ended already; else ``_forget`` runs when it ends.
                if not context.add_callback(lambda: self._forget(watch)):
                    return
                self._watches[name].add(watch)
                if not authenticated:
                    evicted = self._tokenless.add(watch, _peer(context), time.monotonic())
                    if evicted is not None:
                        self._watches[evicted.name].discard(evicted)
                    self._lock.notify_all()
            send(health_pb2.HealthCheckResponse(status=status))
        if evicted is not None:
            _end(evicted, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 "Too many health watches without the cluster token: the oldest ends. "
                 "Present the token to watch for longer.")

    def _authenticated(self, context: grpc.ServicerContext) -> bool:
        """Whether the call shows the token (its connection's door is told)."""
        presented = next((v for k, v in context.invocation_metadata() if k == TOKEN_METADATA),
                         None)
        try:
            self._security.check_token(presented)
        except errors.UnauthenticatedError:
            if self._door:
                self._door.refused(context.peer())
            return False
        if self._door:
            self._door.admit(context)
        return True

    def _forget(self, watch: _Watch) -> None:
        with self._lock:
            self._watches[watch.name].discard(watch)
            self._tokenless.discard(watch)

    def _reap(self) -> None:
        """End tokenless watches at their deadline; cancel requests that never came."""
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                expired = self._tokenless.expire(now)
                for watch in expired:
                    self._watches[watch.name].discard(watch)
                late = [context for context, deadline in self._reads.items()
                        if deadline <= now]
                for context in late:
                    del self._reads[context]
                if not (expired or late):
                    deadlines = [*self._reads.values()]
                    if (pending := self._tokenless.next_deadline()) is not None:
                        deadlines.append(pending)
                    self._lock.wait(min(deadlines) - now if deadlines else None)
                    continue
            for watch in expired:
                _end(watch, grpc.StatusCode.DEADLINE_EXCEEDED,
                     f"A health watch without the cluster token ends after "
                     f"handshake_timeout_seconds ({self._timeout:g} s). Present the token "
                     "to watch for longer.")
            for context in late:
                context.cancel()


def _peer(context: grpc.ServicerContext) -> str:
    """The peer's address without its port ("ipv4:10.0.0.1"): what the limits count."""
    return context.peer().rsplit(":", 1)[0]


def _end(watch: _Watch, code: grpc.StatusCode, details: str) -> None:
    """End ``watch`` with ``code`` (a no-op if its call has ended already)."""
    watch.context.set_code(code)
    watch.context.set_details(details)
    watch.send(None)
