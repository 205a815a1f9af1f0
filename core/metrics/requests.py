"""A server's request counts, recorded by its listener shell (every server kind)."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from time import perf_counter

from clusterwire.errors import CODE_NAMES
from clusterwire.metrics import catalog
from clusterwire.metrics.registry import Histogram, Sample
from clusterwire.transport import Frame

_BOUNDS = catalog.REQUEST_SECONDS.buckets
_CODES = max(CODE_NAMES) + 1  # a count per status code, indexed by the code


class _CodeCounts(dict):
    """method -> [count per status code]."""

    def __missing__(self, method: str) -> list:
        counts = self[method] = [0] * _CODES
        return counts


class PythonRequestCells:
    """The counts of the requests that came through the transport: per method a latency
    histogram and the errors by code, and the bytes in and out. ``_request_cells.c`` holds
    the same rules in C (``RequestCells``, used when built); this is the fallback."""

    def __init__(self, bounds: tuple[float, ...], codes: int):
        self._bounds, self._codes = tuple(bounds), codes
        self._latency: dict[str, list] = {}
        self._errors: dict[str, list] = {}
        self._received = self._sent = 0

    def record(self, method: str, code: int, started: float, request: Frame,
               response: Frame, _bisect=bisect_left) -> None:
        """Count one request: its latency (from ``started``, ``perf_counter()`` when it
        arrived, to now), its code when not OK, its frames' bytes."""
        seconds = perf_counter() - started
        received, sent = _frame_bytes(request), _frame_bytes(response)
        latency = self._latency.get(method)
        if latency is None:
            latency = self._latency[method] = [0] * (len(self._bounds) + 1) + [0.0]
            self._errors[method] = [0] * self._codes
        latency[_bisect(self._bounds, seconds)] += 1
        latency[-1] += seconds
        if code:
            self._errors[method][code] += 1
        self._received += received
        self._sent += sent

    def snapshot(self) -> tuple[dict[str, list], dict[str, list[int]], int, int]:
        """(method -> [count per bucket (the last: +Inf)..., sum of seconds],
        method -> [count per status code], bytes received, bytes sent)."""
        return ({method: list(cells) for method, cells in self._latency.items()},
                {method: list(counts) for method, counts in self._errors.items()},
                self._received, self._sent)


def _frame_bytes(frame: Frame) -> int:
    """A frame's header and buffers: each a buffer-protocol object, or one that stands for
    one and tells its nbytes (a forwarded response relayed as it arrives)."""
    total = len(frame.header)
    for buffer in frame.buffers:
        total += buffer.nbytes if hasattr(buffer, "nbytes") else memoryview(buffer).nbytes
    return total


try:
    from clusterwire.metrics._request_cells import RequestCells
except ImportError:  # not built (no C compiler at install)
    RequestCells = PythonRequestCells


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
        self._cells = RequestCells(_BOUNDS, _CODES)
        self._started = time.time()
        #: ``record(method, code, started, request, response)``: count a request that came
        #: through the transport (see ``PythonRequestCells``); it runs for every such request.
        self.record = self._cells.record
        #: Requests of callers in this process, method -> [count per status code]: the shell
        #: adds to it under its lock (a method call more would be a tenth of that path).
        self.in_process = _CodeCounts()

    def samples(self) -> Iterator[Sample]:
        """The server's samples (a registry source)."""
        server, transport = self.server, self.transport
        with self._lock:
            latency, errors, received, sent = self._cells.snapshot()
            local = {method: list(cell) for method, cell in self.in_process.items()}
            in_flight = self._in_flight()
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
        yield Sample(catalog.START_TIME, (server,), self._started)
        connections = self._connections()
        if connections is not None:
            yield Sample(catalog.CONNECTIONS, (server, transport), connections)
