"""Request plumbing of the data service over any transport.

* ``Endpoint``: a listener on a protocol from the plugin manager whose
  handler decodes ``DataRequest`` frames, counts in-flight requests (so a
  stop drains them, as the core server does) and turns every failure into an
  error response.
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
import time
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from clusterwire import errors
from clusterwire.addressing import join_host_port, split_host_port
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.data_service_pb2 import DataRequest, DataResponse
from clusterwire.rpc import RequestClient, jittered, raise_for_status
from clusterwire.service import error_response
from clusterwire.transport import Channel, Frame, ListenOptions

Handler = Callable[[DataRequest, list[Any]], tuple[DataResponse, Sequence[Any]]]
_RETRY_START, _RETRY_MAX = 0.02, 0.5


def parse(frame: Frame) -> DataResponse:
    """The OK DataResponse of ``frame``; the matching clusterwire error otherwise."""
    try:
        response = DataResponse.FromString(frame.header)
    except DecodeError as err:
        raise errors.InternalError(f"Peer sent a malformed response header: {err}") from None
    raise_for_status(response)
    return response


class Endpoint:
    """Serves DataRequests on ``protocol`` at ``host:port``; drains on stop."""

    def __init__(self, protocol: str, host: str, port: int, handler: Handler, name: str,
                 max_workers: int = 32):
        self._handler = handler
        self._name = name
        self._activity = threading.Condition()
        self._in_flight = 0
        self._draining = False
        transport = get_plugin_manager().transport(protocol)
        self._listener = transport.listen(join_host_port(host, port), self._handle,
                                          ListenOptions(max_workers=max_workers))
        self.port = split_host_port(self._listener.address)[1]

    def start(self) -> None:
        """Start serving (idempotent)."""
        self._listener.start()

    def stop(self, grace: float | None) -> None:
        """Refuse new requests, let in-flight ones finish for ``grace`` s, free the port."""
        with self._activity:
            self._draining = True
            self._activity.wait_for(lambda: self._in_flight == 0, timeout=grace or 0)
        self._listener.stop(0.5)

    def _handle(self, frame: Frame) -> Frame:
        with self._activity:
            if self._draining:
                return error_response(errors.UnavailableError(f"{self._name} is stopping."))
            self._in_flight += 1
        try:
            try:
                request = DataRequest.FromString(frame.header)
            except DecodeError as err:
                raise errors.InvalidArgumentError(f"Malformed request header: {err}") from None
            response, buffers = self._handler(request, list(frame.buffers))
            return Frame(response.SerializeToString(), list(buffers))
        except errors.OpError as err:
            return error_response(err)
        except Exception as err:  # a bug must not take the server down
            return error_response(errors.InternalError(f"{type(err).__name__}: {err}"))
        finally:
            with self._activity:
                self._in_flight -= 1
                self._activity.notify_all()


class DispatcherClient:
    """Idempotent requests to one dispatcher, retried while it is unavailable."""

    def __init__(self, protocol: str, address: str, timeout: float, call_timeout: float = 30.0):
        self.address = address
        self.timeout = timeout
        self._call_timeout = call_timeout
        self._client = RequestClient(protocol, timeout=call_timeout)
        self._closed = threading.Event()

    def call(self, request: DataRequest, buffers: Sequence[Any] = (),
             wait: float = 0.0) -> tuple[DataResponse, list[Any]]:
        """Send ``request`` (a long poll may take ``wait`` s); return response and buffers."""
        frame = Frame(request.SerializeToString(), list(buffers))
        method = request.WhichOneof("kind")
        deadline = time.monotonic() + self.timeout
        delay = _RETRY_START
        while True:
            try:
                reply = self._client.send_frame(
                    self.address, frame, f"data.{method}",
                    min(self._call_timeout + wait, max(deadline - time.monotonic(), 0.01)))
                response = parse(reply)
                return response, list(reply.buffers)
            except errors.UnavailableError as err:
                if self._closed.is_set() or time.monotonic() + delay >= deadline:
                    raise errors.UnavailableError(
                        f"tf.data service dispatcher at {self.address} is unavailable: "
                        f"{err.message}") from None
            if self._closed.wait(jittered(delay)):
                raise errors.CancelledError("The data service client was closed.")
            delay = min(delay * 2, _RETRY_MAX)

    def close(self) -> None:
        """Stop retrying and release the channel."""
        self._closed.set()
        self._client.close()


class WorkerChannels:
    """One channel per (protocol, address), shared by threads."""

    def __init__(self) -> None:
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
                    protocol).connect(address)
        reply = channel.call(Frame(request.SerializeToString(), []), timeout=timeout)
        return parse(reply), list(reply.buffers)

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
