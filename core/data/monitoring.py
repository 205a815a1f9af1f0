"""What a dispatcher or worker tells about itself: its metrics and its status.

Each server has a name (the ``server`` label of its metrics; its listener shell's name). Its
gauges come from a registry source read at each scrape, its counters from the registry's
families (``clusterwire.metrics``); its config's ``metrics_port`` serves them over HTTP, and
it answers ``GetStatusRequest`` with a ``DataServiceStatus`` (what ``clusterwire top
--dispatcher`` shows; ``clusterwire.data.service_status`` asks for it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from clusterwire._version import __version__
from clusterwire.metrics import catalog, snapshot
from clusterwire.metrics.endpoint import MetricsEndpoint, serve_metrics
from clusterwire.metrics.registry import ENABLED, REGISTRY, Source
from clusterwire.protos.data_service_pb2 import DataResponse
from clusterwire.security import Security

_lock = threading.Lock()
_names: set[str] = set()


class MonitoredServer:
    """What a data-service server (dispatcher, worker) shows of its ``Monitoring``."""

    _monitoring: Monitoring

    @property
    def metrics_name(self) -> str:
        """The ``server`` label of this server's metrics (a worker's data-transfer
        listener's requests: ``metrics_name + "/transfer"``)."""
        return self._monitoring.name

    @property
    def metrics_url(self) -> str | None:
        """``http(s)://host:port/metrics`` of the metrics endpoint (metrics_port), or None."""
        return self._monitoring.url


class Monitoring:
    """A data-service server's name, metrics source and metrics endpoint.

    The name is ``base`` ("data-dispatcher", "data-worker"), numbered from 2 on while
    another server of this process uses it, so every server's series stay apart without
    letting a label grow with what clients do. ``close()`` (at the server's stop) removes
    the server's series and frees the name.
    """

    def __init__(self, base: str):
        with _lock:
            name, number = base, 1
            while name in _names:
                number += 1
                name = f"{base}-{number}"
            _names.add(name)
        self.name = name
        self._closed = False
        self._stop_reporting = None
        self._endpoint: MetricsEndpoint | None = None

    def start(self, source: Source, metrics_port: int | None, metrics_host: str,
              security: Security) -> None:
        """Report ``source``'s samples from now on; serve the process's metrics at
        ``metrics_host:metrics_port`` (0: a free port) unless the port is None."""
        if ENABLED:
            self._stop_reporting = REGISTRY.add_source(source)
        if metrics_port is not None:
            self._endpoint = serve_metrics(metrics_port, metrics_host, security)

    @property
    def url(self) -> str | None:
        """``http(s)://host:port/metrics`` of the metrics endpoint, or None."""
        return None if self._endpoint is None else self._endpoint.url

    def status(self, kind: str, address: str, protocol: str,
               shells: Iterable[str] = ()) -> DataResponse:
        """A ``status_report`` response: identity and the samples of this server (and of
        ``shells``, its other listeners' names)."""
        response = DataResponse()
        report = response.status_report
        report.kind, report.address, report.protocol = kind, address, protocol
        report.version = __version__
        for name in (self.name, *shells):
            report.metrics.extend(snapshot.to_protos(REGISTRY.samples(server=name)))
        return response

    def close(self) -> None:
        """Stop reporting, drop the server's series, close the metrics endpoint and free
        the name (idempotent)."""
        with _lock:
            if self._closed:
                return
            self._closed = True
        if self._stop_reporting is not None:
            self._stop_reporting()
        if self._endpoint is not None:
            self._endpoint.close()
        for metric in catalog.CATALOG:
            if "server" in metric.labels:
                REGISTRY.family(metric).remove(server=self.name)
        with _lock:
            _names.discard(self.name)

