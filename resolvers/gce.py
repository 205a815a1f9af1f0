"""GCEClusterResolver: the RUNNING instances of a Compute Engine instance group.

TensorFlow's resolver (same arguments, ``instanceGroups.listInstances`` with
body ``{"instanceState": "RUNNING"}`` and every page followed, then
``instances.get`` for each member's first internal IP, the ``"ip:port"`` list
sorted as strings as TF's ``worker_list.sort()`` does, so task indices agree with
TF's: ``10.0.0.10`` comes before ``10.0.0.9``, and an instance's index follows its
IP, not its name; any ``task_type`` names the job, ``""`` too), with these fixes:

* The group is passed as ``instanceGroup`` (TF passes ``instanceGroups``, which
  the discovery client rejects), and a page without ``items`` is an empty page
  (TF raises KeyError).
* An empty group raises NotFoundError; API errors map to clusterwire errors
  (401 Unauthenticated, 403 PermissionDenied, 404 NotFound, 429/5xx and
  unreachable endpoints Unavailable, other 4xx InvalidArgument).

google-api-python-client is imported only when the resolver is built
(``pip install 'clusterwire[gce]'``); it ships the compute v1 discovery
document, so building the client needs no network. ``client_options`` (e.g.
``{"api_endpoint": "http://127.0.0.1:8080/compute/v1/"}``) is handed to
``discovery.build``; a ``service`` object replaces the client altogether.
"""

from __future__ import annotations

from typing import Any

from clusterwire import errors
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.plugins import ResolverSpec, hookimpl
from clusterwire.resolvers._support import OwnTaskResolver, ResolverRuntimeError, import_optional

_BY_STATUS = {400: errors.InvalidArgumentError, 401: errors.UnauthenticatedError,
              403: errors.PermissionDeniedError, 404: errors.NotFoundError,
              409: errors.AbortedError, 429: errors.UnavailableError}


def _api_error(err: Exception, what: str) -> errors.OpError:
    """Map a googleapiclient/httplib2 exception to a clusterwire error."""
    http_error = import_optional("googleapiclient.errors", "gce", "GCEClusterResolver").HttpError
    if isinstance(err, http_error):
        status = int(err.resp.status)
        cls = _BY_STATUS.get(status)
        if cls is None:
            cls = errors.UnavailableError if status >= 500 else errors.InvalidArgumentError
        return cls(f"{what}: HTTP {status}: {err._get_reason()}")
    google_auth = import_optional("google.auth.exceptions", "gce", "GCEClusterResolver")
    if isinstance(err, google_auth.GoogleAuthError):  # e.g. a 401 whose token refresh failed
        return errors.UnauthenticatedError(f"{what}: {type(err).__name__}: {err}")
    return errors.UnavailableError(f"{what}: {type(err).__name__}: {err}")


def _build_service(credentials: Any, client_options: Any) -> Any:
    discovery = import_optional("googleapiclient.discovery", "gce", "GCEClusterResolver")
    if credentials == "default":
        google_auth = import_optional("google.auth", "gce", "GCEClusterResolver")
        try:
            credentials, _ = google_auth.default(
                scopes=["https://www.googleapis.com/auth/compute.readonly"])
        except google_auth.exceptions.DefaultCredentialsError as err:
            raise errors.UnauthenticatedError(
                f"No Google credentials: {err} Pass credentials=... to the resolver.") from None
    return discovery.build("compute", "v1", credentials=credentials, static_discovery=True,
                           cache_discovery=False, client_options=client_options)


class GCEClusterResolver(OwnTaskResolver):
    """A one-job cluster of a GCE instance group (TF's ``GCEClusterResolver``).

    Every task listens on ``port``; this process is ``task_type``/``task_id``
    (``task_type`` cannot change after construction, as in TF).
    """

    def __init__(self, project: str, zone: str, instance_group: str, port: int,
                 task_type: str = "worker", task_id: int = 0, rpc_layer: str | None = "grpc",
                 credentials: Any = "default", service: Any = None,
                 client_options: Any = None, num_retries: int = 0):
        self._project, self._zone, self._instance_group = project, zone, instance_group
        self._port = port
        self._task_type = task_type
        self.task_id = task_id
        self.rpc_layer = rpc_layer
        self._num_retries = num_retries
        self._service = service if service is not None else _build_service(
            credentials, client_options)

    @property
    def task_type(self) -> str:  # type: ignore[override]
        """The job name of every instance (fixed at construction)."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str) -> None:
        raise ResolverRuntimeError(
            "You cannot reset the task_type of the GCEClusterResolver after it has been created.")

    def _execute(self, request: Any, what: str) -> dict[str, Any]:
        try:
            return request.execute(num_retries=self._num_retries)
        except Exception as err:  # HttpError, httplib2's errors, OSError (refused, timeout)
            raise _api_error(err, what) from None

    def _member_names(self) -> list[str]:
        group = f"projects/{self._project}/zones/{self._zone}/instanceGroups/{self._instance_group}"
        groups = self._service.instanceGroups()
        request = groups.listInstances(project=self._project, zone=self._zone,
                                       instanceGroup=self._instance_group,
                                       body={"instanceState": "RUNNING"}, orderBy="name")
        names = []
        while request is not None:
            response = self._execute(request, f"Listing instance group {group}")
            names.extend(item["instance"].split("/")[-1] for item in response.get("items", []))
            request = groups.listInstances_next(previous_request=request,
                                                previous_response=response)
        if not names:
            raise errors.NotFoundError(f"Instance group {group} has no RUNNING instance.")
        return names

    def cluster_spec(self) -> ClusterSpec:
        """``{task_type: ["internal_ip:port", ...]}``, the addresses sorted as strings, as in
        TF (queried each call)."""
        addresses = []
        for name in self._member_names():
            instance = self._execute(
                self._service.instances().get(project=self._project, zone=self._zone,
                                              instance=name),
                f"Getting instance {name} in {self._project}/{self._zone}")
            try:
                ip = instance["networkInterfaces"][0]["networkIP"]
            except (KeyError, IndexError):
                raise errors.FailedPreconditionError(
                    f"Instance {name} has no internal IP (networkInterfaces[0].networkIP)."
                ) from None
            addresses.append(f"{ip}:{self._port}")
        return ClusterSpec({self._task_type: sorted(addresses)})


@hookimpl
def clusterwire_add_resolvers() -> list[ResolverSpec]:
    """Register the "gce" resolver."""
    return [ResolverSpec("gce", GCEClusterResolver,
                         "RUNNING instances of a GCE instance group "
                         "(pip install 'clusterwire[gce]')")]
