"""UnionClusterResolver and SimpleClusterResolver over TensorFlow's documented cases."""

from __future__ import annotations

import pytest

from clusterwire import ClusterSpec, errors
from clusterwire.resolvers import (
    SimpleClusterResolver,
    UnionClusterResolver,
    UnionResolver,
)


def simple(cluster, **kwargs) -> SimpleClusterResolver:
    return SimpleClusterResolver(ClusterSpec(cluster), **kwargs)


def test_simple_resolver_master_and_rpc_layer():
    resolver = simple({"worker": ["w0:2222", "w1:2222"]}, master="m:1", task_type="worker",
                      task_id=1, environment="google", num_accelerators={"GPU": 8},
                      rpc_layer="grpc")
    assert resolver.master() == "grpc://m:1"
    assert resolver.master("worker", 0) == "grpc://w0:2222"
    assert resolver.master("worker", 1, rpc_layer="zmq") == "zmq://w1:2222"
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("worker", 1, "google")
    assert resolver.num_accelerators() == {"GPU": 8}
    assert simple({"w": ["a:1"]}).num_accelerators() == {}
    assert simple({"w": ["a:1"]}, rpc_layer="grpc").master() == "grpc://"  # as TF
    with pytest.raises(TypeError, match="cluster_spec must be"):
        SimpleClusterResolver(["a:1"])
    with pytest.raises(TypeError, match="master must be a string"):
        simple({"w": ["a:1"]}, master=5)


def test_union_alias_and_argument_checks():
    assert UnionResolver is UnionClusterResolver
    with pytest.raises(ValueError, match="At least one ClusterResolver is required"):
        UnionClusterResolver()
    with pytest.raises(TypeError, match="All arguments must be a sub-class"):
        UnionClusterResolver({"worker": ["a:1"]})
    with pytest.raises(ValueError, match="Unexpected kwargs provided"):
        UnionClusterResolver(simple({"w": ["a:1"]}), environment="x")


def test_lists_are_concatenated_in_resolver_order():
    union = UnionClusterResolver(simple({"worker": ["worker4:2222", "worker5:2222"]}),
                                 simple({"worker": ["worker0:2222", "worker1:2222"],
                                         "ps": ["ps0:2222"]}))
    assert union.cluster_spec().as_dict() == {
        "worker": ["worker4:2222", "worker5:2222", "worker0:2222", "worker1:2222"],
        "ps": ["ps0:2222"]}


def test_sparse_jobs_merge_and_lists_become_dicts():
    union = UnionClusterResolver(simple({"worker": ["w0:1", "w1:1"]}),
                                 simple({"worker": {3: "w3:1", 6: "w6:1"}}))
    assert union.cluster_spec().as_dict() == {"worker": {0: "w0:1", 1: "w1:1", 3: "w3:1",
                                                         6: "w6:1"}}
    sparse_only = UnionClusterResolver(simple({"worker": {1: "w1:1", 3: "w3:1"}}))
    assert sparse_only.cluster_spec().as_dict() == {"worker": {1: "w1:1", 3: "w3:1"}}


@pytest.mark.parametrize("first", [{"worker": {7: "a:1"}}, {"worker": ["a:1", "b:1"]}])
def test_duplicate_index_raises_key_error(first):
    union = UnionClusterResolver(simple(first), simple({"worker": {1: "c:1", 7: "d:1"}}))
    with pytest.raises(KeyError, match="Duplicate keys detected") as info:
        union.cluster_spec()
    assert isinstance(info.value, errors.InvalidArgumentError)


def test_task_and_master_come_from_the_first_resolver_unless_given():
    first = simple({"worker": ["w0:1"]}, master="first:1", task_type="worker", task_id=3,
                   rpc_layer="grpc", environment="google", num_accelerators={"GPU": 2})
    union = UnionClusterResolver(first, simple({"ps": ["p0:1"]}))
    assert (union.task_type, union.task_id, union.rpc_layer) == ("worker", 3, "grpc")
    assert union.master() == "grpc://first:1"
    assert union.master("ps", 0) == "grpc://p0:1"
    assert union.environment == "google" and union.num_accelerators() == {"GPU": 2}
    # TF falls through to the first resolver for task_id=0 (truthiness); clusterwire does not
    own = UnionClusterResolver(first, task_type="ps", task_id=0, rpc_layer="zmq")
    assert (own.task_type, own.task_id, own.rpc_layer) == ("ps", 0, "zmq")
