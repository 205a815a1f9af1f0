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


class _LatencyCells(dict):
    """method -> [count per latency bucket (the last: +Inf)..., sum of seconds]."""

    def __missing__(self, method: str) -> list:
        cells = self[method] = [0] * (len(_BOUNDS) + 1) + [0.0]
        return cells


class _CodeCounts(dict):
    """method -> [count per status code]."""

    def __missing__(self, method: str) -> list:
        counts = self[method] = [0] * (max(CODE_NAMES) + 1)
        return counts


class RequestStats:
    """Requests by method and status, latencies, bytes: one server's, for its shell.

    Its methods run under ``lock``, the shell's own (already taken per request to count the
    requests in flight), so counting adds no lock of its own to a request. A request that
    came through the transport is timed (its method's histogram counts it) and its bytes
    counted; errors are counted beside the histogram by code, and the OK count is the
    difference. A request of a caller in this process crossed no transport and is only
    counted: timing the fastest path would cost a large part of it.
    """

    def __init__(self, server: str, transport: str, lock: threading.Lock,
                 in_flight: Callable[[], int], serving: Callable[[], bool],
                 connections: Callable[[], int | None]):
        self.server, self.transport = server, transport
        self._lock = lock
        self._in_flight, self._serving, self._connections = in_flight, serving, connections
        self._latency = _LatencyCells()
        self._errors = _CodeCounts()  # of the timed requests: OK is the histogram's rest
        #: Requests of callers in this process, method -> [count per status code]: the shell
        #: adds to it under its lock (a method call more would be a tenth of that path).
        self.in_process = _CodeCounts()
        self._received = self._sent = 0

    def record(self, method: str, code: int, seconds: float, request: Frame,
               response: Frame, _bisect=bisect_left, _bounds=_BOUNDS) -> None:
        """Count a request that came through the transport: its latency and bytes. It runs
        for every such request of every server: its helpers are bound as locals, its cells
        made on first use."""
        latency = self._latency[method]
        latency[_bisect(_bounds, seconds)] += 1
        latency[-1] += seconds
        if code:
            self._errors[method][code] += 1
        # A buffer is a buffer-protocol object, or stands for one and tells its nbytes (a
        # forwarded response relayed as it arrives).
        received = len(request.header)
        for buffer in request.buffers:
            received += buffer.nbytes if hasattr(buffer, "nbytes") else memoryview(buffer).nbytes
        sent = len(response.header)
        for buffer in response.buffers:
            sent += buffer.nbytes if hasattr(buffer, "nbytes") else memoryview(buffer).nbytes
        self._received += received
        self._sent += sent

    def samples(self) -> Iterator[Sample]:
        """The server's samples (a registry source)."""
        server, transport = self.server, self.transport
        with self._lock:
            latency = {method: list(cell) for method, cell in self._latency.items()}
            errors = {method: list(cell) for method, cell in self._errors.items()}
            local = {method: list(cell) for method, cell in self.in_process.items()}
            received, sent, in_flight = self._received, self._sent, self._in_flight()
        # Timed requests: OK is their count less their errors.
        counts = {(method, 0): sum(cell[:-1]) - sum(errors.get(method, ()))
                  for method, cell in latency.items()}
        for cells in (errors, local):
            for method, by_code in cells.items():
                for code, count in enumerate(by_code):
                    counts[method, code] = counts.get((method, code), 0) + count
        for (method, code), count in sorted(counts.items()):
            if count:
                yield Sample(catalog.REQUESTS, (server, method, CODE_NAMES[code]), count)
        for method, cell in sorted(latency.items()):
            histogram = Histogram(_BOUNDS)
            histogram.counts, histogram.sum = cell[:-1], cell[-1]
            yield Sample(catalog.REQUEST_SECONDS, (server, method), histogram)
        yield Sample(catalog.RECEIVED_BYTES, (server, transport), received)
        yield Sample(catalog.SENT_BYTES, (server, transport), sent)
        yield Sample(catalog.IN_FLIGHT, (server,), in_flight)
        yield Sample(catalog.SERVING, (server,), 1 if self._serving() else 0)
        connections = self._connections()
        if connections is not None:
            yield Sample(catalog.CONNECTIONS, (server, transport), connections)
