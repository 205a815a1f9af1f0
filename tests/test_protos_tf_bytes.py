"""ServerDef and its ConfigProto serialize to TensorFlow's bytes.

The vectors are TensorFlow 2.21's own deterministic serializations
(tests/make_tf_proto_vectors.py writes them with TF; CI has no TensorFlow).
"""

from __future__ import annotations

import json
import pathlib

from clusterwire import ClusterSpec, ConfigProto, ServerDef
from clusterwire.server_def import make_server_def

VECTORS = json.loads((pathlib.Path(__file__).parent / "fixtures" / "tf_protos"
                      / "server_defs.json").read_text())

#: tensorflow.ConfigProto's fields in TF 2.21 (name -> number).
TF_CONFIG_FIELDS = {
    "device_count": 1, "intra_op_parallelism_threads": 2, "placement_period": 3,
    "device_filters": 4, "inter_op_parallelism_threads": 5, "gpu_options": 6,
    "allow_soft_placement": 7, "log_device_placement": 8, "use_per_session_threads": 9,
    "graph_options": 10, "operation_timeout_in_ms": 11, "session_inter_op_thread_pool": 12,
    "rpc_options": 13, "cluster_def": 14, "isolate_session_state": 15, "experimental": 16,
    "share_cluster_devices_in_session": 17, "pluggable_device_options": 18,
}


def test_every_tensorflow_config_field_has_its_number():
    fields = ConfigProto.DESCRIPTOR.fields_by_name
    assert {name: field.number for name, field in fields.items()} == TF_CONFIG_FIELDS


def test_tensorflow_server_defs_serialize_back_to_tensorflows_bytes():
    for name, hex_bytes in VECTORS["server_defs"].items():
        tf_bytes = bytes.fromhex(hex_bytes)
        server_def = ServerDef.FromString(tf_bytes)
        assert server_def.SerializeToString(deterministic=True) == tf_bytes, name


def test_a_config_proto_alone_serializes_to_tensorflows_bytes():
    tf_bytes = bytes.fromhex(VECTORS["config_protos"]["every_field"])
    config = ConfigProto.FromString(tf_bytes)
    assert config.SerializeToString(deterministic=True) == tf_bytes
    assert config.isolate_session_state and config.share_cluster_devices_in_session
    assert dict(config.cluster_def.job[0].tasks) == {1: "h1:1", 3: "h3:1"}
    assert len(config.session_inter_op_thread_pool) == 2


def test_a_config_given_to_make_server_def_gives_tensorflows_bytes():
    config = ConfigProto(intra_op_parallelism_threads=4, inter_op_parallelism_threads=8,
                         placement_period=5, device_filters=["/job:ps", "/job:worker"],
                         allow_soft_placement=True, log_device_placement=True,
                         use_per_session_threads=True, operation_timeout_in_ms=60_000)
    for device, count in (("TPU", 1), ("GPU", 2), ("CPU", 8)):  # not TF's order
        config.device_count[device] = count
    server_def = make_server_def(
        ClusterSpec({"worker": {1: "10.0.0.2:2222", 0: "10.0.0.1:2222"}}), job_name="worker",
        task_index=1, protocol="grpc", config=config)
    server_def.port, server_def.replica = 2222, 3
    assert server_def.SerializeToString(deterministic=True) == bytes.fromhex(
        VECTORS["server_defs"]["modelled"])


def test_a_message_tensorflow_set_empty_is_still_written():
    server_def = ServerDef.FromString(bytes.fromhex(VECTORS["server_defs"]["empty_messages"]))
    config = server_def.default_session_config
    assert config.HasField("gpu_options") and config.gpu_options == b""
    assert not config.HasField("rpc_options")
