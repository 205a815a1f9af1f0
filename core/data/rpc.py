"""Request plumbing of the data service over any transport.

* ``serve``: the core listener shell (authentication, limits, admission,
  drain, error mapping: ``clusterwire.shell``) with a handler of
  ``DataRequest`` frames.
* ``DispatcherClient``: calls to the dispatcher through the core
  ``RequestClient`` (channel reuse, backoff on connection failures), retried
  while the dispatcher is unavailable -- every dispatcher request is
  idempotent -- for up to ``dispatcher_timeout`` (so a restarting dispatcher
  is waited for). Given a primary and its standbys (``"H1:P1,H2:P2"``), it
  follows the one that serves.
* ``WorkerChannels``: element reads from workers through the same ``RequestClient``,
  one attempt each; the caller decides about failures (a dead worker's split moves
  elsewhere).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from clusterwire import errors
from clusterwire.addressing import join_host_port
from clusterwire.backoff import DISPATCHER_FAILOVER, jittered
from clusterwire.data.addresses import dispatcher_addresses
from clusterwire.durations import format_duration
from clusterwire.protos.data_service_pb2 import DataRequest, DataResponse
from clusterwire.rpc import RequestClient, raise_for_status
from clusterwire.security import Security
from clusterwire.shell import Shell, warn_if_exposed
from clusterwire.transport import Frame, ListenOptions

log = logging.getLogger("clusterwire")

#: A request, its buffers and the peer that sent it (``Frame.peer``) -> the response, or
#: its serialized bytes (a reply made once and sent many times).
Handler = Callable[[DataRequest, list[Any], str], tuple[DataResponse | bytes, Sequence[Any]]]


def parse(frame: Frame) -> DataResponse:
    """The OK DataResponse of ``frame``; the matching clusterwire error otherwise."""
    try:
        response = DataResponse.FromString(frame.header)
    except DecodeError as err:
        raise errors.InternalError(f"Peer sent a malformed response header: {err}") from None
    raise_for_status(response)
    return response


def serve(protocol: str, host: str, port: int, handler: Handler, name: str,
          options: ListenOptions, send_tracebacks: bool = False) -> Shell:
    """A core listener shell serving DataRequests at ``host:port`` (not started yet).

    Its metrics name a request's method by the request's kind ("get_elements", ...;
    "unknown" for a malformed header).
    """
    # The shell names a request that came through the transport on the thread that handled
    # it, right after: the kind parsed there is remembered with its header, so such a
    # request is parsed once.
    parsed = threading.local()

    def handle(frame: Frame) -> Frame:
        try:
            request = DataRequest.FromString(frame.header)
        except DecodeError as err:
            raise errors.InvalidArgumentError(f"Malformed request header: {err}") from None
        parsed.last = (frame.header, request.WhichOneof("kind"))
        response, buffers = handler(request, list(frame.buffers), frame.peer)
        header = response if isinstance(response, bytes) else response.SerializeToString()
        return Frame(header, list(buffers))

    def method_of(frame: Frame) -> str:
        last, parsed.last = getattr(parsed, "last", None), None
        if last is not None and last[0] is frame.header:
            return last[1] or "unknown"
        try:  # refused before the handler saw it, or an in-process caller's (named first)
            return DataRequest.FromString(frame.header).WhichOneof("kind") or "unknown"
        except DecodeError:
            return "unknown"

    shell = Shell(protocol, join_host_port(host, port), handle, name, options,
                  send_tracebacks=send_tracebacks, method_of=method_of)
    warn_if_exposed(host, options, name)
    return shell


class DispatcherClient:
    """Requests to a dispatcher: all idempotent, so retried while it is unavailable.

    ``address`` is ``host:port`` or a primary's and its standbys' (``"H1:P1,H2:P2"``,
    ``clusterwire.data.addresses``). With a list, requests go to the one that answered last
    (``address``); when it is unavailable (unreachable, or a standby not serving yet) the
    next is tried at once, and after a round in which none answered, again after a short
    backoff, all within ``timeout``.
    """

    def __init__(self, protocol: str, address: str, timeout: float, security: Security,
                 call_timeout: float = 30.0):
        self.addresses = dispatcher_addresses(address)
        self._current = 0
        self.timeout = timeout
        self.security = security
        self._call_timeout = call_timeout
        self._closed = threading.Event()
        self._client = RequestClient(protocol, timeout=timeout, security=security,
                                     peer="tf.data service dispatcher")

    @property
    def address(self) -> str:
        """The dispatcher address that answered last (at first, the list's first)."""
        return self.addresses[self._current]

    def call(self, request: DataRequest, buffers: Sequence[Any] = (), retry: bool = True
             ) -> tuple[DataResponse, list[Any]]:
        """Send ``request``; return the response and its buffers. Without ``retry``, an
        unreachable dispatcher (every one of a list) is an UnavailableError at once."""
        frame = Frame(request.SerializeToString(), list(buffers))
        method = f"data.{request.WhichOneof('kind')}"
        if len(self.addresses) == 1:
            reply = self._client.send_frame(self.address, frame, method, idempotent=True,
                                            attempt_timeout=self._call_timeout, retry=retry)
            return parse(reply), list(reply.buffers)
        return self._fail_over(frame, method, retry)

    def _fail_over(self, frame: Frame, method: str, retry: bool
                   ) -> tuple[DataResponse, list[Any]]:
        deadline = time.monotonic() + self.timeout
        delay = DISPATCHER_FAILOVER.start_s
        while True:
            first, errors_seen = self._current, []
            for step in range(len(self.addresses)):
                index = (first + step) % len(self.addresses)
                try:
                    reply = self._client.send_frame(
                        self.addresses[index], frame, method,
                        timeout=max(deadline - time.monotonic(), 0.001), idempotent=True,
                        attempt_timeout=self._call_timeout, retry=False)
                    response = parse(reply)
                except errors.UnavailableError as err:  # unreachable, or a standby
                    errors_seen.append(f"{self.addresses[index]}: {err.message}")
                    continue
                except errors.DeadlineExceededError as err:
                    if time.monotonic() < deadline:
                        raise
                    # The window ended during this attempt (on a loaded machine, with
                    # little of it left): no answer, as an unreachable one.
                    errors_seen.append(f"{self.addresses[index]}: {err.message}")
                    continue
                if index != self._current:
                    log.warning("clusterwire: the tf.data service dispatcher at %s serves "
                                "(was: %s).", self.addresses[index], self.address)
                    self._current = index
                return response, list(reply.buffers)
            remaining = deadline - time.monotonic()
            if not retry or remaining <= 0:
                within = f" within {format_duration(self.timeout)}" if retry else ""
                raise errors.UnavailableError(
                    f"None of the tf.data service dispatchers {','.join(self.addresses)} "
                    f"({self._client.protocol}) serves{within}; last: "
                    + " | ".join(errors_seen))
            if self._closed.wait(min(jittered(delay), remaining)):
                raise errors.CancelledError("This client was closed.")
            delay = DISPATCHER_FAILOVER.after(delay)

    def close(self) -> None:
        """Stop retrying and release the channels."""
        self._closed.set()
        self._client.close()


#: Channels a consumer keeps open to workers, per protocol: it reads from every worker of
#: its job in turn, so fewer than the job's workers would close and reopen them on every
#: round (least recently used closed first beyond this).
WORKER_CHANNELS = 4096


class WorkerChannels:
    """Element reads and stream releases to workers, through the core ``RequestClient``
    (one per protocol: a worker may serve its elements over a data-transfer protocol of its
    own), so the channel choice, the deadline and the error mapping are the client's. Elements
    always travel through the worker's transport, also from a worker of this process: its
    transfer paths (bulk port, shared segments, verbs) and its metrics count them as sent.

    No retries here: the caller decides what a failed worker means (a read is repeated
    with the same sequence number, or its split moves to another worker).
    """

    def __init__(self, security: Security) -> None:
        self._security = security
        self._clients: dict[str, RequestClient] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _client(self, protocol: str) -> RequestClient:
        client = self._clients.get(protocol)
        if client is None:
            with self._lock:
                if self._closed:
                    raise errors.CancelledError("The worker channels were closed.")
                client = self._clients.get(protocol)
                if client is None:
                    client = self._clients[protocol] = RequestClient(
                        protocol, security=self._security, in_process=False,
                        peer="tf.data service worker", max_channels=WORKER_CHANNELS)
        return client

    def call(self, protocol: str, address: str, request: DataRequest,
             timeout: float) -> tuple[DataResponse, list[Any]]:
        """One request to a worker, no retries: the OK response and its buffers, or the
        clusterwire error it stands for (UnavailableError naming the worker if unreachable,
        DeadlineExceededError after ``timeout`` s)."""
        reply = self._client(protocol).send_frame(
            address, Frame(request.SerializeToString(), []),
            f"data.{request.WhichOneof('kind')}", timeout, retry=False)
        return parse(reply), list(reply.buffers)

    def close_channel(self, protocol: str, address: str) -> None:
        """Close the channel to ``address`` if open: its calls in flight end with
        CancelledError; a later call connects anew."""
        client = self._clients.get(protocol)
        if client is not None:
            client.drop(address)

    def close(self) -> None:
        """Close every channel; later calls end with CancelledError."""
        with self._lock:
            self._closed = True
            clients = list(self._clients.values())
        for client in clients:
            client.close()
