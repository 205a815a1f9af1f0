"""Request plumbing of the data service over any transport.

* ``serve``: the core listener shell (authentication, limits, admission,
  drain, error mapping: ``clusterwire.shell``) with a handler of
  ``DataRequest`` frames.
* ``DispatcherClient``: calls to the dispatcher through the core
  ``RequestClient`` (channel reuse, backoff on connection failures), retried
  while the dispatcher is unavailable -- every dispatcher request is
  idempotent -- for up to ``dispatcher_timeout`` (so a restarting dispatcher
  is waited for).
* ``WorkerChannels``: direct channels to workers for element reads; the
  caller decides about failures (a dead worker's split moves elsewhere).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from clusterwire import errors
from clusterwire.addressing import join_host_port
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.data_service_pb2 import DataRequest, DataResponse
from clusterwire.rpc import RequestClient, raise_for_status
from clusterwire.security import Security
from clusterwire.shell import Shell, warn_if_exposed
from clusterwire.transport import Channel, Frame, ListenOptions

#: A request, its buffers and the peer that sent it (``Frame.peer``) -> the response.
Handler = Callable[[DataRequest, list[Any], str], tuple[DataResponse, Sequence[Any]]]


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
        return Frame(response.SerializeToString(), list(buffers))

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
    """Requests to one dispatcher: all idempotent, so retried while it is unavailable."""

    def __init__(self, protocol: str, address: str, timeout: float, security: Security,
                 call_timeout: float = 30.0):
        self.address = address
        self.timeout = timeout
        self.security = security
        self._call_timeout = call_timeout
        self._client = RequestClient(protocol, timeout=timeout, security=security,
                                     peer="tf.data service dispatcher")

    def call(self, request: DataRequest, buffers: Sequence[Any] = (), retry: bool = True
             ) -> tuple[DataResponse, list[Any]]:
        """Send ``request``; return the response and its buffers. Without ``retry``, an
        unreachable dispatcher is an UnavailableError at once."""
        reply = self._client.send_frame(
            self.address, Frame(request.SerializeToString(), list(buffers)),
            f"data.{request.WhichOneof('kind')}", idempotent=True,
            attempt_timeout=self._call_timeout, retry=retry)
        return parse(reply), list(reply.buffers)

    def close(self) -> None:
        """Stop retrying and release the channel."""
        self._client.close()


class WorkerChannels:
    """One channel per (protocol, address), shared by threads."""

    def __init__(self, security: Security) -> None:
        self._security = security
        self._channels: dict[tuple[str, str], Channel] = {}
        self._lock = threading.Lock()

    def call(self, protocol: str, address: str, request: DataRequest,
             timeout: float) -> tuple[DataResponse, list[Any]]:
        """One request to a worker, no retries."""
        key = (protocol, address)
        with self._lock:
            channel = self._channels.get(key)
            if channel is None:
                channel = self._channels[key] = get_plugin_manager().transport(
                    protocol).connect(address, self._security)
        reply = channel.call(Frame(request.SerializeToString(), []), timeout=timeout)
        return parse(reply), list(reply.buffers)

    def close_channel(self, protocol: str, address: str) -> None:
        """Close the channel to ``address`` if open: its calls in flight end with
        CancelledError; a later call connects anew."""
        with self._lock:
            channel = self._channels.pop((protocol, address), None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
