"""AWSClusterResolver against moto's EC2 server on 127.0.0.1 (in-process ThreadedMotoServer).

The instances' private IPs are moto's inventions: the tests compare strings and
never connect to them.
"""

from __future__ import annotations

import uuid

import pytest
from aws_moto import moto_endpoint, point_aws_at

from clusterwire import errors
from clusterwire.plugins import get_plugin_manager

boto3 = pytest.importorskip("boto3", reason="pip install 'clusterwire[aws]'")
pytest.importorskip("moto.server", reason="pip install 'moto[server]'")
from botocore.stub import Stubber  # noqa: E402

from clusterwire.resolvers import AWSClusterResolver  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def moto_url():
    with moto_endpoint() as url:
        yield url


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, moto_url):
    """The usual boto3 configuration, pointed at moto: the resolver gets no endpoint argument."""
    point_aws_at(monkeypatch, moto_url)


@pytest.fixture
def ec2():
    return boto3.client("ec2")


@pytest.fixture(scope="module")
def image_id(moto_url):
    client = boto3.client("ec2", endpoint_url=moto_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return client.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]


@pytest.fixture
def cluster_tag():
    return f"exp-{uuid.uuid4().hex[:8]}"  # isolates each test's instances on the shared server


@pytest.fixture
def launch(ec2, image_id):
    """``launch(cluster, count=1, **tags)``: start instances (one reservation each)."""

    def start(cluster: str, count: int = 1, **tags: str) -> list[dict]:
        tag_list = [{"Key": "cluster", "Value": cluster}] + [
            {"Key": k, "Value": v} for k, v in tags.items()]
        return [ec2.run_instances(ImageId=image_id, MinCount=1, MaxCount=1, TagSpecifications=[
            {"ResourceType": "instance", "Tags": tag_list}])["Instances"][0]
            for _ in range(count)]

    return start


def test_jobs_and_indices_from_tags_running_only(ec2, launch, cluster_tag):
    ps = launch(cluster_tag, job="ps", task="0")[0]
    workers = [launch(cluster_tag, job="worker", task=str(i))[0] for i in (2, 0, 1)]
    stopped = launch(cluster_tag, job="worker", task="3")[0]
    ec2.stop_instances(InstanceIds=[stopped["InstanceId"]])
    launch("other-" + cluster_tag, job="worker", task="9")
    aws = AWSClusterResolver({"cluster": cluster_tag}, port=2222, task_type="worker", task_id=1)
    by_index = {int(t["Value"]): w["PrivateIpAddress"] for w in workers
                for t in w["Tags"] if t["Key"] == "task"}
    assert aws.cluster_spec().as_dict() == {
        "ps": [f"{ps['PrivateIpAddress']}:2222"],
        "worker": [f"{by_index[i]}:2222" for i in range(3)]}
    assert aws.master() == f"grpc://{by_index[1]}:2222"
    assert aws.master("ps", 0, rpc_layer="grpc+verbs") == f"grpc+verbs://{ps['PrivateIpAddress']}:2222"


def test_without_index_tags_tasks_follow_name_order_and_own_instance(launch, cluster_tag):
    names = ["node-b", "node-c", "node-a"]
    launched = {name: launch(cluster_tag, Name=name)[0] for name in names}
    aws = AWSClusterResolver({"cluster": cluster_tag}, job_tag=None, default_job="worker",
                             instance_id=launched["node-b"]["InstanceId"], page_size=5)
    spec = aws.cluster_spec()
    assert spec.as_dict() == {"worker": [f"{launched[n]['PrivateIpAddress']}:8470"
                                         for n in sorted(names)]}
    assert (aws.task_type, aws.task_id) == ("worker", 1)  # found its own instance id


def test_every_page_is_read(launch, cluster_tag):
    launch(cluster_tag, 7, job="worker")
    aws = AWSClusterResolver({"cluster": cluster_tag}, page_size=5)
    assert aws.cluster_spec().num_tasks("worker") == 7


def test_registered_as_aws_plugin(launch, cluster_tag):
    launch(cluster_tag, job="chief", task="0")
    aws = get_plugin_manager().resolver_spec("aws").factory(filters={"cluster": cluster_tag})
    assert aws.cluster_spec().jobs == ["chief"]


def test_no_matching_instance_is_not_found(cluster_tag):
    with pytest.raises(errors.NotFoundError, match=cluster_tag):
        AWSClusterResolver({"cluster": cluster_tag}).cluster_spec()


def test_bad_tags_are_invalid_arguments(launch, cluster_tag):
    launch(cluster_tag, 2, job="worker", task="0")
    with pytest.raises(errors.InvalidArgumentError, match="index 0 is claimed by"):
        AWSClusterResolver({"cluster": cluster_tag}).cluster_spec()
    other = cluster_tag + "-x"
    launch(other, job="worker", task="first")
    with pytest.raises(errors.InvalidArgumentError, match="must be an integer"):
        AWSClusterResolver({"cluster": other}).cluster_spec()


def test_unknown_own_instance_is_not_found(launch, cluster_tag):
    launch(cluster_tag, job="worker")
    with pytest.raises(errors.NotFoundError, match="i-00000000"):
        AWSClusterResolver({"cluster": cluster_tag}, instance_id="i-00000000").cluster_spec()


@pytest.mark.parametrize(("code", "status", "error"), [
    ("UnauthorizedOperation", 403, errors.PermissionDeniedError),
    ("AuthFailure", 401, errors.UnauthenticatedError),
    ("RequestLimitExceeded", 503, errors.UnavailableError),
    ("InternalError", 500, errors.UnavailableError),
    ("InvalidParameterValue", 400, errors.InvalidArgumentError),
])
def test_api_errors_map_to_clusterwire_errors(ec2, code, status, error):
    # botocore's own Stubber answers the call the way EC2 does for that error
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_instances", service_error_code=code,
                              service_message=f"{code} from EC2", http_status_code=status)
        with pytest.raises(error, match=code):
            AWSClusterResolver({"cluster": "x"}, client=ec2).cluster_spec()


def test_unreachable_endpoint_is_unavailable(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: refused
    with pytest.raises(errors.UnavailableError, match="DescribeInstances"):
        AWSClusterResolver({"cluster": "x"}).cluster_spec()


def test_missing_region_is_an_invalid_argument(monkeypatch):
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.delenv("AWS_REGION", raising=False)
    with pytest.raises(errors.InvalidArgumentError, match="AWS_DEFAULT_REGION"):
        AWSClusterResolver({"cluster": "x"}).cluster_spec()
