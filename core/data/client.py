"""``distribute``, ``register_dataset`` and ``from_dataset_id``: reading through the service;
``service_status``: what a dispatcher or worker reports about itself.

They take tf.data service's arguments and perform its checks. A distributed
dataset is a ``Dataset`` whose source is the service, so further
transformations run in the client; each iteration is a new job (with
``job_name``: the job named ``job_name`` for that iteration, shared with the
other consumers using that name).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from clusterwire import errors
from clusterwire.data import compression as compressor
from clusterwire.data import graph, provenance
from clusterwire.data import position as positions
from clusterwire.data.dataset import Dataset
from clusterwire.data.modes import (
    COMPRESSION_AUTO,
    COMPRESSION_SNAPPY,
    ShardingPolicy,
    check_consumers,
    check_job_name,
    check_max_outstanding,
    check_target_workers,
    compression_name,
    mode_name,
    parse_service,
    sharding_policy,
)
from clusterwire.data.pipeline import Source
from clusterwire.data.position import JobPosition, Position
from clusterwire.data.reader import _MAX_ELEMENTS, JobReader, ReadOptions
from clusterwire.data.rpc import DispatcherClient, parse
from clusterwire.protos.data_service_pb2 import (
    DataRequest,
    DataServiceStatus,
    GetDatasetRequest,
    GetStatusRequest,
    RegisterDatasetRequest,
)
from clusterwire.rpc import RequestClient
from clusterwire.security import Security, load_security
from clusterwire.transport import Frame

# How long a client keeps retrying an unavailable dispatcher (e.g. while it restarts).
DISPATCHER_RETRY_S = 60.0


def _dispatcher(service: Any, security: Security) -> DispatcherClient:
    protocol, address = parse_service(service)
    return DispatcherClient(protocol, address, DISPATCHER_RETRY_S, security)


def _security(config: Mapping[str, Any] | Security | None) -> Security:
    """The client's Security: ``config``'s keys (tls_ca_file, tls_cert_file, tls_key_file,
    auth_token_file) over the ``CLUSTERWIRE_*`` environment over plugins.toml, as a
    Session's."""
    if isinstance(config, Security):
        return config
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict of security options, got {config!r}")
    return load_security(config)


def register_dataset(service: Any, dataset: Dataset, compression: str | None = "AUTO",
                     dataset_id: str | None = None, *,
                     config: Mapping[str, Any] | Security | None = None) -> str:
    """Register ``dataset`` with the dispatcher at ``service``; returns its dataset id.

    An equal dataset registered before gets the same id; an explicit
    ``dataset_id`` already used by a different dataset is an
    InvalidArgumentError. ``config``: security options, as for ``distribute``.
    """
    wire = compression_name(compression)
    if wire == COMPRESSION_SNAPPY:
        compressor.require()
    if not isinstance(dataset, Dataset):
        raise TypeError(f"`dataset` must be a clusterwire.data.Dataset, got {dataset!r}")
    if isinstance(dataset.pipeline.source, provenance.TaggedSource):
        raise errors.InvalidArgumentError(
            "A dataset of with_element_ids() is for local iteration: register the dataset "
            "without it and read it with element_ids=True (distribute / from_dataset_id).")
    if dataset_id is not None and (not isinstance(dataset_id, str) or not dataset_id):
        raise ValueError(f"`dataset_id` must be a non-empty string, got {dataset_id!r}")
    definition, buffers = graph.to_def(dataset.pipeline)
    client = _dispatcher(service, _security(config))
    try:
        response, _ = client.call(DataRequest(register_dataset=RegisterDatasetRequest(
            dataset=definition, dataset_id=dataset_id or "", compression=wire)), buffers)
    finally:
        client.close()
    return response.register_dataset.dataset_id


def service_status(address: str, protocol: str = "grpc", timeout: float = 10.0,
                   security: Security | None = None) -> DataServiceStatus:
    """The status of the dispatcher or worker at ``address`` ("host:port"; a
    ``protocol://`` prefix names the protocol; a dispatcher's standbys may follow it,
    "host1:port1,host2:port2", and the one serving answers): its kind, address, protocol,
    version and metrics (``clusterwire.metrics``' samples, histograms as ``_count`` and ``_sum``); a
    dispatcher's also lists its workers and jobs.

    ``security``: the client's credentials (a token-protected server refuses a request
    without its token). An unreachable server is an UnavailableError after ``timeout`` s.
    """
    if "://" in address:
        protocol, address = parse_service(address)
    if "," in address:  # a primary and its standbys: the one that serves answers
        dispatcher = DispatcherClient(protocol, address, timeout, security or Security())
        try:
            return dispatcher.call(DataRequest(get_status=GetStatusRequest()))[0].status_report
        finally:
            dispatcher.close()
    client = RequestClient(protocol, timeout=timeout, security=security)
    try:
        reply = client.send_frame(
            address, Frame(DataRequest(get_status=GetStatusRequest()).SerializeToString(), []),
            "data.get_status", idempotent=True)
    finally:
        client.close()
    return parse(reply).status_report


class CrossTrainerCache:
    """Trainers sharing a worker's elements (``tf.data.experimental.service.CrossTrainerCache``).

    Pass it as ``cross_trainer_cache`` to ``distribute`` / ``from_dataset_id``. The trainer
    jobs reading one job (the same ``job_name``, ``processing_mode="parallel_epochs"``, an
    infinite dataset) then share what each worker produces: an element one trainer read is
    served to the others from a sliding window of the worker's
    ``cross_trainer_cache_size_bytes`` (WorkerConfig); a trainer that falls behind the window
    skips ahead to its oldest element. Each ``trainer_id`` has its own position; consumers
    with the same id (one trainer's replicas) share it, each element going to one of them.
    """

    def __init__(self, trainer_id: str):
        if not trainer_id:
            raise ValueError(
                "tf.data service cross-trainer cache requires a non-empty trainer ID.")
        if not isinstance(trainer_id, str):
            raise TypeError(f"`trainer_id` must be a non-empty string, got {trainer_id!r}")
        self.trainer_id = trainer_id

    def __repr__(self) -> str:
        return f"CrossTrainerCache(trainer_id={self.trainer_id!r})"


class ServiceSource(Source):
    """The source of a distributed dataset: jobs of the tf.data service.

    Its first iteration resumes from ``position`` if given (later ones are new iterations,
    numbered on from it).
    """

    def __init__(self, service: Any, options: ReadOptions, security: Security,
                 position: Position | JobPosition | None = None):
        self._service = service
        self._options = options
        self._security = security
        self._position = position
        self._iterations = itertools.count(position.iteration if position else 0)
        self._lock = threading.Lock()

    def open(self) -> JobReader:
        """A reader of the next iteration (``state_dict()`` gives its position)."""
        with self._lock:
            position, self._position = self._position, None
            iteration = next(self._iterations)
        if self._options.trainer_id and iteration:
            raise errors.InvalidArgumentError(
                "Cross-trainer caching requires infinite datasets and disallows multiple "
                f"repetitions of the same dataset. Got repetition {iteration + 1}: a trainer "
                "reads one iteration of its distributed dataset.")
        return JobReader(_dispatcher(self._service, self._security), self._options,
                         iteration, position)

    def iterate(self) -> Iterator[Any]:
        reader = self.open()
        try:
            yield from reader
        finally:
            reader.close()


def from_dataset_id(processing_mode: Any, service: Any, dataset_id: str,
                    element_spec: Any = None, job_name: str | None = None,
                    consumer_index: int | None = None, num_consumers: int | None = None,
                    max_outstanding_requests: int | None = None,
                    data_transfer_protocol: str | None = None,
                    cross_trainer_cache: Any = None,
                    target_workers: str = "AUTO", *,
                    config: Mapping[str, Any] | Security | None = None,
                    state: Mapping[str, Any] | None = None,
                    element_ids: bool = False) -> Dataset:
    """A dataset reading the registered dataset ``dataset_id`` through the service.

    ``element_spec`` is accepted for TF compatibility (clusterwire elements describe
    themselves). ``cross_trainer_cache``: a ``CrossTrainerCache``, to share the job's
    elements with other trainers (see there). An unknown id is a NotFoundError.
    ``config``: security options, as for ``distribute``. ``state`` (a
    clusterwire addition): a position an iterator's ``state_dict()`` returned, or the job
    position ``merge_states`` made of all of a distributed_epoch job's consumers' (any number
    of new consumers resume from it); the first iteration resumes from it (see
    ``clusterwire.data.position``). ``element_ids`` (also a clusterwire addition): yield
    ``(id, element)`` pairs, the id of each source element (a batch: the list of its rows')
    the same however many workers and consumers read the epoch (see
    ``clusterwire.data.provenance``; a pipeline through which ids are not defined fails the
    first read with an InvalidArgumentError naming the transformation).
    """
    position = None if state is None else positions.load(state)
    del element_spec
    trainer_id = _trainer_id(cross_trainer_cache)
    policy = sharding_policy(processing_mode)
    _check_element_ids(element_ids, policy)
    job_name = check_job_name(job_name)
    consumers = check_consumers(job_name, consumer_index, num_consumers)
    outstanding = check_max_outstanding(max_outstanding_requests)
    target = check_target_workers(target_workers)
    security = _security(config)
    client = _dispatcher(service, security)
    try:
        response, _ = client.call(DataRequest(get_dataset=GetDatasetRequest(
            dataset_id=str(dataset_id))))
    finally:
        client.close()
    accepted = response.get_dataset.compression if compressor.available() else ""
    if accepted == COMPRESSION_AUTO and data_transfer_protocol not in (None, "grpc"):
        accepted = ""  # as TF's _decide_compression: AUTO compresses only over grpc
    if response.get_dataset.compression == COMPRESSION_SNAPPY:
        compressor.require()
    options = ReadOptions(
        dataset_id=str(dataset_id), policy=policy, job_name=job_name,
        consumer_index=consumer_index, num_consumers=consumers,
        max_elements=min(outstanding or _MAX_ELEMENTS, _MAX_ELEMENTS),
        data_transfer_protocol=data_transfer_protocol, compression=accepted,
        target_workers=target, trainer_id=trainer_id, element_ids=element_ids)
    return Dataset(ServiceSource(service, options, security, position))


def _check_element_ids(element_ids: Any, policy: ShardingPolicy) -> None:
    """``element_ids`` must be a bool, and not of a static FILE shard."""
    if not isinstance(element_ids, bool):
        raise TypeError(f"`element_ids` must be a bool, got {element_ids!r:.80}")
    if element_ids and policy in (ShardingPolicy.FILE, ShardingPolicy.FILE_OR_DATA):
        raise errors.InvalidArgumentError(
            f"element_ids are not defined for {mode_name(policy)} reads: a worker's file "
            "shard numbers its own files, not the dataset's. Read with "
            "processing_mode='distributed_epoch' (every element once, each with its id), "
            "'parallel_epochs' or ShardingPolicy.DATA.")


def distribute(processing_mode: Any, service: Any, job_name: str | None = None,
               consumer_index: int | None = None, num_consumers: int | None = None,
               max_outstanding_requests: int | None = None,
               data_transfer_protocol: str | None = None, compression: str | None = "AUTO",
               cross_trainer_cache: Any = None, target_workers: str = "AUTO", *,
               config: Mapping[str, Any] | Security | None = None,
               state: Mapping[str, Any] | None = None,
               element_ids: bool = False) -> Callable[[Dataset], Dataset]:
    """A transformation for ``Dataset.apply`` that reads the dataset through the service.

    ``processing_mode``: "parallel_epochs" (every worker produces the whole
    dataset), "distributed_epoch" (workers share splits of the source; every
    element once) or a ShardingPolicy. ``service``: the dispatcher's target
    ("grpc://host:port", "host:port" or a (protocol, address) tuple).
    ``config`` (a clusterwire addition): security options as a ``Session`` takes them
    (tls_ca_file, tls_cert_file, tls_key_file, auth_token_file), over the
    ``CLUSTERWIRE_*`` environment and plugins.toml's ``[security]``. ``state`` (also a
    clusterwire addition): resume the first iteration from a saved position, as in
    ``from_dataset_id``. ``element_ids``: yield ``(id, element)`` pairs, as in
    ``from_dataset_id``; a dataset through which ids are not defined is refused here.
    """
    _trainer_id(cross_trainer_cache)
    policy = sharding_policy(processing_mode)
    _check_element_ids(element_ids, policy)
    job_name = check_distribute_arguments(processing_mode, service, job_name, consumer_index,
                                          num_consumers, max_outstanding_requests,
                                          target_workers, compression)
    security = _security(config)

    def apply(dataset: Dataset) -> Dataset:
        if element_ids and isinstance(dataset, Dataset):
            provenance.check(dataset.pipeline)
        dataset_id = register_dataset(service, dataset, compression, config=security)
        return from_dataset_id(policy, service, dataset_id, job_name=job_name,
                               consumer_index=consumer_index, num_consumers=num_consumers,
                               max_outstanding_requests=max_outstanding_requests,
                               data_transfer_protocol=data_transfer_protocol,
                               cross_trainer_cache=cross_trainer_cache,
                               target_workers=target_workers, config=security, state=state,
                               element_ids=element_ids)

    if state is not None:
        positions.load(state)  # a malformed position fails here, not at the first read
    return apply


def check_distribute_arguments(processing_mode: Any, service: Any, job_name: str | None,
                               consumer_index: int | None, num_consumers: int | None,
                               max_outstanding_requests: int | None, target_workers: str,
                               compression: str | None) -> str | None:
    """``distribute``'s checks of its arguments, with TF's errors; the job name to use."""
    sharding_policy(processing_mode)
    parse_service(service)
    job_name = check_job_name(job_name)
    check_consumers(job_name, consumer_index, num_consumers)
    check_max_outstanding(max_outstanding_requests)
    check_target_workers(target_workers)
    compression_name(compression)
    return job_name


def check_adapter_dataset(dataset: Any, adapter: str) -> None:
    """A framework adapter's ``dataset`` argument: a ``Dataset`` not yet read through the
    service, or a ``register_dataset`` id."""
    if isinstance(dataset, Dataset):
        if isinstance(dataset.pipeline.source, ServiceSource):
            raise errors.InvalidArgumentError(
                f"{adapter} got a dataset already read through the service ({dataset!r}): "
                "pass the dataset as it was before `.apply(distribute(...))`, and "
                f"distribute's arguments to {adapter}.")
    elif not isinstance(dataset, str) or not dataset:
        raise TypeError(
            f"{adapter}'s `dataset` must be a clusterwire.data.Dataset or a dataset id from "
            f"clusterwire.data.register_dataset, got {dataset!r}.")


def _trainer_id(cross_trainer_cache: Any) -> str:
    """The trainer id of a ``cross_trainer_cache`` argument ("": no cache)."""
    if cross_trainer_cache is None:
        return ""
    if not isinstance(cross_trainer_cache, CrossTrainerCache):
        raise TypeError(
            "`cross_trainer_cache` must be a clusterwire.data.CrossTrainerCache or None, got "
            f"{cross_trainer_cache!r}")
    return cross_trainer_cache.trainer_id
