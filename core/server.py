"""Server: one task of a cluster, serving the cluster service over a protocol."""

from __future__ import annotations

import threading
from dataclasses import fields
from typing import Any

from clusterwire import errors
from clusterwire.addressing import join_host_port, split_host_port
from clusterwire.at_exit import stop_at_exit
from clusterwire.cluster_spec import ClusterSpec, with_address
from clusterwire.membership import ResolverWatch
from clusterwire.metrics.endpoint import MetricsEndpoint, serve_metrics
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.tensorflow_server_pb2 import ServerDef
from clusterwire.security import load_security, security_fields
from clusterwire.server_def import make_server_def
from clusterwire.service import SERVED_AT_ONCE, ClusterService
from clusterwire.shell import Shell, listen_options, warn_if_exposed
from clusterwire.transport import ListenOptions
from clusterwire.waiting import wait_event

_DEFAULT_PEER_TIMEOUT = 30.0


class Server:
    """An in-process server for one task of a cluster (``tf.distribute.Server``).

    ``Server(server_or_cluster_def, job_name=None, task_index=None,
    protocol=None, config=None, start=True)`` accepts a ``ServerDef``, a
    ``ClusterDef``, a ``ClusterSpec``, a dict or a ``ClusterResolver``. ``job_name``, ``task_index``
    and ``protocol`` override the definition; ``config`` is a ``ConfigProto``
    (merged into ``default_session_config``, as in TF) or clusterwire
    ``ServerOptions`` / a dict of its fields (bind_address,
    peer_timeout_seconds, max_workers, max_message_bytes, max_concurrent_calls, max_connections,
    max_store_bytes, handshake_timeout_seconds, message_idle_timeout_seconds,
    max_pending_connections, small_call_reserve, send_tracebacks, transport_options,
    metrics_port and metrics_host (an HTTP endpoint of the process's metrics, protected by
    the server's security: see clusterwire.metrics), membership_heartbeat_seconds,
    membership_timeout_seconds and allow_membership_changes (see clusterwire.membership),
    membership_protocol ("swim": see clusterwire.swim_driver),
    and the security options tls_cert_file,
    tls_key_file, tls_ca_file, tls_client_auth, auth_token_file: see clusterwire.security).

    Unlike TF's: port 0 binds a free port that ``target`` and ``server_def``
    report; the listener binds the host of the task's address (not every
    interface); ``stop()`` exists and frees the port; ``join()`` returns once
    the server is stopped; an unknown protocol is a NotFoundError at once,
    never a fallback.
    """

    def __init__(self, server_or_cluster_def: Any, job_name: str | None = None,
                 task_index: int | None = None, protocol: str | None = None,
                 config: Any = None, start: bool = True):
        self._server_def = _server_def(server_or_cluster_def, job_name, task_index, protocol,
                                       config)
        sd = self._server_def
        cluster = ClusterSpec(sd.cluster)
        self._host, port = _task_address(cluster, sd)
        options = sd.clusterwire_options
        transport = get_plugin_manager().transport(sd.protocol)
        self._lock = threading.Lock()
        self._started = False
        self._stopped = threading.Event()
        self._security = load_security({f: getattr(options, f) for f in security_fields()})
        self._service = ClusterService(
            cluster, sd.job_name, sd.task_index, sd.protocol, lambda: self.target,
            options.peer_timeout_seconds or _DEFAULT_PEER_TIMEOUT, transport.info, self._security,
            options.max_store_bytes or None, options.membership_heartbeat_seconds,
            options.membership_timeout_seconds, options.allow_membership_changes,
            options.membership_protocol)
        self._shell, self._metrics = self._serve(port)
        self._port = self._shell.port
        self._publish_bound_port(cluster)
        self._finalizer = stop_at_exit(self, _shutdown, self._shell, self._service,
                                       None, self._metrics)
        self._watch: ResolverWatch | None = None
        if start:
            self.start()

    def _serve(self, port: int) -> tuple[Shell, MetricsEndpoint | None]:
        """Start the task's listener (on ``port`` of the bind address) and, with
        metrics_port, the metrics endpoint. On failure nothing started is left serving and
        the cluster service is closed."""
        sd = self._server_def
        options = sd.clusterwire_options
        # ServerOptions has a field of the same name for every limit of ListenOptions.
        shell_options = listen_options(security=self._security, **{
            f.name: getattr(options, f.name) for f in fields(ListenOptions)
            if f.name != "security"})
        bind_host = options.bind_address or self._host
        name = f"/job:{sd.job_name}/task:{sd.task_index}"
        try:
            shell = Shell(sd.protocol, join_host_port(bind_host, port), self._service.handle,
                          name, shell_options, self._service.cancel_waits,
                          options.send_tracebacks, self._service.method_of, SERVED_AT_ONCE)
        except BaseException:
            self._service.close()
            raise
        warn_if_exposed(bind_host, shell_options, f"Task {name}")
        if not options.HasField("metrics_port"):
            return shell, None
        try:
            return shell, serve_metrics(options.metrics_port,
                                        options.metrics_host or "127.0.0.1", self._security)
        except BaseException:
            _shutdown(shell, self._service, None, None)
            raise

    def _publish_bound_port(self, cluster: ClusterSpec) -> None:
        sd = self._server_def
        if sd.port:
            sd.port = self._port
        self._service.membership.begin(with_address(
            cluster, sd.job_name, sd.task_index, join_host_port(self._host, self._port)))

    @classmethod
    def from_resolver(cls, resolver: Any, protocol: str | None = None, config: Any = None,
                      start: bool = True, watch: float | None = None) -> Server:
        """Start this process's task as ``resolver`` describes it.

        The cluster comes from ``resolver.cluster_spec()``, the task from its
        ``task_type``/``task_id``, the protocol from ``protocol`` or else the
        resolver's ``rpc_layer`` (default "grpc"). With ``watch`` (seconds), the server
        follows the resolver: it polls ``cluster_spec()`` that often (as the resolver
        contract asks: the cluster may change) and makes each change a new membership
        version (``update_cluster``), which spreads to the other tasks; it then takes the
        changes of its peers' views too (``allow_membership_changes``).
        """
        if watch is not None and (isinstance(watch, bool) or not isinstance(watch, int | float)
                                  or watch <= 0):
            raise errors.InvalidArgumentError(
                f"watch must be a number of seconds > 0 (or None: no watching), got {watch!r}.")
        cluster = resolver.cluster_spec()
        job, index = resolver.task_type, resolver.task_id
        if job is None or index is None:
            raise errors.InvalidArgumentError(
                f"{type(resolver).__name__} does not say which task this process is "
                f"(task_type={job!r}, task_id={index!r}); set them on the resolver.")
        server = cls(cluster, job_name=job, task_index=int(index),
                     protocol=protocol or resolver.rpc_layer or None, config=config,
                     start=start)
        if watch is not None:
            server._service.membership.allow_changes = True
            server._watch = ResolverWatch(resolver, watch, server)
        return server

    def update_cluster(self, cluster: Any) -> int:
        """Make ``cluster`` (a ClusterSpec, ClusterDef or dict) this task's membership as
        the next version and spread it to the other tasks; returns the version. Tasks that
        joined are reached at once, requests for tasks that left fail with NotFoundError
        naming the version, barriers waiting when it changes end with AbortedError. This
        task's own address stays the one it is bound to."""
        return self._service.update_cluster(ClusterSpec(cluster))

    @property
    def membership_version(self) -> int:
        """The version of this task's membership view (0: the cluster it started with)."""
        return self._service.membership.view.version

    @staticmethod
    def create_local_server(config: Any = None, start: bool = True) -> Server:
        """A single-task server (job "local", task 0) on a free port of localhost."""
        return Server({"local": ["localhost:0"]}, protocol="grpc", config=config, start=start)

    @property
    def server_def(self) -> ServerDef:
        """The ServerDef of this server, with the bound port in its own task's address."""
        self._server_def.cluster.CopyFrom(self._service.cluster.as_cluster_def())
        return self._server_def

    @property
    def target(self) -> str:
        """``protocol://host:port`` that a Session connects to."""
        return f"{self._server_def.protocol}://{join_host_port(self._host, self._port)}"

    @property
    def metrics_url(self) -> str | None:
        """``http(s)://host:port/metrics`` of the metrics endpoint (metrics_port), or None."""
        return None if self._metrics is None else self._metrics.url

    @property
    def secure(self) -> bool:
        """True when this server requires TLS or a cluster token."""
        return self._security.secure

    @property
    def cluster_spec(self) -> ClusterSpec:
        """The cluster as this server sees it (its own task with the bound port)."""
        return self._service.cluster

    def start(self) -> None:
        """Start serving (idempotent); FailedPreconditionError after stop()."""
        with self._lock:
            if not self._finalizer.alive:
                raise errors.FailedPreconditionError(
                    "This server was stopped; create a new Server to serve again.")
            if not self._started:
                self._shell.start()
                self._shell.reachable_at(join_host_port(self._host, self._port))
                self._service.start_membership()
                self._started = True

    def join(self, timeout: float | None = None) -> bool:
        """Block until the server is stopped (or ``timeout`` passes); True once stopped.

        Ctrl-C and other signal handlers still run promptly while the main
        thread waits here.
        """
        return wait_event(self._stopped, timeout)

    def stop(self, grace: float | None = None) -> None:
        """Stop serving: in-flight requests get ``grace`` seconds, then CancelledError.

        Idempotent; the port is free when it returns, and join() returns.
        """
        with self._lock:
            owner = self._finalizer.detach() is not None
        if self._watch is not None:
            self._watch.stop()
        if not owner:
            self._stopped.wait()
            return
        try:
            _shutdown(self._shell, self._service, grace, self._metrics)
        finally:
            self._stopped.set()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        sd = self._server_def
        state = "stopped" if self._stopped.is_set() else "serving" if self._started else "created"
        return f"<Server /job:{sd.job_name}/task:{sd.task_index} {self.target} {state}>"


def _server_def(server_or_cluster_def: Any, job_name: str | None, task_index: int | None,
                protocol: str | None, config: Any) -> ServerDef:
    """The ServerDef of ``Server``'s arguments (see ``make_server_def``), after checking the
    types of those that override the definition."""
    if job_name is not None and not isinstance(job_name, str):
        raise TypeError(f"job_name must be a string, got {job_name!r}")
    if task_index is not None and (isinstance(task_index, bool)
                                   or not isinstance(task_index, int)):
        raise TypeError(f"task_index must be an int, got {task_index!r}")
    if protocol is not None and not isinstance(protocol, str):
        raise TypeError(f"protocol must be a string such as 'grpc', got {protocol!r}")
    return make_server_def(server_or_cluster_def, job_name, task_index, protocol, config)


def _task_address(cluster: ClusterSpec, sd: ServerDef) -> tuple[str, int]:
    """The host and port ``sd``'s task listens on (its ``port`` overrides the cluster's);
    InvalidArgumentError if the cluster does not define the task."""
    if sd.job_name not in cluster.jobs:
        raise errors.InvalidArgumentError(
            f'Job "{sd.job_name}" was not defined in cluster {cluster!r}; '
            f"pick job_name from {cluster.jobs}.")
    if sd.task_index not in cluster.task_indices(sd.job_name):
        raise errors.InvalidArgumentError(
            f'Task {sd.task_index} was not defined in job "{sd.job_name}"; its tasks are '
            f"{cluster.task_indices(sd.job_name)}.")
    host, port = split_host_port(cluster.task_address(sd.job_name, sd.task_index))
    return host, sd.port or port


def _shutdown(shell: Shell, service: ClusterService, grace: float | None = None,
              metrics: MetricsEndpoint | None = None) -> None:
    """Say goodbye to the peers (see ``ClusterService.leave``), drain for ``grace`` s,
    cancel what is left, close the listener, then the peers and the metrics endpoint."""
    try:
        try:
            service.leave()
        finally:
            shell.stop(grace)
    finally:
        service.close()
        if metrics is not None:
            metrics.close()
