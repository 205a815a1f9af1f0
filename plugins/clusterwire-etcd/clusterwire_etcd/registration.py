"""EtcdRegistration: a serving task's key, held under an etcd lease while the task lives."""

from __future__ import annotations

import logging
import threading
from typing import Any

from clusterwire import errors
from clusterwire_etcd.gateway import EtcdGateway, b64
from clusterwire_etcd.layout import DEFAULT_PREFIX, task_key, validate_address, validate_ttl

_LOG = logging.getLogger("clusterwire.etcd")


class EtcdRegistration:
    """Puts ``<prefix>/<cluster>/<job>/<index> -> address`` under a lease of ``ttl`` seconds
    and keeps the lease alive (every ``ttl``/3 s) until ``stop()``, which revokes it and so
    deletes the key. A process that dies without ``stop()`` stops the keep-alives; etcd then
    deletes the key within ``ttl`` seconds.

    ``start()`` refuses (AlreadyExistsError naming the key and its holder) a key that
    another registration holds, so two tasks never claim one index. A registration made
    with ``for_server`` also ends (lease revoked) within ``ttl``/3 s of the server's stop.
    """

    def __init__(self, endpoint: str, cluster: str, job: str, index: int, address: str,
                 ttl: int = 10, prefix: str = DEFAULT_PREFIX, timeout: float = 5.0):
        validate_ttl(ttl)
        validate_address(address)
        self._gateway = EtcdGateway(endpoint, timeout)
        self.key = task_key(prefix, cluster, job, index)
        self.address, self.ttl = address, ttl
        self.lease: int | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._server: Any = None  # the Server whose stop ends this registration

    @classmethod
    def for_server(cls, server: Any, endpoint: str, cluster: str, ttl: int = 10,
                   prefix: str = DEFAULT_PREFIX, timeout: float = 5.0) -> EtcdRegistration:
        """The registration of a running ``Server``'s task at the address it is bound to."""
        job, index = server.server_def.job_name, server.server_def.task_index
        registration = cls(endpoint, cluster, job, index,
                           server.cluster_spec.task_address(job, index), ttl, prefix, timeout)
        registration._server = server
        return registration

    def start(self) -> EtcdRegistration:
        """Grant the lease, put the key under it and start the keep-alives; returns self."""
        with self._lock:
            if self._stopped.is_set():
                raise errors.FailedPreconditionError(
                    f"The registration of {self.key} was stopped; create a new one.")
            if self.lease is not None:
                return self
            granted = self._gateway.call("/v3/lease/grant", {"TTL": self.ttl})
            try:
                lease = int(granted["ID"])
            except (KeyError, TypeError, ValueError):
                raise errors.UnavailableError(
                    f"etcd at {self._gateway.endpoint} granted no lease ({granted!r:.200}); "
                    "is it etcd >= 3.4?") from None
            key = b64(self.key)
            put = self._gateway.call("/v3/kv/txn", {
                "compare": [{"key": key, "target": "CREATE", "create_revision": "0"}],
                "success": [{"request_put": {"key": key, "value": b64(self.address),
                                             "lease": str(lease)}}]})
            if not put.get("succeeded"):
                self._revoke(lease)
                raise errors.AlreadyExistsError(
                    f"{self.key} is already registered at {self._gateway.endpoint} (by "
                    "another task, or a dead one whose lease has not expired yet): pick "
                    "another index, or wait for the lease to expire.")
            self.lease = lease
            self._thread = threading.Thread(target=self._keep_alive, daemon=True,
                                            name="clusterwire-etcd-lease")
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the keep-alives and revoke the lease, deleting the key (idempotent)."""
        with self._lock:
            self._stopped.set()
            lease, self.lease = self.lease, None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        if lease is not None:
            self._revoke(lease)

    def _revoke(self, lease: int) -> None:
        try:
            self._gateway.call("/v3/lease/revoke", {"ID": str(lease)})
        except errors.NotFoundError:
            pass  # expired already: the key is gone
        except errors.OpError as err:
            _LOG.warning("clusterwire: could not revoke the lease of %s (%s); etcd deletes "
                         "the key when its %d s lease expires.", self.key, err, self.ttl)

    def _keep_alive(self) -> None:
        failing = ""
        while not self._stopped.wait(self.ttl / 3):
            lease = self.lease
            if lease is None:
                return
            if self._server is not None and self._server.join(0):  # the task no longer serves
                self.stop()
                return
            try:
                answer = self._gateway.call("/v3/lease/keepalive", {"ID": str(lease)})
            except errors.OpError as err:
                if str(err) != failing:  # say each new failure once
                    _LOG.warning("clusterwire: keep-alive of %s failed (%s); retrying.",
                                 self.key, err)
                failing = str(err)
                continue
            failing = ""
            result = answer.get("result")
            left = str(result.get("TTL", "0")) if isinstance(result, dict) else "0"
            if not left.isdigit() or not int(left):  # no TTL: the lease is gone
                _LOG.error("clusterwire: the lease of %s expired (etcd was out of reach for "
                           "over %d s); the key is gone and this task is no longer registered.",
                           self.key, self.ttl)
                return

    def __enter__(self) -> EtcdRegistration:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
