"""Metrics of a clusterwire process.

Every server counts what it serves (``clusterwire.metrics.requests``: every server kind,
through its listener shell) and what its kind does (store, barriers, peers; the data
service's workers, jobs and elements). The counts are

* in ``status()`` of a task (and of the data service's servers), which ``clusterwire top``
  reads: no Prometheus needed;
* in Prometheus' text format at ``/metrics`` of an opt-in HTTP endpoint
  (``metrics_port``; ``serve_metrics`` for a training process), which also answers
  ``/healthz`` and ``/readyz`` (``clusterwire.metrics.endpoint``).

``catalog`` lists every metric; ``registry`` holds what was counted.
"""

from clusterwire.metrics.catalog import CATALOG, Metric, markdown_table
from clusterwire.metrics.registry import ENABLED, REGISTRY, Family, Histogram, Registry, Sample

__all__ = ["CATALOG", "ENABLED", "REGISTRY", "Family", "Histogram", "Metric", "Registry",
           "Sample", "markdown_table"]
