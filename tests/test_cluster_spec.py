"""ClusterSpec: TensorFlow's rules, and where clusterwire fixes TF's bugs."""

from __future__ import annotations

import pytest

from clusterwire import ClusterDef, ClusterSpec

DENSE = {"ps": ["ps0:2222", "ps1:2222"], "worker": ["w0:2222", "w1:2222", "w2:2222"]}


def test_dense_dict_round_trips():
    spec = ClusterSpec(DENSE)
    assert spec.as_dict() == DENSE
    assert spec.jobs == ["ps", "worker"]
    assert spec.num_tasks("worker") == 3
    assert spec.task_indices("ps") == [0, 1]
    assert spec.task_address("worker", 2) == "w2:2222"
    assert spec.job_tasks("ps") == ["ps0:2222", "ps1:2222"]


def test_sparse_dict_keeps_indices_and_pads_job_tasks():
    spec = ClusterSpec({"worker": {1: "w1:2222", 3: "w3:2222"}})
    assert spec.as_dict() == {"worker": {1: "w1:2222", 3: "w3:2222"}}
    assert spec.task_indices("worker") == [1, 3]
    assert spec.job_tasks("worker") == [None, "w1:2222", None, "w3:2222"]


def test_task_addresses_lists_every_task_by_job_then_index():
    spec = ClusterSpec({"worker": {3: "w3:1", 1: "w1:1"}, "ps": ["p0:1"], "idle": {}})
    assert list(spec.task_addresses().items()) == [
        (("worker", 1), "w1:1"), (("worker", 3), "w3:1"), (("ps", 0), "p0:1")]


def test_sparse_job_with_dense_indices_becomes_a_list():
    assert ClusterSpec({"w": {1: "b:1", 0: "a:1"}}).as_dict() == {"w": ["a:1", "b:1"]}


def test_string_indices_go_through_int_as_in_tf():
    assert ClusterSpec({"w": {"1": "a:1"}}).task_address("w", 1) == "a:1"
    with pytest.raises(ValueError):
        ClusterSpec({"w": {"x": "a:1"}})


def test_tuple_tasks_and_bytes_are_accepted():
    spec = ClusterSpec({b"w": (b"a:1", "b:2")})
    assert spec.as_dict() == {"w": ["a:1", "b:2"]}


def test_cluster_def_sorted_by_job_then_index():
    spec = ClusterSpec({"worker": {2: "c:1", 0: "a:1"}, "chief": ["x:1"]})
    cluster_def = spec.as_cluster_def()
    assert [j.name for j in cluster_def.job] == ["chief", "worker"]
    assert dict(cluster_def.job[1].tasks) == {0: "a:1", 2: "c:1"}
    assert spec.jobs == ["worker", "chief"]  # insertion order, as TF


def test_from_cluster_def_keeps_the_object_and_proto_order():
    cluster_def = ClusterDef()
    cluster_def.job.add(name="z").tasks[0] = "z:1"
    cluster_def.job.add(name="a").tasks[0] = "a:1"
    spec = ClusterSpec(cluster_def)
    assert spec.as_cluster_def() is cluster_def
    assert spec.jobs == ["z", "a"]


def test_from_cluster_spec_is_a_deep_copy():
    original = ClusterSpec(DENSE)
    copy = ClusterSpec(original)
    assert copy == original
    assert copy.as_cluster_def() is not original.as_cluster_def()
    copy.as_cluster_def().job[0].tasks[0] = "changed:1"
    assert original.task_address("ps", 0) == "ps0:2222"


@pytest.mark.parametrize("bad", [None, 3, "worker", ["a:1"], object()])
def test_other_inputs_raise_type_error(bad):
    with pytest.raises(TypeError, match="must be a dictionary"):
        ClusterSpec(bad)


def test_bad_task_container_raises_type_error():
    with pytest.raises(TypeError, match="tasks for job 'w' must be a list or a dictionary"):
        ClusterSpec({"w": "a:1"})


@pytest.mark.parametrize("address", [3, None, 2.5])
def test_non_string_address_raises_type_error(address):
    with pytest.raises(TypeError, match="must be bytes or unicode"):
        ClusterSpec({"w": [address]})


@pytest.mark.parametrize("index", [1.7, None, (1,)])
def test_non_integer_index_raises_type_error(index):
    with pytest.raises(TypeError, match="must be an integer"):
        ClusterSpec({"w": {index: "a:1"}})


def test_negative_index_raises_value_error():
    with pytest.raises(ValueError, match=">= 0"):
        ClusterSpec({"w": {-1: "a:1"}})


def test_non_string_job_name_raises_type_error():
    with pytest.raises(TypeError, match="Job name 1 must be bytes or unicode"):
        ClusterSpec({1: ["a:1"]})


@pytest.mark.parametrize("name", ["a/b", "1worker", "job:x", " ", "_x"])
def test_invalid_job_name_raises_value_error(name):
    with pytest.raises(ValueError, match="Invalid job name"):
        ClusterSpec({name: ["a:1"]})


def test_the_empty_job_name_is_accepted_as_in_tf():
    spec = ClusterSpec({"": ["a:1", "b:2"]})
    assert spec.jobs == [""] and spec.task_address("", 1) == "b:2"
    assert ClusterSpec(spec.as_cluster_def()) == spec


def test_no_server_serves_a_job_with_the_empty_name():
    from clusterwire import Server
    from clusterwire.errors import InvalidArgumentError

    # TF aborts the process here (Invalid device name: /job:/replica:0/task:0/device:CPU:0)
    with pytest.raises(InvalidArgumentError, match="A server needs a job name"):
        Server({"": ["127.0.0.1:0"]})


@pytest.mark.parametrize("address", ["", "host", "host:", "host:-1", "host:99999", "[::1",
                                     "::1:80", ":80", "host:8x"])
def test_empty_or_malformed_address_raises_value_error_naming_it(address):
    with pytest.raises(ValueError, match="Job 'w'") as info:
        ClusterSpec({"w": [address]})
    assert repr(address) in str(info.value)


@pytest.mark.parametrize("address", ["localhost:0", "127.0.0.1:65535", "[::1]:2222",
                                     "my-host.example.com:80"])
def test_valid_addresses(address):
    assert ClusterSpec({"w": [address]}).task_address("w", 0) == address


def test_unknown_job_and_index_raise_value_error_naming_them():
    spec = ClusterSpec(DENSE)
    with pytest.raises(ValueError, match="No such job in cluster: 'chief'"):
        spec.num_tasks("chief")
    with pytest.raises(ValueError, match="No such job in cluster: 'chief'"):
        spec.task_indices("chief")
    with pytest.raises(ValueError, match="No task with index 7 in job 'ps'"):
        spec.task_address("ps", 7)
    with pytest.raises(ValueError, match="No such job"):
        spec.job_tasks("chief")


def test_empty_job():
    spec = ClusterSpec({"w": []})
    assert bool(spec)
    assert spec.as_dict() == {"w": {}}
    assert spec.num_tasks("w") == 0
    assert spec.job_tasks("w") == []  # TF raises from max(); clusterwire does not


def test_bool():
    assert not ClusterSpec({})
    assert ClusterSpec({"w": ["a:1"]})


def test_equality_as_tf():
    assert ClusterSpec({"j": {0: "h:1"}}) == ClusterSpec({"j": ["h:1"]})
    assert ClusterSpec({"j": ["h:1"]}) == {"j": {0: "h:1"}}
    assert ClusterSpec({"j": ["h:1"]}) != {"j": ["h:1"]}
    assert ClusterSpec({"j": ["h:1"]}) != ClusterSpec({"j": ["h:2"]})
    with pytest.raises(TypeError):
        hash(ClusterSpec({}))


def test_repr_sorted_by_job_with_as_dict_values():
    spec = ClusterSpec({"worker": ["w:1"], "ps": {2: "p:1"}})
    assert repr(spec) == "ClusterSpec({'ps': {2: 'p:1'}, 'worker': ['w:1']})"
