"""KubernetesClusterResolver: pods selected by label selectors, one job per mapping entry.

TensorFlow's resolver (same arguments; pods of each selector sorted by name,
selectors concatenated in order; a pod that is not Running raises
RuntimeError), with these fixes:

* Addresses use the pod IP (``status.podIP``): TF uses the node's host IP, so
  two tasks on one node got the same ``ip:port``. ``use_host_ip=True`` restores TF.
* The API client is built once from the in-cluster or kubeconfig configuration
  (TF reloads the kubeconfig on every ``cluster_spec()``, even in a cluster,
  where there is none).
* ``namespace`` limits the search (TF always lists every namespace, which needs a
  cluster-wide role); ``pod_name`` (e.g. ``$HOSTNAME`` inside a pod) makes this
  process's task the one of that pod.
* API errors are clusterwire errors (401 Unauthenticated, 403 PermissionDenied,
  404 NotFound, 5xx and unreachable Unavailable); no pod is NotFoundError.

The ``kubernetes`` package is imported only when the resolver is built
(``pip install 'clusterwire[kubernetes]'``).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from typing import Any

from clusterwire import errors
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.plugins import ResolverSpec, hookimpl
from clusterwire.resolvers._support import OwnTaskResolver, ResolverRuntimeError, import_optional

_BY_STATUS = {400: errors.InvalidArgumentError, 401: errors.UnauthenticatedError,
              403: errors.PermissionDeniedError, 404: errors.NotFoundError}


class ExecutableLocation(enum.Enum):
    """Where the process runs: inside a pod (in-cluster config) or outside (kubeconfig)."""

    WITHIN_CLUSTER = 0
    OFF_CLUSTER = 1


def _client(location: ExecutableLocation) -> Any:
    config = import_optional("kubernetes.config", "kubernetes", "KubernetesClusterResolver")
    client = import_optional("kubernetes.client", "kubernetes", "KubernetesClusterResolver")
    try:
        if location == ExecutableLocation.WITHIN_CLUSTER:
            config.load_incluster_config()
        else:
            # $KUBECONFIG as it is now (the client reads it once, when first imported)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    except config.ConfigException as err:
        raise errors.FailedPreconditionError(
            f"No Kubernetes configuration for {location.name}: {err}") from None
    return client.CoreV1Api()


def _api_error(err: Exception, what: str) -> errors.OpError:
    exceptions = import_optional("kubernetes.client.exceptions", "kubernetes",
                                 "KubernetesClusterResolver")
    if isinstance(err, exceptions.ApiException):
        status = int(err.status or 0)
        cls = _BY_STATUS.get(status, errors.UnavailableError if status >= 500 or not status
                             else errors.InvalidArgumentError)
        return cls(f"{what}: HTTP {status}: {err.reason}")
    return errors.UnavailableError(f"{what}: {type(err).__name__}: {err}")


class KubernetesClusterResolver(OwnTaskResolver):
    """Pods by label selector (TF's ``KubernetesClusterResolver``).

    ``job_to_label_mapping``: ``{job: [selector, ...]}`` (default
    ``{"worker": ["job-name=tensorflow"]}``); every task listens on
    ``tf_server_port``. ``override_client`` is a ``CoreV1Api`` to use instead of
    one built from the configuration of ``executable_location``.
    """

    def __init__(self, job_to_label_mapping: Mapping[str, Sequence[str]] | None = None,
                 tf_server_port: int = 8470, rpc_layer: str | None = "grpc",
                 override_client: Any = None,
                 executable_location: ExecutableLocation = ExecutableLocation.WITHIN_CLUSTER,
                 namespace: str | None = None, pod_name: str | None = None,
                 use_host_ip: bool = False):
        self._mapping = dict(job_to_label_mapping or {"worker": ["job-name=tensorflow"]})
        self._port = tf_server_port
        self._namespace, self._pod_name, self._use_host_ip = namespace, pod_name, use_host_ip
        self.task_type: str | None = None
        self.task_id: int | None = None
        self.rpc_layer = rpc_layer
        if isinstance(executable_location, str):  # from the command line
            executable_location = ExecutableLocation[executable_location.upper()]
        self._client = override_client if override_client is not None else _client(
            executable_location)

    def _pods(self, selector: str) -> list[Any]:
        try:
            if self._namespace is None:
                listing = self._client.list_pod_for_all_namespaces(label_selector=selector)
            else:
                listing = self._client.list_namespaced_pod(self._namespace,
                                                           label_selector=selector)
        except Exception as err:  # ApiException, urllib3's connection errors
            raise _api_error(err, f"Listing pods with labels {selector!r}") from None
        return sorted(listing.items, key=lambda pod: pod.metadata.name)

    def cluster_spec(self) -> ClusterSpec:
        """``{job: ["ip:port", ...]}`` of the selected pods (queried on every call)."""
        cluster: dict[str, list[str]] = {}
        for job, selectors in self._mapping.items():
            addresses = cluster.setdefault(job, [])
            for selector in selectors:
                for pod in self._pods(selector):
                    if pod.status.phase != "Running":
                        raise ResolverRuntimeError(
                            f'Pod "{pod.metadata.name}" is not running; '
                            f'phase: "{pod.status.phase}"')
                    ip = pod.status.host_ip if self._use_host_ip else pod.status.pod_ip
                    if self._pod_name == pod.metadata.name:
                        self.task_type, self.task_id = job, len(addresses)
                    addresses.append(f"{ip}:{self._port}")
        if not any(cluster.values()):
            raise errors.NotFoundError(f"No pod matches the label selectors {self._mapping}.")
        if self._pod_name is not None and self.task_type is None:
            raise errors.NotFoundError(
                f"Pod {self._pod_name!r} is not among the pods selected by {self._mapping}.")
        return ClusterSpec(cluster)


@hookimpl
def clusterwire_add_resolvers() -> list[ResolverSpec]:
    """Register the "kubernetes" resolver."""
    return [ResolverSpec("kubernetes", KubernetesClusterResolver,
                         "pods by label selector (pip install 'clusterwire[kubernetes]')")]
