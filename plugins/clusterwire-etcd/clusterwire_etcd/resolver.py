"""EtcdClusterResolver: the cluster as etcd's keys hold it now, and a watch on them."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.cluster_spec import ClusterSpec, with_address
from clusterwire.resolvers._support import OwnTaskResolver
from clusterwire_etcd.gateway import EtcdGateway, b64, prefix_end, unb64
from clusterwire_etcd.layout import (
    DEFAULT_PREFIX,
    MAX_TASKS,
    cluster_prefix,
    parse_task,
    validate_address,
    validate_ttl,
)
from clusterwire_etcd.registration import EtcdRegistration

_LOG = logging.getLogger("clusterwire.etcd")
#: How long a broken watch stream waits before it reconnects.
_RECONNECT_SECONDS = 1.0
#: How often ``register_task`` tries again for a key another lease holds.
_HELD_KEY_POLL_SECONDS = 0.5


class EtcdClusterResolver(OwnTaskResolver):
    """The tasks registered under ``<prefix>/<cluster>/<job>/<index>`` in the etcd at
    ``endpoint`` (``http://host:port``), read on every ``cluster_spec()`` call.

    ``task_type``/``task_id`` name this process's task. ``address`` is the address that task
    binds (e.g. ``"10.0.0.5:0"`` for a task that registers the port it binds:
    ``register_task``), unless etcd holds one of the same host for it: its own registration,
    or its previous run's, whose port it takes again (``register_task`` waits out that run's
    lease). An entry of another host is a rival's: ``register_task`` refuses it.
    ``wait_for_change(timeout)`` follows etcd's watch, so ``Server.from_resolver(resolver,
    watch=s)`` makes a change a membership version as soon as etcd reports it, and polls
    every ``s`` seconds besides.
    ``register_task(server)`` puts the serving task's key under a lease of ``ttl`` seconds
    (an ``EtcdRegistration``), as ``clusterwire serve --resolver etcd`` does.
    """

    def __init__(self, endpoint: str, cluster: str, task_type: str | None = None,
                 task_id: int | None = None, rpc_layer: str | None = "grpc",
                 address: str | None = None, prefix: str = DEFAULT_PREFIX,
                 timeout: float = 5.0, ttl: int = 10):
        validate_ttl(ttl)
        self._gateway = EtcdGateway(endpoint, timeout)
        self._prefix = cluster_prefix(prefix, cluster)
        self._registration_args = (cluster, ttl, prefix, timeout)
        if address is not None:
            if task_type is None or task_id is None:
                raise errors.InvalidArgumentError(
                    f"address={address!r} is this task's address: give task_type and "
                    "task_id too.")
            validate_address(address, port_zero=True)
        self.task_type, self.task_id, self.rpc_layer = task_type, task_id, rpc_layer
        self._address = address
        self._revision = 0
        self._changed = threading.Condition()
        self._changes = self._seen = 0
        self._watching: threading.Thread | None = None
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []

    @property
    def endpoint(self) -> str:
        """The etcd client URL this resolver reads."""
        return self._gateway.endpoint

    def cluster_spec(self) -> ClusterSpec:
        """``{job: {index: "host:port"}}`` of the keys under the cluster's prefix now.

        A malformed key or value is InvalidArgumentError naming it; more than MAX_TASKS
        keys ResourceExhaustedError; no key (and no ``address``) NotFoundError.
        """
        key = self._prefix.encode()
        answer = self._gateway.call("/v3/kv/range", {
            "key": b64(key), "range_end": b64(prefix_end(key)), "limit": MAX_TASKS + 1})
        where = self.endpoint
        entries = answer.get("kvs", [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise errors.InvalidArgumentError(
                f"etcd at {where} answered a range without a list of keys; is it etcd?")
        if len(entries) > MAX_TASKS:
            raise errors.ResourceExhaustedError(
                f"More than {MAX_TASKS} keys under {self._prefix} at {where}; a cluster "
                "this large is refused (delete stale keys, or use another prefix).")
        cluster: dict[str, dict[int, str]] = {}
        for entry in entries:
            job, index, address = parse_task(
                unb64(entry.get("key", ""), f"a key at {where}"),
                unb64(entry.get("value", ""), f"a value at {where}"), self._prefix, where)
            cluster.setdefault(job, {})[index] = address
        with contextlib.suppress(KeyError, TypeError, ValueError):
            self._revision = int(answer["header"]["revision"])
        spec = ClusterSpec(cluster) if cluster else None
        own = (self.task_type, self.task_id)
        held = cluster.get(own[0], {}).get(own[1])
        if self._address is not None and (
                held is None or split_host_port(held)[0] != split_host_port(self._address)[0]):
            spec = with_address(spec or ClusterSpec({}), own[0], own[1], self._address)
        if spec is None:
            raise errors.NotFoundError(
                f"No task is registered under {self._prefix} at {where}. Start the tasks "
                f"with EtcdRegistration (or `etcdctl put {self._prefix}<job>/<index> "
                "host:port`), or check the cluster name and prefix.")
        return spec

    def wait_for_change(self, timeout: float) -> bool:
        """Block until etcd reports a change under the prefix (True) or ``timeout`` seconds
        pass (False). The first call starts the watch, from the revision last read."""
        with self._changed:
            if self._watching is None and not self._closed.is_set():
                self._watching = threading.Thread(target=self._watch, daemon=True,
                                                  name="clusterwire-etcd-watch")
                self._watching.start()
            self._changed.wait_for(lambda: self._changes > self._seen, timeout)
            changed = self._changes > self._seen
            self._seen = self._changes
            return changed

    def register_task(self, server: Any) -> Callable[[], None]:
        """Register ``server``'s task at the address it is bound to, under a lease kept
        alive while it serves; returns the registration's ``stop`` (revoke the lease: the
        key goes at once). A key another lease holds is waited for up to the TTL (a dead
        task's expires by then: a task restarted at once takes its place), then refused with
        AlreadyExistsError (a live task holds it)."""
        cluster, ttl, prefix, timeout = self._registration_args
        deadline = time.monotonic() + ttl + 1
        while True:
            registration = EtcdRegistration.for_server(server, self.endpoint, cluster, ttl,
                                                       prefix, timeout)
            try:
                return registration.start().stop
            except errors.AlreadyExistsError:
                if time.monotonic() >= deadline or self._closed.wait(_HELD_KEY_POLL_SECONDS):
                    raise

    def close(self) -> None:
        """End the watch (idempotent); ``cluster_spec()`` still works."""
        self._closed.set()
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._watching is not None and self._watching is not threading.current_thread():
            self._watching.join(5)

    def _watch(self) -> None:
        key = self._prefix.encode()
        # The next revision to hear of: a stream that breaks is reopened from there, so no
        # change made while it was down is missed (0: from now on).
        start = self._revision + 1 if self._revision else 0
        failing, reopened = "", False
        while not self._closed.is_set():
            request = {"create_request": {"key": b64(key), "range_end": b64(prefix_end(key)),
                                          **({"start_revision": start} if start else {})}}
            try:
                for message in self._gateway.stream("/v3/watch", request, self._sockets):
                    result = message.get("result", {})
                    if not isinstance(result, dict):
                        continue
                    if result.get("canceled"):  # e.g. compacted past ``start``: from now on
                        start = 0
                        break
                    with contextlib.suppress(KeyError, TypeError, ValueError):
                        start = int(result["header"]["revision"]) + 1
                    if result.get("events") or (result.get("created") and reopened):
                        self._notify()  # a reopened stream from now on may have missed some
                    if self._closed.is_set():
                        return
                failing = ""
            except errors.OpError as err:
                if self._closed.is_set():
                    return
                if str(err) != failing:  # say each new failure once
                    _LOG.warning("clusterwire: etcd watch of %s failed (%s); reconnecting.",
                                 self._prefix, err)
                failing = str(err)
            finally:
                self._sockets.clear()
            reopened = True
            self._notify()  # the caller reads afresh (and sees the outage, if it lasts)
            self._closed.wait(_RECONNECT_SECONDS)

    def _notify(self) -> None:
        with self._changed:
            self._changes += 1
            self._changed.notify_all()

    def __enter__(self) -> EtcdClusterResolver:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
