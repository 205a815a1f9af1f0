"""SlurmClusterResolver without a Slurm: TF's hostlist, tasks-per-node and environment cases.

The environment is set as a Slurm step sets it (the values are the ones TF's own
tests use and the ones observed on a real Slurm 22.05).
"""

from __future__ import annotations

import os

import pytest

from clusterwire import errors
from clusterwire.resolvers import SlurmClusterResolver
from clusterwire.resolvers.hostlist import expand_hostlist, expand_tasks_per_node
from clusterwire.resolvers.slurm import task_layout

SLURM_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
              "SLURM_STEP_TASKS_PER_NODE", "SLURM_DISTRIBUTION", "SLURM_DIST_PLANESIZE",
              "SLURM_NODEID", "SLURM_GTIDS", "SLURM_LOCALID", "SLURM_GPUS_ON_NODE",
              "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def step(monkeypatch):
    """``step(**variables)``: this process looks like one task of a Slurm step."""
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_vars(**variables: str) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_vars


@pytest.mark.parametrize(("hostlist", "hosts"), [
    ("n1", ["n1"]),
    ("n[1,3]", ["n1", "n3"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
    ("n[0001-0003],m5,o[009-011]", ["n0001", "n0002", "n0003", "m5", "o009", "o010", "o011"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n[1-2]-ib,login", ["n1-ib", "n2-ib", "login"]),
    ("127.0.0.[2-3]", ["127.0.0.2", "127.0.0.3"]),
    ("", []),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[a-b]", "n[3-1]", "n[[1]]", "n1,,n2", "n[]"])
def test_malformed_hostlist_is_a_value_error(bad):
    with pytest.raises(ValueError, match="Invalid hostlist format") as info:
        expand_hostlist(bad)
    assert isinstance(info.value, errors.InvalidArgumentError)


@pytest.mark.parametrize(("text", "counts"), [
    ("2", [2]), ("2,1,3", [2, 1, 3]), ("3(x2),2,1", [3, 3, 2, 1]),
    ("3(x2),2,11(x4)", [3, 3, 2, 11, 11, 11, 11]), ("13(x10)", [13] * 10),
    ("2(x3),1", [2, 2, 2, 1]),
])
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("bad", ["", "2(x)", "x", "2(3)", "2,,1"])
def test_malformed_tasks_per_node_is_a_value_error(bad):
    with pytest.raises(ValueError, match="Invalid tasks-per-node list format"):
        expand_tasks_per_node(bad)


def test_task_layouts_follow_slurm_distributions():
    assert task_layout([2, 2, 1]) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    # observed: srun -N3 -n6 -m cyclic on 4-CPU nodes gave 4,1(x2) and ranks 0,3,4,5 on node 0
    assert task_layout([4, 1, 1], "cyclic") == [(0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (0, 3)]
    assert task_layout([2, 2, 2], "cyclic:block") == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1),
                                                      (2, 1)]
    assert task_layout([4, 4], "plane", 2) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3),
                                               (1, 2), (1, 3)]
    with pytest.raises(RuntimeError, match="arbitrary"):
        task_layout([1, 1], "arbitrary")


def test_simple_retrieval_from_env(step):
    step(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="1(x3)",
         SLURM_STEP_NODELIST="t02n13,t02n41,t02n43", CUDA_VISIBLE_DEVICES="0")
    resolver = SlurmClusterResolver()
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["t02n13:8888", "t02n41:8888", "t02n43:8888"]}
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert resolver.num_accelerators() == {"GPU": 1}
    assert resolver.get_task_info() == ("worker", 0)


def test_jobs_in_sorted_order_with_several_tasks_per_node(step, monkeypatch):
    step(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="2(x2),1",
         SLURM_STEP_NODELIST="t02n13,t02n41,t02n43", CUDA_VISIBLE_DEVICES="0,1")
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 2, "evaluator": 2}, port_base=8888,
                                    auto_set_gpu=True, rpc_layer="grpc")
    assert resolver.cluster_spec().as_dict() == {
        "evaluator": ["t02n13:8888", "t02n13:8889"], "ps": ["t02n41:8888"],
        "worker": ["t02n41:8889", "t02n43:8888"]}
    assert (resolver.task_type, resolver.task_id) == ("evaluator", 1)
    assert resolver.master() == "grpc://t02n13:8889"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"  # second task on its node: second GPU


def test_several_gpus_per_task(step):
    step(SLURM_PROCID="3", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)",
         SLURM_STEP_NODELIST="t02n13,t02n41", CUDA_VISIBLE_DEVICES="0,1,2,3")
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 3})
    assert resolver.cluster_spec().as_dict() == {
        "ps": ["t02n13:8888"], "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889"]}
    assert resolver.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_cpu_only_nodes_work(step):
    # TF: range() arg 3 must not be zero / FileNotFoundError for nvidia-smi
    step(SLURM_PROCID="2", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="3",
         SLURM_STEP_NODELIST="localhost", PATH="/nonexistent")
    resolver = SlurmClusterResolver()
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["localhost:8888", "localhost:8889", "localhost:8890"]}
    assert resolver.num_accelerators() == {}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert SlurmClusterResolver(gpus_per_node=0).num_accelerators() == {}


def test_more_tasks_than_gpus_keeps_every_task(step):
    step(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="3",
         SLURM_STEP_NODELIST="n1", CUDA_VISIBLE_DEVICES="0,1")
    resolver = SlurmClusterResolver()
    assert resolver.cluster_spec().num_tasks("worker") == 3  # TF drops the third
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_slurm_per_task_gpu_binding_is_kept(step):
    # srun --gpus-per-task=1 -n2: task 1 sees only its GPU "1" of the node's 2
    step(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2",
         SLURM_STEP_NODELIST="n1", CUDA_VISIBLE_DEVICES="1", SLURM_GPUS_ON_NODE="2")
    resolver = SlurmClusterResolver()
    resolver.cluster_spec()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert resolver.num_accelerators() == {"GPU": 1}


def test_cyclic_placement_uses_the_real_layout(step):
    # srun -N2 -n4 -m cyclic: rank 1 runs on node n2 as its first task
    step(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)",
         SLURM_STEP_NODELIST="n[1-2]", SLURM_DISTRIBUTION="cyclic", SLURM_NODEID="1",
         SLURM_GTIDS="1,3", SLURM_LOCALID="0", CUDA_VISIBLE_DEVICES="")
    resolver = SlurmClusterResolver()
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["n1:8888", "n2:8888", "n1:8889", "n2:8889"]}
    assert resolver.master() == "grpc://n2:8888"


def test_a_layout_that_contradicts_the_task_fails_loudly(step):
    step(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)",
         SLURM_STEP_NODELIST="n[1-2]", SLURM_DISTRIBUTION="block", SLURM_NODEID="1",
         SLURM_GTIDS="1,3", SLURM_LOCALID="0")
    with pytest.raises(RuntimeError, match="SLURM_NODEID=1") as info:
        SlurmClusterResolver()
    assert isinstance(info.value, errors.FailedPreconditionError)


def test_node_order_is_slurms_not_sorted_names(step):
    step(SLURM_PROCID="2", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="1(x3)",
         SLURM_STEP_NODELIST="n[9-11]", SLURM_NODEID="2", SLURM_GTIDS="2")
    resolver = SlurmClusterResolver(gpus_per_node=0)
    assert resolver.cluster_spec().as_dict() == {"worker": ["n9:8888", "n10:8888", "n11:8888"]}
    assert resolver.master() == "grpc://n11:8888"


def test_explicit_tasks_per_node(step):
    step(SLURM_PROCID="2", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_NODELIST="a,b")
    resolver = SlurmClusterResolver(tasks_per_node=2, gpus_per_node=0)
    assert resolver.cluster_spec().as_dict() == {"worker": ["a:8888", "a:8889", "b:8888",
                                                            "b:8889"]}
    step(SLURM_PROCID="0")
    by_host = SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, tasks_per_node={"x": 1, "y": 2},
                                   gpus_per_node=0, port_base=2000)
    assert by_host.cluster_spec().as_dict() == {"ps": ["x:2000"], "worker": ["y:2000", "y:2001"]}


def test_outside_a_step_is_a_clear_runtime_error(step):
    with pytest.raises(RuntimeError, match="SLURM_PROCID not found in environment. Not running "
                                           "inside a SLURM step"):
        SlurmClusterResolver()
    step(SLURM_PROCID="0")  # a batch script has SLURM_PROCID but no step variables
    with pytest.raises(RuntimeError, match="SLURM_STEP_NODELIST not found"):
        SlurmClusterResolver()


def test_jobs_that_do_not_match_the_step(step):
    step(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2",
         SLURM_STEP_NODELIST="n1")
    with pytest.raises(RuntimeError, match="Requested 3 tasks but only 2 were assigned"):
        SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, gpus_per_node=0)
    with pytest.raises(ValueError, match="jobs"):
        SlurmClusterResolver(jobs={"worker": "2"}, gpus_per_node=0)
    with pytest.raises(RuntimeError, match="more GPUs per node than available"):
        SlurmClusterResolver(gpus_per_node=2, gpus_per_task=2)
    step(SLURM_STEP_TASKS_PER_NODE="1(x2)")
    with pytest.raises(ValueError, match="names 1 nodes"):
        SlurmClusterResolver(gpus_per_node=0)
