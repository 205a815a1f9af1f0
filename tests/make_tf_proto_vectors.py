"""Regenerates tests/fixtures/tf_protos/server_defs.json with TensorFlow:
``/path/to/tf-venv/bin/python tests/make_tf_proto_vectors.py`` (written with TF 2.21).

Each vector is a ServerDef built with TensorFlow's own protos and serialized as TF does
deterministically (``SerializeToString(deterministic=True)``); test_protos.py checks that
clusterwire parses each and serializes it back to the same bytes (CI has no TensorFlow).
"""

from __future__ import annotations

import json
import pathlib

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, tensorflow_server_pb2

OUT = pathlib.Path(__file__).parent / "fixtures" / "tf_protos" / "server_defs.json"


def _modelled() -> tensorflow_server_pb2.ServerDef:
    """Fields clusterwire reads, maps filled in an unsorted order."""
    server_def = tensorflow_server_pb2.ServerDef(job_name="worker", task_index=1,
                                                 protocol="grpc", port=2222, replica=3)
    job = server_def.cluster.job.add(name="worker")
    job.tasks[1] = "10.0.0.2:2222"
    job.tasks[0] = "10.0.0.1:2222"
    config = server_def.default_session_config
    for device, count in (("GPU", 2), ("CPU", 8), ("TPU", 1)):
        config.device_count[device] = count
    config.intra_op_parallelism_threads = 4
    config.inter_op_parallelism_threads = 8
    config.placement_period = 5
    config.device_filters.extend(["/job:ps", "/job:worker"])
    config.allow_soft_placement = True
    config.log_device_placement = True
    config.use_per_session_threads = True
    config.operation_timeout_in_ms = 60_000
    return server_def


def _every_field() -> tensorflow_server_pb2.ServerDef:
    """Every ConfigProto field of TF's, including the messages clusterwire holds as bytes."""
    server_def = _modelled()
    config = server_def.default_session_config
    config.gpu_options.allow_growth = True
    config.gpu_options.per_process_gpu_memory_fraction = 0.5
    config.graph_options.build_cost_model = 2
    config.graph_options.optimizer_options.do_common_subexpression_elimination = True
    config.session_inter_op_thread_pool.add(num_threads=2, global_name="a")
    config.session_inter_op_thread_pool.add()
    config.rpc_options.use_rpc_for_inprocess_master = True
    job = config.cluster_def.job.add(name="ps")
    job.tasks[3] = "h3:1"
    job.tasks[1] = "h1:1"
    config.isolate_session_state = True
    config.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
    config.share_cluster_devices_in_session = True
    config.pluggable_device_options.visible_device_list = "0"
    server_def.cluster_device_filters.jobs.add(name="worker").tasks[0].device_filters.append(
        "/job:ps")
    return server_def


def _empty_messages() -> tensorflow_server_pb2.ServerDef:
    """Messages TF has set but left empty (written as a field of length 0)."""
    server_def = tensorflow_server_pb2.ServerDef(job_name="ps", protocol="grpc")
    config = server_def.default_session_config
    config.gpu_options.SetInParent()
    config.experimental.SetInParent()
    return server_def


def _config_only() -> config_pb2.ConfigProto:
    return _every_field().default_session_config


def main() -> None:
    vectors = {
        "tensorflow_version": tf.__version__,
        "server_defs": {name: build().SerializeToString(deterministic=True).hex()
                        for name, build in (("modelled", _modelled),
                                            ("every_field", _every_field),
                                            ("empty_messages", _empty_messages))},
        "config_protos": {"every_field": _config_only().SerializeToString(
            deterministic=True).hex()},
    }
    OUT.write_text(json.dumps(vectors, indent=1) + "\n")


if __name__ == "__main__":
    main()
