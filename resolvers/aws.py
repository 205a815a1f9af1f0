"""AWSClusterResolver: a cluster of running EC2 instances found by their tags (new; TF has none).

Instances are selected by tag filters (``DescribeInstances`` with
``tag:KEY`` filters and state ``running``, every page followed). Each instance's
job is the value of its ``job_tag`` tag (``default_job`` without one) and its
index the value of its ``task_tag`` tag; a job whose instances carry no index
tag is ordered by ``Name`` tag, then instance id. Addresses are
``private IP:port``. Region, endpoint and credentials come from the usual
boto3 configuration (``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``, profiles ...)
unless given. boto3 is imported only when the resolver is built
(``pip install 'clusterwire[aws]'``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clusterwire import errors
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.plugins import ResolverSpec, hookimpl
from clusterwire.resolvers._support import OwnTaskResolver, import_optional

_DENIED = {"UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "OptInRequired"}
_UNAUTHENTICATED = {"AuthFailure", "InvalidClientTokenId", "SignatureDoesNotMatch",
                    "ExpiredToken", "RequestExpired"}
_RETRYABLE = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "Unavailable",
              "InternalError", "ServiceUnavailable"}


def _tag_filters(filters: Mapping[str, str | Sequence[str]]) -> list[dict[str, Any]]:
    result = []
    for key, values in filters.items():
        values = [values] if isinstance(values, str) else list(values)
        result.append({"Name": f"tag:{key}", "Values": [str(v) for v in values]})
    return result


def _api_error(err: Exception, what: str) -> errors.OpError:
    """Map a botocore exception to the clusterwire error a caller can act on."""
    botocore_exceptions = import_optional("botocore.exceptions", "aws", "AWSClusterResolver")
    if isinstance(err, botocore_exceptions.ClientError):
        code = err.response.get("Error", {}).get("Code", "")
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        text = f"{what}: {code}: {err.response.get('Error', {}).get('Message', err)}"
        if code in _DENIED or (status == 403 and code not in _UNAUTHENTICATED):
            return errors.PermissionDeniedError(text + " (the credentials lack "
                                                "ec2:DescribeInstances)")
        if code in _UNAUTHENTICATED or status == 401:
            return errors.UnauthenticatedError(text)
        if code in _RETRYABLE or status >= 500:
            return errors.UnavailableError(text)
        return errors.InvalidArgumentError(text)
    if isinstance(err, botocore_exceptions.NoCredentialsError):
        return errors.UnauthenticatedError(
            f"{what}: no AWS credentials found (environment, ~/.aws or instance profile).")
    if isinstance(err, botocore_exceptions.NoRegionError):
        return errors.InvalidArgumentError(
            f"{what}: no AWS region: pass region_name or set AWS_DEFAULT_REGION.")
    return errors.UnavailableError(f"{what}: {type(err).__name__}: {err}")


class AWSClusterResolver(OwnTaskResolver):
    """Running EC2 instances selected by tags, grouped into jobs by a tag.

    ``filters``: ``{tag: value or [values]}`` every instance of the cluster has
    (e.g. ``{"cluster": "exp1"}``). ``job_tag``/``task_tag``: tags naming an
    instance's job and index (None: not used). ``port``: the port of every task.
    This process's task is ``task_type``/``task_id``, or else the instance whose
    id is ``instance_id``. ``client``: a boto3 EC2 client to use instead of one
    built from ``region_name``/``endpoint_url`` and boto3's configuration.
    ``page_size``: instances per DescribeInstances page (5..1000; default: the
    API's); every page is read.

    Errors: no matching instance is NotFoundError; a duplicate index or a
    non-integer index tag is InvalidArgumentError; API errors map to
    PermissionDeniedError (403), UnauthenticatedError (bad credentials),
    UnavailableError (throttling, 5xx, unreachable endpoint).
    """

    def __init__(self, filters: Mapping[str, str | Sequence[str]] | None = None,
                 port: int = 8470, job_tag: str | None = "job", task_tag: str | None = "task",
                 default_job: str = "worker", task_type: str | None = None,
                 task_id: int | None = None, instance_id: str | None = None,
                 rpc_layer: str | None = "grpc", region_name: str | None = None,
                 endpoint_url: str | None = None, client: Any = None,
                 page_size: int | None = None):
        self._filters = dict(filters or {})
        self._port = port
        self._job_tag, self._task_tag, self._default_job = job_tag, task_tag, default_job
        self._instance_id = instance_id
        self._pagination = {"PageSize": page_size} if page_size else {}
        self.task_type, self.task_id, self.rpc_layer = task_type, task_id, rpc_layer
        if client is None:
            boto3 = import_optional("boto3", "aws", "AWSClusterResolver")
            try:
                client = boto3.session.Session(region_name=region_name).client(
                    "ec2", endpoint_url=endpoint_url)
            except Exception as err:  # botocore raises many kinds; all become clear errors
                raise _api_error(err, "Cannot create the EC2 client") from None
        self._client = client

    def _instances(self) -> list[dict[str, Any]]:
        request_filters = _tag_filters(self._filters) + [
            {"Name": "instance-state-name", "Values": ["running"]}]
        instances = []
        try:
            for page in self._client.get_paginator("describe_instances").paginate(
                    Filters=request_filters, PaginationConfig=self._pagination):
                for reservation in page.get("Reservations", []):
                    instances.extend(reservation.get("Instances", []))
        except Exception as err:  # botocore's ClientError, EndpointConnectionError, ...
            raise _api_error(err, "EC2 DescribeInstances failed") from None
        if not instances:
            raise errors.NotFoundError(
                f"No running EC2 instance has the tags {self._filters}; check the filters, "
                "the region and that the instances are running.")
        return instances

    def _task_of(self, instance: dict[str, Any]) -> tuple[str, int | None, str]:
        tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
        job = tags.get(self._job_tag, self._default_job) if self._job_tag else self._default_job
        index = tags.get(self._task_tag) if self._task_tag else None
        if index is not None:
            if not index.strip().isdigit():
                raise errors.InvalidArgumentError(
                    f"Instance {instance['InstanceId']} has {self._task_tag}={index!r}; "
                    "the index tag must be an integer >= 0.")
            index = int(index)
        return job, index, tags.get("Name", "")

    def _tasks(self) -> dict[str, dict[int, tuple[str, str]]]:
        """``{job: {index: (address, instance id)}}``."""
        jobs: dict[str, list[tuple[int | None, str, dict[str, Any]]]] = {}
        for instance in self._instances():
            job, index, name = self._task_of(instance)
            jobs.setdefault(job, []).append((index, name, instance))
        tasks: dict[str, dict[int, tuple[str, str]]] = {}
        for job, members in jobs.items():
            tagged = [m for m in members if m[0] is not None]
            if tagged and len(tagged) != len(members):
                raise errors.InvalidArgumentError(
                    f"Job {job!r}: some instances have a {self._task_tag!r} tag and some do "
                    "not; tag all of them or none.")
            if not tagged:
                ordered = sorted(members, key=lambda m: (m[1], m[2]["InstanceId"]))
                members = [(i, m[1], m[2]) for i, m in enumerate(ordered)]
            tasks[job] = {}
            for index, _, instance in members:
                if index in tasks[job]:
                    raise errors.InvalidArgumentError(
                        f"Job {job!r} index {index} is claimed by instances "
                        f"{tasks[job][index][1]} and {instance['InstanceId']}.")
                if not instance.get("PrivateIpAddress"):
                    raise errors.FailedPreconditionError(
                        f"Instance {instance['InstanceId']} has no private IP address yet.")
                tasks[job][index] = (f"{instance['PrivateIpAddress']}:{self._port}",
                                     instance["InstanceId"])
        return tasks

    def cluster_spec(self) -> ClusterSpec:
        """The cluster of the matching running instances (queried on every call)."""
        tasks = self._tasks()
        if self._instance_id is not None and (self.task_type is None or self.task_id is None):
            for job, members in tasks.items():
                for index, (_, instance_id) in members.items():
                    if instance_id == self._instance_id:
                        self.task_type, self.task_id = job, index
            if self.task_type is None:
                raise errors.NotFoundError(
                    f"Instance {self._instance_id} is not among the running instances "
                    f"tagged {self._filters}.")
        return ClusterSpec({job: {i: a for i, (a, _) in members.items()}
                            for job, members in tasks.items()})


@hookimpl
def clusterwire_add_resolvers() -> list[ResolverSpec]:
    """Register the "aws" resolver."""
    return [ResolverSpec("aws", AWSClusterResolver,
                         "running EC2 instances selected by tags (pip install 'clusterwire[aws]')")]
