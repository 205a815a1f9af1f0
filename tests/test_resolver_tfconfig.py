"""TFConfigClusterResolver over TensorFlow's documented TF_CONFIG cases."""

from __future__ import annotations

import json

import pytest

from clusterwire import ClusterSpec, errors
from clusterwire.resolvers import TFConfigClusterResolver

CLUSTER = {"ps": ["ps0:2222", "ps1:2222"],
           "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]}


@pytest.fixture
def tf_config(monkeypatch):
    """``tf_config(value)``: set TF_CONFIG (a dict is dumped as JSON)."""
    monkeypatch.delenv("TF_CONFIG", raising=False)

    def set_config(value) -> None:
        monkeypatch.setenv("TF_CONFIG", value if isinstance(value, str) else json.dumps(value))

    return set_config


def test_normal_cluster_spec_read(tf_config):
    tf_config({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec(CLUSTER)
    assert resolver.master() == "ps0:2222"
    assert resolver.master("worker", 1) == "worker1:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, None)


def test_session_master_wins_and_gets_no_prefix(tf_config):
    tf_config({"cluster": CLUSTER, "task": {"type": "ps", "index": 0},
               "session_master": "sessionmaster:2222", "rpc_layer": "grpc"})
    assert TFConfigClusterResolver().master() == "sessionmaster:2222"


def test_rpc_layer_read_and_overridden(tf_config):
    tf_config({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}, "rpc_layer": "grpc"})
    assert TFConfigClusterResolver().master() == "grpc://ps0:2222"
    assert TFConfigClusterResolver(rpc_layer="grpc+verbs").master() == "grpc+verbs://ps0:2222"
    assert TFConfigClusterResolver().master(rpc_layer="zmq") == "zmq://ps0:2222"


def test_parameters_override_tf_config_and_setters_work(tf_config):
    tf_config({"cluster": CLUSTER, "task": {"type": "ps", "index": "1"}})
    resolver = TFConfigClusterResolver(task_type="worker", task_id=2, rpc_layer="grpc")
    assert resolver.master() == "grpc://worker2:2222"
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "ps", 0, None
    assert resolver.master() == "ps0:2222"
    assert TFConfigClusterResolver().task_id == 1  # the string index is cast to int
    assert TFConfigClusterResolver(task_id=0).task_id == 0


def test_read_on_every_call(tf_config):
    resolver = TFConfigClusterResolver()
    tf_config({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})
    assert resolver.master() == "b:1"
    tf_config({"cluster": {"chief": ["c:1"], "worker": ["a:1"]},
               "task": {"type": "chief", "index": 0}})
    assert resolver.master() == "c:1"


def test_empty_or_single_task_cluster_has_no_master(tf_config):
    assert TFConfigClusterResolver().master() == ""
    assert TFConfigClusterResolver().cluster_spec() == ClusterSpec({})
    tf_config({"cluster": {"worker": ["worker0:2222"]}, "task": {"type": "worker", "index": 0}})
    assert TFConfigClusterResolver().master() == ""


def test_sparse_cluster_and_environment_key_not_read(tf_config):
    tf_config({"cluster": {"ps": {"0": "ps0:2222", "3": "ps3:2222"}},
               "task": {"type": "ps", "index": 3}, "environment": "google"})
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"ps": {0: "ps0:2222", 3: "ps3:2222"}}
    assert resolver.master() == "ps3:2222"
    assert resolver.environment is None
    assert TFConfigClusterResolver(environment="google").environment == "google"


def test_no_task_raises_as_tf_does(tf_config):
    tf_config({"cluster": CLUSTER})
    with pytest.raises(ValueError, match="No such job in cluster: None"):
        TFConfigClusterResolver().master()


@pytest.mark.parametrize(("value", "text"), [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ("[1, 2]", "TF_CONFIG must be a JSON object"),
    ({"task": "worker"}, '"task" must be an object'),
    ({"cluster": {"worker": ["no-port"]}}, 'TF_CONFIG: invalid "cluster"'),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "x"}},
     '"task.index" must be an integer'),
])
def test_malformed_tf_config_names_it(tf_config, value, text):
    tf_config(value)
    with pytest.raises(ValueError, match=text) as info:
        resolver = TFConfigClusterResolver()
        resolver.cluster_spec()
        resolver.task_id  # noqa: B018
    assert isinstance(info.value, errors.InvalidArgumentError)


def test_unknown_job_or_index_is_a_value_error(tf_config):
    tf_config({"cluster": CLUSTER, "task": {"type": "evaluator", "index": 0}})
    with pytest.raises(ValueError, match="No such job in cluster: 'evaluator'"):
        TFConfigClusterResolver().master()
    with pytest.raises(ValueError, match="No task with index 7 in job 'worker'"):
        TFConfigClusterResolver().master("worker", 7)
