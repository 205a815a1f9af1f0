"""Samples as ``MetricSample`` messages: how a server reports its metrics in its status
(what ``clusterwire top`` reads), without Prometheus."""

from __future__ import annotations

from collections.abc import Iterable

from clusterwire.metrics.registry import Histogram, Sample
from clusterwire.protos.service_pb2 import MetricSample


def to_protos(samples: Iterable[Sample]) -> list[MetricSample]:
    """One message per counter or gauge sample; ``NAME_count`` and ``NAME_sum`` per
    histogram."""
    protos = []
    for sample in samples:
        labels = dict(zip(sample.metric.labels, sample.labels, strict=True))
        name, value = sample.metric.name, sample.value
        if isinstance(value, Histogram):
            protos.append(MetricSample(name=f"{name}_count", labels=labels, value=value.count))
            protos.append(MetricSample(name=f"{name}_sum", labels=labels, value=value.sum))
        else:
            protos.append(MetricSample(name=name, labels=labels, value=value))
    return protos


def total(protos: Iterable[MetricSample], name: str, **match: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``match``."""
    return sum(p.value for p in protos
               if p.name == name and all(p.labels.get(k) == v for k, v in match.items()))
