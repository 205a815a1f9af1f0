"""The registry in Prometheus' text format, through prometheus_client (imported only when
an endpoint serves: ``pip install 'clusterwire[metrics]'``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from clusterwire import errors
from clusterwire.metrics.registry import Histogram, Registry


def _prometheus_client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise errors.FailedPreconditionError(
            "A metrics endpoint needs prometheus_client: pip install 'clusterwire[metrics]' "
            "(or leave metrics_port unset).") from None
    return prometheus_client


class _Collector:
    """Turns the registry's samples into prometheus_client metric families at each scrape."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        by_metric: dict[Any, list] = defaultdict(list)
        for sample in self._registry.samples():
            by_metric[sample.metric].append(sample)
        for metric, samples in by_metric.items():
            labels = list(metric.labels)
            if metric.kind == "histogram":
                family = HistogramMetricFamily(metric.name, metric.help, labels=labels)
                for sample in samples:
                    family.add_metric(list(sample.labels), _cumulative(sample.value),
                                      sample.value.sum)
            else:
                kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
                family = kind(metric.name, metric.help, labels=labels)
                for sample in samples:
                    family.add_metric(list(sample.labels), sample.value)
            yield family


def _cumulative(histogram: Histogram) -> list[tuple[str, float]]:
    buckets, running = [], 0
    for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts, strict=True):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return buckets


class Exposition:
    """What ``/metrics`` answers: the registry's metrics and the process collector's
    (``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ...)."""

    def __init__(self, registry: Registry):
        client = _prometheus_client()
        self._generate = client.generate_latest
        self.content_type = client.CONTENT_TYPE_LATEST
        self._registry = client.CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(registry))
        client.ProcessCollector(registry=self._registry)
        client.PlatformCollector(registry=self._registry)

    def render(self) -> bytes:
        """The text format, now."""
        return self._generate(self._registry)
