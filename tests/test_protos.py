"""ServerDef / ClusterDef / JobDef are wire-compatible with TensorFlow's protos.

The golden bytes below are encoded by hand from TensorFlow's .proto files
(tensorflow/core/protobuf/cluster.proto, tensorflow_server.proto,
config.proto), independently of clusterwire's generated code.
"""

from __future__ import annotations

from clusterwire import ClusterDef, ConfigProto, JobDef, ServerDef

TF_FIELDS = {
    JobDef: {"name": 1, "tasks": 2},
    ClusterDef: {"job": 1},
    ServerDef: {"cluster": 1, "job_name": 2, "task_index": 3, "default_session_config": 4,
                "protocol": 5, "port": 6, "cluster_device_filters": 7, "replica": 8},
    ConfigProto: {"device_count": 1, "intra_op_parallelism_threads": 2, "device_filters": 4,
                  "inter_op_parallelism_threads": 5, "allow_soft_placement": 7,
                  "log_device_placement": 8, "operation_timeout_in_ms": 11},
}


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def tf_server_def_bytes() -> bytes:
    task = field(1, 0) + field(2, b"10.0.0.1:2222")
    task1 = field(1, 1) + field(2, b"10.0.0.2:2222")
    job = field(1, b"worker") + field(2, task) + field(2, task1)
    cluster = field(1, job)
    gpu_options = field(4, 1)  # GPUOptions.allow_growth: not modelled by clusterwire
    config = field(2, 4) + field(5, 8) + field(6, gpu_options)
    return (field(1, cluster) + field(2, b"worker") + field(3, 1) + field(4, config)
            + field(5, b"grpc") + field(6, 2222) + field(8, 3))


def test_field_names_and_numbers_match_tensorflow():
    for message, expected in TF_FIELDS.items():
        fields = message.DESCRIPTOR.fields_by_name
        assert {name: fields[name].number for name in expected} == expected


def test_tensorflow_bytes_parse_in_clusterwire():
    server_def = ServerDef.FromString(tf_server_def_bytes())
    assert server_def.job_name == "worker"
    assert server_def.task_index == 1
    assert server_def.protocol == "grpc"
    assert server_def.port == 2222
    assert server_def.replica == 3
    assert dict(server_def.cluster.job[0].tasks) == {0: "10.0.0.1:2222", 1: "10.0.0.2:2222"}
    assert server_def.default_session_config.intra_op_parallelism_threads == 4
    assert server_def.default_session_config.inter_op_parallelism_threads == 8


def test_unknown_fields_survive_a_round_trip():
    original = tf_server_def_bytes() + field(9, 5)  # a field TF may add later
    reparsed = ServerDef.FromString(ServerDef.FromString(original).SerializeToString())
    again = reparsed.SerializeToString()
    assert field(6, field(4, 1)) in again  # ConfigProto.gpu_options kept in the nested message
    assert field(9, 5) in again


def test_clusterwire_bytes_parse_with_tensorflow_field_numbers():
    server_def = ServerDef(job_name="ps", task_index=2, protocol="grpc+verbs", port=7)
    server_def.cluster.job.add(name="ps").tasks[2] = "h:1"
    data = server_def.SerializeToString()
    for piece in (field(2, b"ps"), field(3, 2), field(5, b"grpc+verbs"), field(6, 7)):
        assert piece in data


def test_clusterwire_extensions_use_numbers_tensorflow_does_not():
    server_def = ServerDef()
    server_def.clusterwire_options.bind_address = "127.0.0.1"
    number = ServerDef.DESCRIPTOR.fields_by_name["clusterwire_options"].number
    assert number >= 1000
    tf_numbers = set(TF_FIELDS[ServerDef].values())
    assert not tf_numbers & {f.number for f in ServerDef.DESCRIPTOR.fields if
                             f.name not in TF_FIELDS[ServerDef]}
