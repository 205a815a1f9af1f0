"""A server's request counts, recorded by its listener shell (every server kind)."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator

from clusterwire.errors import CODE_NAMES
from clusterwire.metrics import catalog
from clusterwire.metrics.registry import Histogram, Sample
from clusterwire.transport import Frame

_BOUNDS = catalog.REQUEST_SECONDS.buckets


class RequestStats:
    """Requests by method and status, latencies, bytes: one server's, for its shell.

    ``record`` runs under ``lock``, the shell's own (already taken per request to count the
    requests in flight), so counting adds no lock of its own to a request. A method's
    latency histogram counts all its requests; errors are counted beside it by code, and
    the OK count is the difference (one dictionary update less on the common path).
    """

    def __init__(self, server: str, transport: str, lock: threading.Lock,
                 in_flight: Callable[[], int], serving: Callable[[], bool],
                 connections: Callable[[], int | None]):
        self.server, self.transport = server, transport
        self._lock = lock
        self._in_flight, self._serving, self._connections = in_flight, serving, connections
        # method -> [count per latency bucket (the last: +Inf)..., sum of seconds]
        self._latency: dict[str, list] = {}
        self._errors: dict[tuple[str, int], int] = {}  # (method, code) -> count
        self._received = self._sent = 0

    def record(self, method: str, code: int, seconds: float, request: Frame | None,
               response: Frame | None) -> None:
        """Count one request (the caller holds the shell's lock); its bytes if it came
        through the transport (``request`` and ``response`` given). Inlined: it runs for
        every request of every server."""
        if request is not None:  # it crossed the transport
            # A buffer is a buffer-protocol object, or stands for one and tells its nbytes
            # (a forwarded response relayed as it arrives).
            received = len(request.header)
            for buffer in request.buffers:
                received += (buffer.nbytes if hasattr(buffer, "nbytes")
                             else memoryview(buffer).nbytes)
            sent = len(response.header)
            for buffer in response.buffers:
                sent += buffer.nbytes if hasattr(buffer, "nbytes") else memoryview(buffer).nbytes
            self._received += received
            self._sent += sent
        latency = self._latency.get(method)
        if latency is None:
            latency = self._latency[method] = [0] * (len(_BOUNDS) + 1) + [0.0]
        latency[bisect_left(_BOUNDS, seconds)] += 1
        latency[-1] += seconds
        if code:
            key = (method, code)
            self._errors[key] = self._errors.get(key, 0) + 1

    def samples(self) -> Iterator[Sample]:
        """The server's samples (a registry source)."""
        server, transport = self.server, self.transport
        with self._lock:
            latency = {method: list(cell) for method, cell in self._latency.items()}
            errors = dict(self._errors)
            received, sent, in_flight = self._received, self._sent, self._in_flight()
        for method, cell in sorted(latency.items()):
            histogram = Histogram(_BOUNDS)
            histogram.counts, histogram.sum = cell[:-1], cell[-1]
            failed = {code: n for (m, code), n in errors.items() if m == method}
            for code, count in sorted({0: histogram.count - sum(failed.values()),
                                       **failed}.items()):
                if count:
                    yield Sample(catalog.REQUESTS, (server, method, CODE_NAMES[code]), count)
            yield Sample(catalog.REQUEST_SECONDS, (server, method), histogram)
        yield Sample(catalog.RECEIVED_BYTES, (server, transport), received)
        yield Sample(catalog.SENT_BYTES, (server, transport), sent)
        yield Sample(catalog.IN_FLIGHT, (server,), in_flight)
        yield Sample(catalog.SERVING, (server,), 1 if self._serving() else 0)
        connections = self._connections()
        if connections is not None:
            yield Sample(catalog.CONNECTIONS, (server, transport), connections)
