"""What this process has counted: metric families and the sources that report them.

Recording is plain Python arithmetic under a lock the recorder already holds or a family's
own; nothing of prometheus_client runs until something asks for the text format. A
process records unless ``CLUSTERWIRE_METRICS=0`` is set in its environment (what the
overhead benchmark compares against).
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from clusterwire.metrics.catalog import CATALOG, Metric

#: ``CLUSTERWIRE_METRICS=0`` turns recording off in a process (read once, at import).
ENABLED = os.environ.get("CLUSTERWIRE_METRICS", "1") != "0"


class Histogram:
    """One histogram series: counts per bucket (the last is +Inf) and the sum observed."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` (the caller holds the series' lock)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Values observed."""
        return sum(self.counts)

    def add(self, other: Histogram) -> None:
        """Count what ``other`` counted too (same bounds)."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum += other.sum

    def copy(self) -> Histogram:
        """A snapshot."""
        other = Histogram(self.bounds)
        other.counts, other.sum = list(self.counts), self.sum
        return other


Value = float | Histogram


@dataclass(frozen=True)
class Sample:
    """One series' value: ``labels`` are the values of ``metric.labels``, in order."""

    metric: Metric
    labels: tuple[str, ...]
    value: Value


class Family:
    """The series of one metric in this process, keyed by label values; thread-safe."""

    def __init__(self, metric: Metric):
        self.metric = metric
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], list[float] | Histogram] = {}

    def _cell(self, labels: tuple[str, ...]) -> list[float] | Histogram:
        cell = self._series.get(labels)
        if cell is None:
            if len(labels) != len(self.metric.labels):
                raise ValueError(f"{self.metric.name} takes labels {self.metric.labels}, "
                                 f"got {labels!r}")
            cell = self._series[labels] = (Histogram(self.metric.buckets)
                                           if self.metric.kind == "histogram" else [0.0])
        return cell

    def inc(self, *labels: str, amount: float = 1) -> None:
        """Add ``amount`` to a counter or gauge series."""
        with self._lock:
            self._cell(labels)[0] += amount

    def observe(self, *labels: str, value: float) -> None:
        """Count ``value`` in a histogram series."""
        with self._lock:
            self._cell(labels).observe(value)

    def remove(self, **match: str) -> None:
        """Drop the series whose labels have the values of ``match`` (a stopped server's,
        a collected job's), so label sets stay bounded."""
        positions = {self.metric.labels.index(k): v for k, v in match.items()}
        with self._lock:
            for labels in [k for k in self._series
                           if all(k[i] == v for i, v in positions.items())]:
                del self._series[labels]

    def samples(self) -> list[Sample]:
        """A snapshot of every series."""
        with self._lock:
            return [Sample(self.metric, labels,
                           cell.copy() if isinstance(cell, Histogram) else cell[0])
                    for labels, cell in self._series.items()]


Source = Callable[[], Iterable[Sample]]


class Registry:
    """The process's families (one per catalog metric) and its sources: callables that
    report samples when asked (a server's request counts, a store's size)."""

    def __init__(self, catalog: Iterable[Metric] = CATALOG):
        self._families = {metric.name: Family(metric) for metric in catalog}
        self._sources: dict[int, Source] = {}
        self._lock = threading.Lock()

    def family(self, metric: Metric) -> Family:
        """The family of a catalog metric."""
        return self._families[metric.name]

    def add_source(self, source: Source) -> Callable[[], None]:
        """Report ``source``'s samples from now on; returns what stops it."""
        key = id(source)
        with self._lock:
            self._sources[key] = source

        def remove() -> None:
            with self._lock:
                self._sources.pop(key, None)

        return remove

    def samples(self, server: str | None = None) -> list[Sample]:
        """Every sample of the process, or only those labelled with ``server``."""
        with self._lock:
            sources = list(self._sources.values())
        found: Iterator[Sample] = (sample for source in
                                   [*(f.samples for f in self._families.values()), *sources]
                                   for sample in source())
        if server is None:
            return list(found)
        return [s for s in found
                if "server" in s.metric.labels
                and s.labels[s.metric.labels.index("server")] == server]


#: The process's registry.
REGISTRY = Registry()
