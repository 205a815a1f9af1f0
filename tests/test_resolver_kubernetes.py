"""KubernetesClusterResolver against a local HTTP server speaking the pod-list endpoints.

No Kubernetes API server can run on this machine (none is packaged for Debian 12 or
PyPI); the fake answers ``GET /api/v1/pods`` and ``/api/v1/namespaces/NS/pods`` with
equality label selectors, as the official client calls them.
"""

from __future__ import annotations

import pytest

from clusterwire import errors

kubernetes = pytest.importorskip("kubernetes", reason="pip install 'clusterwire[kubernetes]'")
from fake_http import JsonServer  # noqa: E402

from clusterwire.resolvers import KubernetesClusterResolver  # noqa: E402
from clusterwire.resolvers.kubernetes import ExecutableLocation  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def pod(name, phase="Running", pod_ip="10.1.0.1", host_ip="10.0.0.1", namespace="default",
        **labels):
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels},
            "status": {"phase": phase, "podIP": pod_ip, "hostIP": host_ip}}


class FakeKubernetes:
    """Pods in memory; ``status`` makes every request answer that HTTP status instead."""

    def __init__(self, pods):
        self.pods, self.status = pods, 200
        self.server = JsonServer(self.route).start()

    def route(self, method, path, query, body):
        if self.status != 200:
            return self.status, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "message": f"injected {self.status}", "code": self.status}
        wanted = dict(part.split("=", 1) for part in query.get("labelSelector", "").split(",")
                      if part)
        namespace = path.split("/")[4] if path.startswith("/api/v1/namespaces/") else None
        items = [p for p in self.pods
                 if wanted.items() <= p["metadata"]["labels"].items()
                 and namespace in (None, p["metadata"]["namespace"])]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}

    def client(self):
        config = kubernetes.client.Configuration()
        config.host = self.server.url
        return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))


@pytest.fixture
def fake():
    cluster = FakeKubernetes([
        pod("worker-1", pod_ip="10.1.0.11", job="tf", role="worker"),
        pod("worker-0", pod_ip="10.1.0.10", job="tf", role="worker"),
        pod("ps-0", pod_ip="10.1.0.20", job="tf", role="ps"),
        pod("other", pod_ip="10.1.0.30", namespace="team-b", job="tf", role="worker")])
    yield cluster
    cluster.server.stop()


def test_pods_by_selector_sorted_by_name(fake):
    resolver = KubernetesClusterResolver(
        {"ps": ["job=tf,role=ps"], "worker": ["job=tf,role=worker"]}, tf_server_port=2222,
        override_client=fake.client(), namespace="default", pod_name="worker-1")
    assert resolver.cluster_spec().as_dict() == {
        "ps": ["10.1.0.20:2222"], "worker": ["10.1.0.10:2222", "10.1.0.11:2222"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.master() == "grpc://10.1.0.11:2222"
    assert fake.server.requests[0][1] == "/api/v1/namespaces/default/pods"


def test_all_namespaces_default_mapping_and_host_ip(fake):
    fake.pods.append(pod("tf-0", host_ip="10.0.0.5", **{"job-name": "tensorflow"}))
    resolver = KubernetesClusterResolver(override_client=fake.client(), use_host_ip=True)
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.5:8470"]}
    assert resolver.master() == ""  # TF: no task of its own unless told
    assert resolver.master("worker", 0, rpc_layer="zmq") == "zmq://10.0.0.5:8470"


def test_kubeconfig_off_cluster(fake, tmp_path, monkeypatch):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters: [{{name: test, cluster: {{server: '{fake.server.url}'}}}}]\n"
        "users: [{name: test, user: {token: abc}}]\n"
        "contexts: [{name: test, context: {cluster: test, user: test}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    resolver = KubernetesClusterResolver({"worker": ["role=worker"]},
                                         executable_location=ExecutableLocation.OFF_CLUSTER)
    assert resolver.cluster_spec().num_tasks("worker") == 3


def test_in_cluster_config_missing_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(errors.FailedPreconditionError, match="WITHIN_CLUSTER"):
        KubernetesClusterResolver()


def test_pod_not_running_raises_as_tf(fake):
    fake.pods.append(pod("worker-2", phase="Pending", role="worker"))
    resolver = KubernetesClusterResolver({"worker": ["role=worker"]},
                                         override_client=fake.client())
    with pytest.raises(RuntimeError, match='Pod "worker-2" is not running; phase: "Pending"'):
        resolver.cluster_spec()


def test_no_pod_and_unknown_own_pod_are_not_found(fake):
    with pytest.raises(errors.NotFoundError, match="No pod matches"):
        KubernetesClusterResolver({"worker": ["role=nope"]},
                                  override_client=fake.client()).cluster_spec()
    with pytest.raises(errors.NotFoundError, match="'ghost'"):
        KubernetesClusterResolver({"worker": ["role=worker"]}, override_client=fake.client(),
                                  pod_name="ghost").cluster_spec()


@pytest.mark.parametrize(("status", "error"), [
    (403, errors.PermissionDeniedError), (401, errors.UnauthenticatedError),
    (404, errors.NotFoundError), (503, errors.UnavailableError)])
def test_api_errors_map_to_clusterwire_errors(fake, status, error):
    fake.status = status
    with pytest.raises(error, match=f"HTTP {status}"):
        KubernetesClusterResolver(override_client=fake.client()).cluster_spec()
