"""The data service refuses what the operator did not allow: code, files, unauthenticated peers.

Each attack a red team ran against a dispatcher and a worker (real processes on 127.0.0.1) is
replayed here and must be refused with the right error, with nothing run and nothing read.
"""

from __future__ import annotations

import builtins
import itertools
import os
import subprocess
import sys

import cw_data_functions as fns
import numpy as np
import pytest
from conftest import tampered
from cw_data_procs import ServerProcess

from clusterwire import data, errors
from clusterwire.data.permissions import WorkerPermissions
from clusterwire.data.rpc import DispatcherClient, WorkerChannels
from clusterwire.protos.data_service_pb2 import (
    DataRequest,
    GetDatasetRequest,
    GetElementsRequest,
    GetOrCreateJobRequest,
    GetSplitRequest,
    StreamSpec,
    WorkerHeartbeatRequest,
    WorkerInfo,
)
from clusterwire.security import Security
from clusterwire.testing.load import process_usage

TOKEN = "data-service-test-token-0123456789"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A dispatcher and a worker process shared by the module's tests, which only read
    through them; the worker may read under ``allowed`` (a directory of its own) only."""
    allowed = tmp_path_factory.mktemp("allowed")
    servers = [ServerProcess("dispatcher")]
    try:
        servers.append(ServerProcess("worker", "--dispatcher-address", servers[0].address,
                                     "--import", "cw_data_functions",
                                     "--readable-dir", str(allowed)))
        yield servers[0], allowed
    finally:
        for server in servers:
            server.close()


def read(dataset, target, **kwargs):
    return list(dataset.apply(data.distribute("parallel_epochs", target, **kwargs)))


# ---- code: only what the operator allowed runs ---------------------------------------------

@pytest.mark.timeout(60)
def test_worker_refuses_dangerous_and_unallowed_functions(service, tmp_path):
    dispatcher, _ = service
    marker = tmp_path / "ran"
    command = f"touch {marker}"
    attacks = [
        data.Dataset.from_tensor_slices(np.array([command])).map(os.system),
        data.Dataset.from_tensor_slices(np.array(["1+1"])).filter(builtins.eval),
        data.Dataset.from_tensor_slices(np.array(["x=1"])).map(builtins.exec),
        data.Dataset.from_generator(subprocess.check_output, args=(["touch", str(marker)],)),
        data.Dataset.range(3).map(np.save),          # numpy, but not a ufunc: writes files
    ]
    for attack in attacks:
        with pytest.raises(errors.PermissionDeniedError, match="not allowed|never run"):
            read(attack, dispatcher.target)
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_worker_runs_registered_functions_and_numpy_ufuncs(service):
    dispatcher, _ = service
    dataset = data.Dataset.range(6).map(fns.square).filter(fns.is_even).map(np.negative)
    assert sorted(int(x) for x in read(dataset, dispatcher.target)) == [-16, -4, 0]


def test_references_through_an_allowed_module_do_not_reach_its_imports():
    permissions = WorkerPermissions(function_modules=["cw_data_functions"])
    assert permissions.function("cw_data_functions:square") is fns.square
    for name in ("cw_data_functions:os.system", "cw_data_functions:np.save",
                 "cw_data_functions:time.sleep", "cw_data_functions:__builtins__"):
        with pytest.raises(errors.PermissionDeniedError, match="not allowed"):
            permissions.function(name)


def test_a_request_never_imports_a_module():
    assert "this" not in sys.modules
    with pytest.raises(errors.PermissionDeniedError, match="not allowed"):
        WorkerPermissions().function("this:s")
    assert "this" not in sys.modules


@pytest.mark.parametrize("module", ["os", "subprocess", "builtins", "importlib.util", "pickle"])
def test_dangerous_modules_cannot_be_configured(module):
    with pytest.raises(errors.PermissionDeniedError, match="never run"):
        WorkerPermissions(function_modules=[module])
    with pytest.raises(errors.PermissionDeniedError, match="never run"):
        WorkerPermissions().function(f"{module}:anything")


def test_registration_rejects_lambdas_and_dangerous_modules():
    with pytest.raises(errors.InvalidArgumentError, match="module-level"):
        data.function(lambda x: x)
    with pytest.raises(errors.PermissionDeniedError, match="never run"):
        data.function(os.getcwd)


# ---- files: only under the configured directories ------------------------------------------

@pytest.mark.timeout(60)
def test_from_files_reads_only_under_readable_dirs(service, tmp_path):
    dispatcher, allowed = service
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret\n")
    (allowed / "link.txt").symlink_to(secret)
    (allowed / "ok.txt").write_text("a\nb\n")
    escapes = [str(secret), "/proc/self/environ", str(allowed / ".." / "secret.txt"),
               str(allowed / "link.txt")]
    for path in escapes:
        with pytest.raises(errors.PermissionDeniedError, match="readable_dirs"):
            read(data.Dataset.from_files([path]), dispatcher.target)
    assert read(data.Dataset.from_files([str(allowed / "ok.txt")]),
                dispatcher.target) == [b"a", b"b"]


def test_a_worker_without_readable_dirs_reads_no_file(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("x\n")
    with pytest.raises(errors.PermissionDeniedError, match="none are configured"):
        WorkerPermissions().path(str(path))


def test_readable_dirs_must_exist(tmp_path):
    with pytest.raises(errors.NotFoundError, match="not a directory"):
        WorkerPermissions(readable_dirs=[str(tmp_path / "missing")])


# ---- the token: nothing is read from a peer without it -------------------------------------

@pytest.fixture
def token_service(processes):
    """A dispatcher and a worker process that require the cluster token."""
    env = {"CLUSTERWIRE_AUTH_TOKEN": TOKEN}
    dispatcher = processes("dispatcher", env=env)
    worker = processes("worker", "--dispatcher-address", dispatcher.address,
                       "--import", "cw_data_functions", env=env)
    return dispatcher, worker


@pytest.mark.timeout(60)
def test_token_holders_read_and_others_are_refused(token_service, tmp_path, monkeypatch):
    dispatcher, worker = token_service
    monkeypatch.delenv("CLUSTERWIRE_AUTH_TOKEN", raising=False)
    dataset = data.Dataset.range(5).map(fns.square)
    with pytest.raises(errors.UnauthenticatedError, match="token"):
        read(dataset, dispatcher.target)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    assert sorted(int(x) for x in read(dataset, dispatcher.target,
                                       config={"auth_token_file": str(token_file)})) == [
        0, 1, 4, 9, 16]

    anonymous = DispatcherClient("grpc", dispatcher.address, 5.0, Security())
    forged = DataRequest(worker_heartbeat=WorkerHeartbeatRequest(
        worker=WorkerInfo(address="127.0.0.1:1", protocol="grpc")))
    try:
        for request in (forged, DataRequest(get_dataset=GetDatasetRequest(dataset_id="0"))):
            with pytest.raises(errors.UnauthenticatedError):
                anonymous.call(request)
    finally:
        anonymous.close()
    other = DispatcherClient("grpc", worker.address, 5.0, Security())
    try:
        with pytest.raises(errors.UnauthenticatedError):
            other.call(DataRequest(get_dataset=GetDatasetRequest(dataset_id="0")))
    finally:
        other.close()


# ---- streams: a worker serves only what the dispatcher granted -----------------------------

def _job_and_split(dispatcher, dataset_id: str, consumer: str):
    """Create a distributed_epoch job of ``dataset_id`` and take one split as ``consumer``."""
    client = DispatcherClient("grpc", dispatcher.target.split("://")[1], 10.0, Security())
    try:
        job, _ = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.DYNAMIC,
            job_key=f"job-{consumer}")))
        split, _ = client.call(DataRequest(get_split=GetSplitRequest(
            job_id=job.job.job_id, consumer_id=consumer)))
    finally:
        client.close()
    return job.job, split.get_split.split


def _read_stream(worker_address: str, spec: StreamSpec, consumer: str) -> int:
    """How many elements the stream ``spec`` gives ``consumer`` to its end."""
    channels = WorkerChannels(Security())
    received = 0
    try:
        for seq in itertools.count(1):
            response, _ = channels.call("grpc", worker_address, DataRequest(
                get_elements=GetElementsRequest(stream=spec, consumer_id=consumer,
                                                request_seq=seq, max_elements=100,
                                                wait_seconds=1.0)), 10.0)
            received += len(response.get_elements.elements)
            if response.get_elements.end_of_stream:
                return received
    finally:
        channels.close()


@pytest.mark.timeout(60)
def test_a_worker_serves_only_granted_streams():
    dispatcher = data.DispatchServer(port=0)
    worker = data.WorkerServer(port=0, dispatcher_address=dispatcher.target.split("://")[1])
    try:
        dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(100))
        assert len(dataset_id) == 32 and dataset_id != "1000"   # unguessable, not sequential
        job, split = _job_and_split(dispatcher, dataset_id, "alice")
        spec = StreamSpec(job_id=job.job_id, dataset_id=dataset_id, is_split=True,
                          split_id=split.split_id, unit_start=split.unit_start,
                          unit_end=split.unit_end, grant=split.grant, attempt=1)
        assert _read_stream(worker.address, spec, "alice") == split.unit_end - split.unit_start

        forgeries = {
            "another consumer": (spec, "mallory"),
            "a wider range": (tampered(spec, unit_end=spec.unit_end + 1000), "alice"),
            "an invented split": (tampered(spec, split_id=77, grant=b"\0" * 32), "alice"),
            "no grant": (tampered(spec, grant=b""), "alice"),
            "the job's grant for a split": (tampered(spec, grant=job.grant), "alice"),
            "another dataset": (tampered(StreamSpec(job_id=job.job_id, dataset_id="other"),
                                      grant=job.grant), "alice"),
        }
        for forged, consumer in forgeries.values():
            with pytest.raises(errors.PermissionDeniedError, match="did not grant"):
                _read_stream(worker.address, forged, consumer)
    finally:
        worker.stop()
        dispatcher.stop()


@pytest.mark.timeout(60)
def test_hostile_stream_requests_do_not_grow_a_worker(processes):
    """48 reads of invented splits of a huge shuffled dataset: the worker opens none of them
    (its RSS grows by less than 32 MiB) and keeps serving a granted read."""
    dispatcher = processes("dispatcher")
    worker = processes("worker", "--dispatcher-address", dispatcher.address)
    dataset_id = data.register_dataset(
        dispatcher.target, data.Dataset.range(10 ** 9).shuffle(1 << 20, seed=1))
    job, split = _job_and_split(dispatcher, dataset_id, "alice")
    before = process_usage(worker.process.pid)[0]
    for split_id in range(48):
        spec = StreamSpec(job_id=job.job_id, dataset_id=dataset_id, is_split=True,
                          split_id=1000 + split_id, unit_start=0, unit_end=10 ** 9,
                          grant=split.grant)
        with pytest.raises(errors.PermissionDeniedError):
            _read_stream(worker.address, spec, "alice")
    assert process_usage(worker.process.pid)[0] - before < 32 << 20
    small = list(data.Dataset.range(5).apply(data.distribute("distributed_epoch",
                                                             dispatcher.target)))
    assert sorted(int(x) for x in small) == [0, 1, 2, 3, 4]


def test_the_dispatcher_holds_a_bounded_number_of_datasets():
    """At the limit a new dataset takes the place of the oldest one no job used; when jobs
    used them all, it is refused."""
    with data.DispatchServer(data.DispatcherConfig(limits={"max_datasets": 2})) as dispatcher:
        first, second = (data.register_dataset(dispatcher.target, data.Dataset.range(n))
                         for n in (1, 2))
        assert data.register_dataset(dispatcher.target, data.Dataset.range(1)) == first
        third = data.register_dataset(dispatcher.target, data.Dataset.range(3))
        with pytest.raises(errors.ResourceExhaustedError, match=f"Dataset {first} was displaced"):
            list(data.from_dataset_id("parallel_epochs", dispatcher.target, first))
        client = DispatcherClient("grpc", dispatcher.target.split("://")[1], 10.0, Security())
        try:
            for dataset_id in (second, third):  # a job uses each
                client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
                    dataset_id=dataset_id, job_key=f"uses/{dataset_id}")))
        finally:
            client.close()
        with pytest.raises(errors.ResourceExhaustedError,
                           match="2 datasets, limits max_datasets.*shared fairly"):
            data.register_dataset(dispatcher.target, data.Dataset.range(4))


@pytest.mark.timeout(60)
def test_a_consumer_runs_a_bounded_number_of_streams_on_a_worker():
    dispatcher = data.DispatchServer(port=0)
    worker = data.WorkerServer(data.WorkerConfig(
        dispatcher_address=dispatcher.target.split("://")[1],
        limits={"max_streams_per_consumer": 1}))
    client = DispatcherClient("grpc", dispatcher.target.split("://")[1], 10.0, Security())
    channels = WorkerChannels(Security())
    try:
        dataset_id = data.register_dataset(dispatcher.target, data.Dataset.range(10 ** 6))
        job, _ = client.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.DYNAMIC, job_key="j")))
        specs, held = [], []
        for _ in range(2):
            answer, _ = client.call(DataRequest(get_split=GetSplitRequest(
                job_id=job.job.job_id, consumer_id="alice", held=held)))
            split = answer.get_split.split
            held.append(split.split_id)
            specs.append(StreamSpec(job_id=job.job.job_id, dataset_id=dataset_id,
                                    is_split=True, split_id=split.split_id,
                                    unit_start=split.unit_start, unit_end=split.unit_end,
                                    grant=split.grant, attempt=1))

        def first_batch(spec):
            return channels.call("grpc", worker.address, DataRequest(
                get_elements=GetElementsRequest(stream=spec, consumer_id="alice",
                                                request_seq=1, max_elements=1,
                                                wait_seconds=1.0)), 10.0)

        response, _ = first_batch(specs[0])
        assert len(response.get_elements.elements) == 1   # the first split runs on
        with pytest.raises(errors.ResourceExhaustedError, match="1 of them for this consumer"):
            first_batch(specs[1])
    finally:
        channels.close()
        client.close()
        worker.stop()
        dispatcher.stop()
