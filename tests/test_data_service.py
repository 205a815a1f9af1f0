"""The data service in one process: servers, config and argument errors, both modes, jobs."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter

import cw_data_functions as fns
import numpy as np
import pytest
from conftest import free_ports, wait_for

from clusterwire import data, errors
from clusterwire.data import elements
from clusterwire.plugins import get_plugin_manager

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def service(tmp_path):
    """A dispatcher and two workers in this process (from_files may read under tmp_path)."""
    dispatcher = data.DispatchServer(port=0)
    address = dispatcher.target.split("://")[1]
    workers = [data.WorkerServer(data.WorkerConfig(dispatcher_address=address,
                                                   readable_dirs=[str(tmp_path)]))
               for _ in range(2)]
    wait_for(lambda: dispatcher.num_workers() == 2, what="2 workers")
    yield dispatcher
    for worker in workers:
        worker.stop()
    dispatcher.stop()


def distributed(dataset, mode, target, **kwargs):
    return dataset.apply(data.distribute(processing_mode=mode, service=target, **kwargs))


def test_the_issue_example_verbatim(capsys):
    from clusterwire import data
    dispatcher = data.DispatchServer(port=0)
    dispatcher_address = dispatcher.target.split("://")[1]
    worker = data.WorkerServer(port=0, dispatcher_address=dispatcher_address)
    dataset = data.Dataset.range(10)
    dataset = dataset.apply(data.distribute(processing_mode="parallel_epochs",
                                            service=dispatcher.target))
    print(list(dataset.as_numpy_iterator()))   # [0, 1, ..., 9]
    worker.stop()
    dispatcher.stop()
    assert capsys.readouterr().out.strip() == str([np.int64(i) for i in range(10)])


def test_target_start_false_stop_frees_the_port_and_join_returns():
    dispatcher = data.DispatchServer(port=0, start=False)
    dispatcher.start()
    dispatcher.start()
    protocol, address = dispatcher.target.split("://")
    assert protocol == "grpc" and address.startswith("localhost:")
    port = int(address.rsplit(":", 1)[1])
    worker = data.WorkerServer(port=0, dispatcher_address=address, start=False)
    worker.start()
    assert dispatcher.num_workers() == 1
    worker.stop()
    worker.stop()
    assert worker.join(0)
    threading.Timer(0.05, dispatcher.stop).start()
    assert dispatcher.join(timeout=10)
    with socket.socket() as probe:  # free for a new server (SO_REUSEADDR: connections the
        # stopped dispatcher closed may leave TIME_WAIT entries on the port)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
    with pytest.raises(errors.FailedPreconditionError):
        dispatcher.start()


def test_tf_style_config_objects_and_errors():
    config = data.DispatcherConfig(port=0, job_gc_timeout_ms=0, worker_timeout_ms=None)
    assert (config.protocol, config.job_gc_timeout_ms, config.worker_timeout_ms) == ("grpc", 1, 0)
    with pytest.raises(ValueError, match="Cannot enable fault tolerant mode without configuring"):
        data.DispatchServer(data.DispatcherConfig(fault_tolerant_mode=True))
    with pytest.raises(ValueError, match="dispatcher_address"):
        data.WorkerServer(port=0)
    with pytest.raises(ValueError, match="dispatcher_address"):
        data.WorkerConfig()
    with pytest.raises(errors.NotFoundError, match="clusterwire\\[verbs\\]|grpc\\+verbs"):
        data.DispatchServer(port=0, protocol="no-such-protocol+verbs")
    with data.DispatchServer(data.DispatcherConfig(port=0)) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(data.WorkerConfig(dispatcher_address=address,
                                                 heartbeat_interval_ms=100)) as worker:
            assert worker.config.heartbeat_interval_ms == 100
            assert worker.address.startswith("localhost:")


@pytest.mark.parametrize("kwargs,message", [
    ({"processing_mode": "both"}, "processing mode should be a"),
    ({"compression": "gzip"}, "Invalid `compression` argument: gzip"),
    ({"service": ""}, "`service` must not be empty"),
    ({"service": "grpc://a://b:1"}, "multiple '://'"),
    ({"service": 5}, "`service` must be a string"),
    ({"job_name": ""}, "`job_name` must not be empty"),
    ({"num_consumers": 2, "consumer_index": 0}, "`job_name` must be set"),
    ({"job_name": "j", "consumer_index": 0}, "both `consumer_index` and `num_consumers`"),
    ({"target_workers": "SOME"}, "Invalid `target_workers`"),
])
def test_distribute_validates_its_arguments_like_tf(kwargs, message):
    arguments = {"processing_mode": "parallel_epochs", "service": "grpc://localhost:1", **kwargs}
    with pytest.raises(ValueError, match=message):
        data.distribute(**arguments)


def test_parallel_epochs_every_worker_produces_everything(service):
    ds = distributed(data.Dataset.range(50).map(fns.square), "parallel_epochs", service.target)
    assert Counter(int(x) for x in ds) == Counter({x * x: 2 for x in range(50)})


def test_distributed_epoch_each_element_exactly_once(service, tmp_path):
    ranges = distributed(data.Dataset.range(1000).filter(fns.is_even), "distributed_epoch",
                         service.target)
    assert sorted(int(x) for x in ranges) == list(range(0, 1000, 2))
    slices = distributed(data.Dataset.from_tensor_slices((np.arange(30), np.arange(30)))
                         .map(fns.add), "distributed_epoch", service.target)
    assert sorted(int(x) for x in slices) == [2 * i for i in range(30)]
    paths = []
    for index in range(5):
        paths.append(str(tmp_path / f"{index}.txt"))
        with open(paths[-1], "w") as handle:
            handle.write("".join(f"{index}-{line}\n" for line in range(4)))
    lines = distributed(data.Dataset.from_files(paths), "distributed_epoch", service.target)
    assert sorted(lines) == sorted(f"{i}-{j}".encode() for i in range(5) for j in range(4))


@pytest.fixture
def static_service(tmp_path):
    """A dispatcher configured with the addresses of its two workers (static sharding)."""
    ports = free_ports(2)
    dispatcher = data.DispatchServer(data.DispatcherConfig(
        port=0, worker_addresses=[f"localhost:{port}" for port in ports]))
    address = dispatcher.target.split("://")[1]
    workers = [data.WorkerServer(data.WorkerConfig(dispatcher_address=address, port=port,
                                                   readable_dirs=[str(tmp_path)]))
               for port in ports]
    wait_for(lambda: dispatcher.num_workers() == 2, what="2 workers")
    yield dispatcher
    for worker in workers:
        worker.stop()
    dispatcher.stop()


def text_files(directory, count=6, lines=5):
    paths = []
    for index in range(count):
        paths.append(str(directory / f"{index}.txt"))
        with open(paths[-1], "w") as handle:
            handle.write("".join(f"{index}-{line}\n" for line in range(lines)))
    return paths


@pytest.mark.parametrize("policy", [data.ShardingPolicy.FILE, data.ShardingPolicy.FILE_OR_DATA])
def test_file_sharding_reads_each_file_on_exactly_one_worker(static_service, tmp_path, policy):
    paths = text_files(tmp_path)
    lines = list(distributed(data.Dataset.from_files(paths), policy, static_service.target))
    assert Counter(lines) == Counter(f"{i}-{j}".encode() for i in range(6) for j in range(5))


@pytest.mark.parametrize("policy", [data.ShardingPolicy.DATA, data.ShardingPolicy.FILE_OR_DATA])
def test_data_sharding_produces_each_element_on_exactly_one_worker(static_service, policy):
    ds = distributed(data.Dataset.range(200).map(fns.square), policy, static_service.target)
    assert Counter(int(x) for x in ds) == Counter(x * x for x in range(200))


def test_static_sharding_needs_the_dispatcher_s_worker_addresses(service):
    with pytest.raises(errors.FailedPreconditionError, match="worker_addresses"):
        list(distributed(data.Dataset.range(10), data.ShardingPolicy.DATA, service.target))


def test_a_worker_built_from_a_config_keeps_the_runtime_default_intervals(service):
    address = service.target.split("://")[1]
    with data.WorkerServer(config=data.WorkerConfig(dispatcher_address=address),
                           port=0) as worker:
        assert worker.config.heartbeat_interval_ms == 0  # 0: the runtime default (30 s)
        assert worker._heartbeat_s == 30.0
        assert worker._dispatcher.timeout == 3600.0


def test_distributed_repeat_and_batches_and_reiteration(service):
    ds = distributed(data.Dataset.range(40).repeat(3).batch(8), "distributed_epoch",
                     service.target)
    first = [b.tolist() for b in ds]
    assert all(len(b) == 8 for b in first)  # splits are aligned to the batch size
    assert Counter(x for b in first for x in b) == Counter({x: 3 for x in range(40)})
    assert Counter(x for b in ds for x in b.tolist()) == Counter({x: 3 for x in range(40)})


def test_generator_sources_cannot_be_split(service):
    ds = data.Dataset.from_generator(fns.count_up, args=(4,))
    assert sorted(distributed(ds, "parallel_epochs", service.target)) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(errors.InvalidArgumentError, match="needs a splittable source"):
        list(distributed(ds, "distributed_epoch", service.target))


def test_shared_job_name_splits_one_job_and_each_iteration_is_a_new_job(service):
    first = distributed(data.Dataset.range(20), "distributed_epoch", service.target,
                        job_name="shared")
    second = distributed(data.Dataset.range(20), "distributed_epoch", service.target,
                         job_name="shared")
    assert [len(list(first)), len(list(second)), len(list(first)), len(list(second))] == [
        20, 0, 20, 0]
    a, b = iter(distributed(data.Dataset.range(200), "distributed_epoch", service.target,
                            job_name="together")), iter(
        distributed(data.Dataset.range(200), "distributed_epoch", service.target,
                    job_name="together"))
    seen = [next(a), next(b)]
    seen += list(a) + list(b)
    assert sorted(int(x) for x in seen) == list(range(200))
    with pytest.raises(errors.InvalidArgumentError, match="existing job with different"):
        list(distributed(data.Dataset.range(20), "parallel_epochs", service.target,
                         job_name="shared"))


def test_register_dataset_and_from_dataset_id(service):
    ds = data.Dataset.range(10).map(fns.square)
    dataset_id = data.register_dataset(service.target, ds)
    assert data.register_dataset(service.target, ds) == dataset_id
    # the same dataset with another compression is another registration (it is read differently)
    uncompressed = data.register_dataset(service.target, ds, compression=None)
    assert uncompressed != dataset_id
    assert data.register_dataset(service.target, ds, compression=None) == uncompressed
    assert data.register_dataset(service.target, ds, dataset_id="mine") == "mine"
    with pytest.raises(errors.InvalidArgumentError, match="same ID should have the same"):
        data.register_dataset(service.target, data.Dataset.range(3), dataset_id="mine")
    read = data.from_dataset_id("distributed_epoch", service.target, "mine")
    assert sorted(int(x) for x in read) == [x * x for x in range(10)]
    with pytest.raises(errors.NotFoundError, match="Dataset id nope not found"):
        data.from_dataset_id("parallel_epochs", service.target, "nope")


def test_round_robin_reads_take_rounds_from_the_workers_in_turn(service):
    def reader(index):
        ds = distributed(data.Dataset.range(1000).repeat(), "parallel_epochs", service.target,
                         job_name="rounds", consumer_index=index, num_consumers=2)
        return [int(x) for x in ds.take(12)]

    # round r comes from worker r mod 2, at position (r // 2) * 2 + consumer_index
    assert reader(0) == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    assert reader(1) == [1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11]


def test_round_robin_needs_an_infinite_dataset(service):
    ds = distributed(data.Dataset.range(5), "parallel_epochs", service.target, job_name="rr",
                     consumer_index=0, num_consumers=2)
    with pytest.raises(errors.FailedPreconditionError, match="infinite cardinality"):
        list(ds)


@pytest.mark.parametrize("compression", ["AUTO", "SNAPPY", None])
def test_compression_round_trips(service, compression):
    ds = distributed(data.Dataset.range(20).map(fns.fill_2k), "distributed_epoch",
                     service.target, compression=compression)
    got = sorted((int(x[0]), x.shape, x.dtype.str) for x in ds)
    assert got == [(i, (256,), "<i8") for i in range(20)]


def test_auto_shrinks_compressible_elements_with_lz4_and_skips_random_ones():
    values = np.arange(1 << 13) // 7
    compressible = elements.encode(values, "auto")
    assert compressible.header.compressed and compressible.header.codec == "lz4"
    assert compressible.nbytes < values.nbytes // 2
    assert np.array_equal(elements.decode_all([compressible.header], compressible.buffers)[0],
                          values)
    noise = elements.encode(np.random.default_rng(0).bytes(1 << 16), "auto")
    assert not noise.header.compressed
    forced = elements.encode(np.random.default_rng(0).bytes(1 << 16), "snappy")
    assert forced.header.compressed and forced.header.codec == ""  # snappy
    decoded = elements.decode_all([forced.header], forced.buffers)[0]
    assert decoded == np.random.default_rng(0).bytes(1 << 16)


def test_an_unknown_or_corrupt_compressed_element_is_refused():
    encoded = elements.encode(np.zeros(1 << 12), "auto")
    encoded.header.codec = "zstd"
    with pytest.raises(errors.InvalidArgumentError, match="Unknown element compression codec"):
        elements.decode_all([encoded.header], encoded.buffers)
    encoded.header.codec = "lz4"
    with pytest.raises(errors.InvalidArgumentError, match="Corrupt compressed element"):
        elements.decode_all([encoded.header], [bytes(encoded.buffers[0])[:-9]])


def test_pipeline_errors_reach_the_client_with_the_remote_traceback(service):
    ds = distributed(data.Dataset.range(10).map(fns.fail_at_five), "parallel_epochs",
                     service.target)
    with pytest.raises(errors.RemoteFunctionError, match="element five is cursed") as caught:
        list(ds)
    assert caught.value.remote_type == "builtins.ValueError"


def test_lambdas_are_refused_unless_both_servers_allow_cloudpickle(service):
    with pytest.raises(errors.InvalidArgumentError, match="module level.*allow_cloudpickle"):
        data.Dataset.range(3).map(lambda x: x + 1).apply(
            data.distribute("parallel_epochs", service.target))
    pytest.importorskip("cloudpickle")
    with data.DispatchServer(port=0, config={"allow_cloudpickle": True}) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(config={"dispatcher_address": address,
                                       "allow_cloudpickle": True}):
            offset = 10
            ds = distributed(data.Dataset.range(3).map(lambda x: x + offset), "parallel_epochs",
                             dispatcher.target)
            assert list(ds) == [10, 11, 12]


def test_elements_over_a_separate_data_transfer_protocol():
    if "grpc+local" not in get_plugin_manager().protocols():
        pytest.skip("grpc+local transport not installed")
    with data.DispatchServer(port=0) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(data.WorkerConfig(
                dispatcher_address=address, data_transfer_protocol="grpc+local")):
            ds = distributed(data.Dataset.range(30).map(fns.fill_2k), "parallel_epochs",
                             dispatcher.target, data_transfer_protocol="grpc+local")
            assert sorted(int(x[0]) for x in ds) == list(range(30))


def test_auto_compresses_over_grpc_only_as_tf(monkeypatch):
    if "grpc+local" not in get_plugin_manager().protocols():
        pytest.skip("grpc+local transport not installed")
    from clusterwire.data import compression

    calls = []
    original = compression.compress
    monkeypatch.setattr(compression, "compress", lambda *a: calls.append(1) or original(*a))
    with data.DispatchServer(port=0) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(data.WorkerConfig(
                dispatcher_address=address, data_transfer_protocol="grpc+local")):
            for transfer, compressed in (("grpc+local", False), (None, True)):
                calls.clear()
                ds = distributed(data.Dataset.range(30).map(fns.fill_2k), "parallel_epochs",
                                 dispatcher.target, data_transfer_protocol=transfer)
                assert sorted(int(x[0]) for x in ds) == list(range(30))
                assert bool(calls) is compressed, transfer


def test_a_new_worker_joins_a_running_job(monkeypatch):
    monkeypatch.setenv("CW_DATA_SLOW_S", "0.02")  # the first worker needs ~1.6 s
    with data.DispatchServer(port=0) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address):
            ds = distributed(data.Dataset.range(80).map(fns.slow_identity), "parallel_epochs",
                             dispatcher.target)
            iterator = iter(ds)
            seen = [next(iterator)]
            with data.WorkerServer(port=0, dispatcher_address=address):
                seen += list(iterator)
    assert Counter(int(x) for x in seen) == Counter({x: 2 for x in range(80)})


def test_a_new_worker_takes_splits_of_a_running_distributed_epoch_job(monkeypatch):
    from clusterwire.metrics import REGISTRY, catalog

    monkeypatch.setenv("CW_DATA_SLOW_S", "0.02")  # the first worker alone needs ~1.6 s
    with data.DispatchServer(port=0) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address):
            ds = distributed(data.Dataset.range(80).map(fns.slow_identity),
                             "distributed_epoch", dispatcher.target)
            iterator = iter(ds)
            seen = [next(iterator)]
            with data.WorkerServer(port=0, dispatcher_address=address) as joined:
                seen += list(iterator)
                sent = sum(s.value for s in REGISTRY.samples(server=joined.metrics_name)
                           if s.metric is catalog.DATA_ELEMENTS)
    assert Counter(int(x) for x in seen) == Counter(range(80))  # each exactly once
    assert sent > 0  # the worker that joined served some of them


def test_the_dispatcher_notices_a_dead_worker_within_worker_timeout():
    config = data.DispatcherConfig(port=0, worker_timeout_ms=300)
    with data.DispatchServer(config) as dispatcher:
        address = dispatcher.target.split("://")[1]
        worker = data.WorkerServer(data.WorkerConfig(dispatcher_address=address,
                                                     heartbeat_interval_ms=50))
        assert dispatcher.num_workers() == 1
        worker.stop()
        stopped = time.monotonic()
        wait_for(lambda: dispatcher.num_workers() == 0, timeout=5, what="worker timeout")
        assert time.monotonic() - stopped < 0.3 + 0.2


def test_jobs_are_garbage_collected_after_the_timeout_without_consumers():
    """A named job outlives its consumers for job_gc_timeout_ms (a later consumer may join
    it, as in TF); an anonymous job goes with its one consumer's release."""
    config = data.DispatcherConfig(port=0, job_gc_check_interval_ms=20, job_gc_timeout_ms=100)
    with data.DispatchServer(config) as dispatcher:
        address = dispatcher.target.split("://")[1]
        with data.WorkerServer(port=0, dispatcher_address=address):
            ds = distributed(data.Dataset.range(5), "parallel_epochs", dispatcher.target)
            assert len(list(ds)) == 5
            assert dispatcher.num_jobs() == 0
            ds = distributed(data.Dataset.range(5), "parallel_epochs", dispatcher.target,
                             job_name="kept")
            assert len(list(ds)) == 5
            assert dispatcher.num_jobs() == 1
            wait_for(lambda: dispatcher.num_jobs() == 0, timeout=5, what="job GC")


def test_a_small_job_ends_without_tf_s_one_second_tick(service):
    ds = distributed(data.Dataset.range(10), "distributed_epoch", service.target)
    started = time.perf_counter()
    assert len(list(ds)) == 10
    assert time.perf_counter() - started < 0.5

