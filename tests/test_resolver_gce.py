"""GCEClusterResolver against a local Compute Engine v1 endpoint (tests/fake_gce.py).

The resolver builds its google-api-python-client from the compute v1 discovery
document shipped in the wheel, pointed at the fake through ``client_options``.
"""

from __future__ import annotations

import pytest

from clusterwire import errors
from clusterwire.plugins import get_plugin_manager

pytest.importorskip("googleapiclient", reason="pip install 'clusterwire[gce]'")
from fake_gce import FakeCompute  # noqa: E402
from google.auth.credentials import AnonymousCredentials  # noqa: E402

from clusterwire.resolvers import GCEClusterResolver  # noqa: E402

pytestmark = pytest.mark.timeout(30)
P, Z = "test-project", "us-central1-a"


@pytest.fixture
def fake():
    compute = FakeCompute(page_size=2).start()
    # names in one order, IPs whose string order differs (10.0.0.10 < 10.0.0.9 as text)
    compute.add_group(P, Z, "workers", {
        "worker-c": ("RUNNING", "10.0.0.2"), "worker-a": ("RUNNING", "10.0.0.9"),
        "worker-b": ("RUNNING", "10.0.0.10"), "worker-x": ("STOPPED", "10.0.0.7"),
        "worker-d": ("RUNNING", "10.0.0.3")})
    compute.add_group(P, Z, "empty", {"idle-a": ("TERMINATED", "10.0.1.2")})
    yield compute
    compute.stop()


def resolver(fake, group="workers", **kwargs):
    return GCEClusterResolver(P, Z, group, 8470, credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": fake.api_endpoint}, **kwargs)


def test_running_instances_sorted_as_tf_sorts_them_across_pages(fake):
    gce = resolver(fake)
    spec = gce.cluster_spec()
    # TF's worker_list.sort(): "ip:port" strings, so 10.0.0.10 before 10.0.0.2 and 10.0.0.9
    assert spec.as_dict() == {"worker": ["10.0.0.10:8470", "10.0.0.2:8470", "10.0.0.3:8470",
                                         "10.0.0.9:8470"]}
    lists = [r for r in fake.requests if r[1].endswith("/listInstances")]
    assert len(lists) == 2  # 4 RUNNING members, 2 per page: nextPageToken was followed
    assert lists[0][2]["instanceState"] == "RUNNING" and lists[1][2]["pageToken"] == "2"
    assert gce.master() == "grpc://10.0.0.10:8470"
    assert gce.master("worker", 3, rpc_layer="grpc+verbs") == "grpc+verbs://10.0.0.9:8470"
    assert (gce.task_type, gce.task_id, gce.environment) == ("worker", 0, "")


def test_cluster_is_queried_again_on_every_call(fake):
    gce = resolver(fake, task_type="ps", task_id=1, rpc_layer=None)
    assert gce.master() == "10.0.0.2:8470"
    fake.add_group(P, Z, "workers", {"worker-0": ("RUNNING", "10.0.0.1")})
    assert gce.cluster_spec().as_dict() == {"ps": ["10.0.0.1:8470"]}


def test_task_type_is_fixed_task_id_is_not(fake):
    gce = resolver(fake)
    with pytest.raises(RuntimeError, match="cannot reset the task_type"):
        gce.task_type = "ps"
    gce.task_id = 2
    assert gce.master() == "grpc://10.0.0.3:8470"


def test_an_empty_task_type_names_the_job_as_in_tf(fake):
    gce = resolver(fake, task_type="", task_id=1)
    assert gce.cluster_spec().as_dict() == {"": ["10.0.0.10:8470", "10.0.0.2:8470",
                                                 "10.0.0.3:8470", "10.0.0.9:8470"]}
    assert gce.task_type == "" and gce.master() == "grpc://10.0.0.2:8470"


def test_registered_as_gce_plugin(fake):
    spec = get_plugin_manager().resolver_spec("gce")
    gce = spec.factory(project=P, zone=Z, instance_group="workers", port=2222,
                       credentials=AnonymousCredentials(),
                       client_options={"api_endpoint": fake.api_endpoint})
    assert gce.cluster_spec().num_tasks("worker") == 4


def test_empty_group_is_not_found(fake):
    with pytest.raises(errors.NotFoundError, match="no RUNNING instance"):
        resolver(fake, group="empty").cluster_spec()


def test_unknown_group_is_not_found(fake):
    with pytest.raises(errors.NotFoundError, match="HTTP 404"):
        resolver(fake, group="nope").cluster_spec()


@pytest.mark.parametrize(("status", "error", "where", "text"), [
    (403, errors.PermissionDeniedError, "/listInstances", "HTTP 403"),
    # google-auth answers a 401 by refreshing the token, which anonymous credentials cannot
    (401, errors.UnauthenticatedError, "/listInstances", "cannot be refreshed"),
    (503, errors.UnavailableError, "/listInstances", "HTTP 503"),
    (500, errors.UnavailableError, "/instances/worker-a", "HTTP 500"),
    (400, errors.InvalidArgumentError, "/instances/worker-a", "HTTP 400"),
])
def test_api_errors_map_to_clusterwire_errors(fake, status, error, where, text):
    fake.fail_with[where] = status
    with pytest.raises(error, match=text):
        resolver(fake).cluster_spec()


def test_unreachable_endpoint_is_unavailable(fake):
    gce = resolver(fake)
    fake.stop()
    with pytest.raises(errors.UnavailableError):
        gce.cluster_spec()
    fake.start()  # the fixture stops it again
