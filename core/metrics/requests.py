"""A server's request counts, recorded by its listener shell (every server kind)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from clusterwire.metrics import catalog
from clusterwire.metrics.registry import Histogram, Sample


class RequestStats:
    """Requests by method and status, latencies, bytes: one server's, for its shell.

    ``record`` runs under ``lock``, the shell's own (already taken per request to count the
    requests in flight), so counting adds no lock of its own to a request.
    """

    def __init__(self, server: str, transport: str, lock: threading.Lock,
                 in_flight: Callable[[], int], serving: Callable[[], bool],
                 connections: Callable[[], int | None]):
        self.server, self.transport = server, transport
        self._lock = lock
        self._in_flight, self._serving, self._connections = in_flight, serving, connections
        self._requests: dict[tuple[str, str], int] = {}
        self._latency: dict[str, Histogram] = {}
        self._received = self._sent = 0

    def record(self, method: str, code: str, seconds: float, received: int,
               sent: int) -> None:
        """Count one request (the caller holds the shell's lock)."""
        key = (method, code)
        self._requests[key] = self._requests.get(key, 0) + 1
        latency = self._latency.get(method)
        if latency is None:
            latency = self._latency[method] = Histogram(catalog.REQUEST_SECONDS.buckets)
        latency.observe(seconds)
        self._received += received
        self._sent += sent

    def samples(self) -> Iterator[Sample]:
        """The server's samples (a registry source)."""
        server, transport = self.server, self.transport
        with self._lock:
            requests = dict(self._requests)
            latency = {method: h.copy() for method, h in self._latency.items()}
            received, sent, in_flight = self._received, self._sent, self._in_flight()
        for (method, code), count in sorted(requests.items()):
            yield Sample(catalog.REQUESTS, (server, method, code), count)
        for method, histogram in sorted(latency.items()):
            yield Sample(catalog.REQUEST_SECONDS, (server, method), histogram)
        yield Sample(catalog.RECEIVED_BYTES, (server, transport), received)
        yield Sample(catalog.SENT_BYTES, (server, transport), sent)
        yield Sample(catalog.IN_FLIGHT, (server,), in_flight)
        yield Sample(catalog.SERVING, (server,), 1 if self._serving() else 0)
        connections = self._connections()
        if connections is not None:
            yield Sample(catalog.CONNECTIONS, (server, transport), connections)


def frame_bytes(header: bytes, buffers) -> int:
    """Bytes of a frame: its header and buffers."""
    total = len(header)
    for buffer in buffers:
        total += buffer.nbytes if type(buffer) is memoryview else memoryview(buffer).nbytes
    return total
