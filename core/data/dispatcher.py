"""DispatchServer: registers datasets, creates jobs, hands out splits, tracks workers.

It never runs user code and never sees elements: workers produce them and
consumers read them from the workers. In fault-tolerant mode every decision
is journaled (fsync'd) in ``work_dir`` before it is answered, so a dispatcher
restarted on the same port and work_dir continues where it died. Only the holder of the
work_dir's lease (``clusterwire.data.lease``) writes there; a standby (``standby=True``)
answers UNAVAILABLE until it takes the lease, then replays the journal and serves at its
own address.

A consumer that stops reading releases its job (``ClientHeartbeatRequest.release``):

* an anonymous job has that one consumer (it alone holds the job's grant), so the job is
  removed at once and the workers drop its streams (the consumer also releases them on the
  workers directly; this is the backstop);
* a named job stays for its other consumers and, as in TF, for job_gc_timeout_ms after its
  last consumer left. The splits the consumer was reading go back to the pool, each with the
  number of elements the consumer returned to its user, so another consumer resumes it there
  without repeating any (what a consumer fetched of splits it had read to their end is its
  own, as in TF). A released consumer gets no more splits.

A distributed_epoch consumer whose position was saved (``state_dict()``; it says so with its
requests, ``resumable``) can be restarted from that position (``GetOrCreateJobRequest.resume``).
The job remembers what it handed each consumer, and at which offset: the restarted consumer
gets back every split handed to it after the saved position (at its hand-out offset) and the
ones the position lists as partly read (at the elements it had returned); any other split
still assigned to it was read completely (its acknowledgement, the next split request, never
came: the consumer died first) and is done, never sent again. So that nobody
else reads them meanwhile, a resumable consumer that stops or dies keeps its splits
(dormant) for job_gc_timeout_ms; only then do they go back to the pool.

In distributed_epoch no consumer is told the splits have ended while another consumer still
holds some: those may come back (a consumer stopping early or timing out) and must be read.
"""

from __future__ import annotations

import functools
import hmac
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from clusterwire import errors
from clusterwire.at_exit import stop_at_exit
from clusterwire.data import grants, graph, vouches, worker_auth
from clusterwire.data.config import (
    CLIENT_TIMEOUT_MS,
    DATASET_GC_TIMEOUT_MS,
    JOB_GC_CHECK_INTERVAL_MS,
    JOB_GC_TIMEOUT_MS,
    WORKER_TIMEOUT_MS,
    DispatcherConfig,
    as_config,
    runtime_ms,
    server_limits,
    server_listen_options,
    server_security,
    warn_if_unsafe,
)
from clusterwire.data.dispatcher_state import DispatcherState, Job
from clusterwire.data.heartbeat_replies import HeartbeatReplies
from clusterwire.data.journal import (
    Journal,
    ReadReport,
    read_payload,
    remove_payload,
    write_payload,
)
from clusterwire.data.lease import Lease
from clusterwire.data.modes import STATIC_POLICIES, ShardingPolicy, mode_name, policy_of
from clusterwire.data.monitoring import MonitoredServer, Monitoring
from clusterwire.data.pipeline import INFINITE, split_plan
from clusterwire.data.position import check_split_offset, group_of, merge_id, split_limit
from clusterwire.data.rpc import serve
from clusterwire.fair_shares import Displaced, FairShares
from clusterwire.metrics import REGISTRY, catalog
from clusterwire.metrics.registry import ENABLED, Sample
from clusterwire.protos.data_service_pb2 import (
    DataRequest,
    DataResponse,
    JobInfo,
    JobSummary,
    JournalDataset,
    JournalEntry,
    JournalJob,
    JournalMerge,
    JournalResume,
    JournalSplit,
    JournalSplitsDone,
    SplitOffset,
    StreamSpec,
    WorkerSummary,
)
from clusterwire.security import Security
from clusterwire.shell import Shell
from clusterwire.waiting import wait_event

#: The journal is compacted once it has this many records more than a snapshot would.
_COMPACT_SLACK = 1000
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")
#: Requests that add an entry to a table (passed the peer that sent them).
_CREATING = frozenset({"register_dataset", "get_or_create_job"})
_STOP_CHECK_S = 1.0  # how often wait_serving looks whether the dispatcher was stopped
log = logging.getLogger("clusterwire")


def _dispatcher_config(config: DispatcherConfig | dict | None, port: Any,
                       protocol: str | None) -> DispatcherConfig:
    """The dispatcher's config: ``config`` (or the default) with ``port`` and ``protocol``
    in place of its fields when given; ValueError for fault-tolerant mode without a
    work_dir."""
    config = as_config(config, DispatcherConfig) or DispatcherConfig()
    if port is not None:
        config = config._replace(port=DispatcherConfig(port=port).port)
    if protocol is not None:
        config = config._replace(protocol=protocol)
    if config.fault_tolerant_mode and not config.work_dir:
        raise ValueError(
            "Cannot enable fault tolerant mode without configuring a work dir. Make sure "
            "to set `work_dir` in the `config` object passed to `DispatcherServer`.")
    return config


class DispatchServer(MonitoredServer):
    """A tf.data service dispatcher (``tf.data.experimental.service.DispatchServer``).

    ``DispatchServer(port=0, protocol="grpc", start=True, config=None)``; as in
    TF, a ``DispatcherConfig`` may also be the first argument. ``port`` and
    ``protocol`` override the config's. The protocol is any installed
    transport. ``target`` is ``protocol://host:port`` with the bound port.

    Its metrics (registered workers, heartbeats, jobs, each distributed_epoch job's splits,
    the journal's size, and the requests it served) carry the label ``server`` =
    ``metrics_name``; with the config's ``metrics_port`` they are served at
    ``metrics_url``, and a ``GetStatusRequest`` (``clusterwire.data.service_status``)
    returns them with its workers and jobs.
    """

    def __init__(self, port: Any = None, protocol: str | None = None, start: bool = True,
                 config: DispatcherConfig | dict | None = None):
        if isinstance(port, (DispatcherConfig, dict)):
            port, config = None, port
        self._config = config = _dispatcher_config(config, port, protocol)
        warn_if_unsafe(config, "dispatcher")
        self._worker_timeout = runtime_ms(config.worker_timeout_ms, WORKER_TIMEOUT_MS) / 1000
        self._gc_interval = runtime_ms(config.job_gc_check_interval_ms,
                                       JOB_GC_CHECK_INTERVAL_MS) / 1000
        self._gc_timeout = (None if config.job_gc_timeout_ms == -1 else
                            runtime_ms(config.job_gc_timeout_ms, JOB_GC_TIMEOUT_MS) / 1000)
        self._client_timeout = CLIENT_TIMEOUT_MS / 1000
        self._dataset_gc_timeout = (None if config.dataset_gc_timeout_ms == -1 else runtime_ms(
            config.dataset_gc_timeout_ms, DATASET_GC_TIMEOUT_MS) / 1000)
        self._records = 0  # journal records written since the last compaction
        self._quotas = server_limits(config)
        self._state = DispatcherState(self._quotas)
        self._resumed_rounds: dict[str, _ResumeWave] = {}  # round-robin group -> its wave
        # A consumer heartbeating at the longest interval it is told is never timed out.
        self._heartbeat_replies = HeartbeatReplies(self._quotas.consumer_heartbeat_rate,
                                                   self._client_timeout / 10)
        self._wave_shares: FairShares[str] = FairShares()  # the waves' groups by peer
        self._displaced_waves: Displaced[str] = Displaced(self._quotas.max_jobs)
        # Jobs and datasets displaced from a full table, and why: told at their next use.
        self._displaced_jobs: Displaced[int] = Displaced(self._quotas.max_jobs)
        self._displaced_datasets: Displaced[str] = Displaced(self._quotas.max_datasets)
        self._cond = threading.Condition()
        self.journal_report = ReadReport([])
        host = config.bind_address
        self._host = "localhost" if host in _WILDCARDS else host
        security = server_security(config)
        self._worker_token = worker_auth.load(config.worker_token_file, security)
        self._made_token = self._worker_token is None  # then only local workers learn it
        if self._made_token:
            self._worker_token = worker_auth.new_token()
        # A standby serves (answers anything but UnavailableError) once it holds the lease.
        self._serving = threading.Event()
        self._takeover_error: BaseException | None = None
        self._durable = _Durable(Lease(config.work_dir) if config.work_dir else None)
        self._hold_state(config)
        self._monitoring = Monitoring("data-dispatcher")
        self._heartbeats = REGISTRY.family(catalog.DATA_HEARTBEATS)
        self._stopping = threading.Event()
        self._endpoint = self._serve(config, host or "0.0.0.0", security)
        self._stopped = threading.Event()
        self._started = False
        self._lock = threading.Lock()
        self._gc_thread = threading.Thread(target=self._gc_loop, daemon=True,
                                           name="clusterwire-data-gc")
        self._standby_thread = threading.Thread(target=self._stand_by, daemon=True,
                                                name="clusterwire-data-standby")
        self._finalizer = stop_at_exit(self, _shutdown, self._endpoint, self._stopping,
                                       self._durable, self._monitoring, None)
        if start:
            self.start()

    def _hold_state(self, config: DispatcherConfig) -> None:
        """Take the work_dir's lease and load the state it serves, or (a standby) say why it
        waits; nothing left held on failure."""
        try:
            if config.standby:
                self._standby_reason = (
                    f"This tf.data service dispatcher is standing by for work_dir "
                    f"{config.work_dir!r}, whose lease is held by "
                    f"{self._durable.lease.holder()}; it serves once that dispatcher is gone. "
                    "Give clients and workers both addresses, 'primary:port,standby:port'.")
            else:
                self._take_lease()
                self._load()
                self._serving.set()
        except BaseException:
            self._durable.close()
            raise

    def _serve(self, config: DispatcherConfig, host: str, security: Security) -> Shell:
        """The listener (not started yet) and the metrics; the local workers told the
        token. On failure nothing is left serving and the work_dir is let go."""
        try:
            endpoint = serve(config.protocol, host, config.port, self._handle,
                             self._monitoring.name, server_listen_options(security))
        except BaseException:
            self._monitoring.close()
            self._durable.close()
            raise
        if self._made_token:
            worker_auth.publish(endpoint.port, self._host, self._worker_token)
        if self._serving.is_set():
            self._durable.describe(f"{config.protocol}://{self._host}:{endpoint.port}")
        else:  # health checks and /readyz say NOT_SERVING until it takes over
            endpoint.set_ready(False)
        try:
            self._monitoring.start(functools.partial(
                _samples, self._monitoring.name, self._state, self._cond, self._worker_timeout,
                self._durable), config.metrics_port, config.metrics_host, security)
        except BaseException:
            _shutdown(endpoint, self._stopping, self._durable, self._monitoring, None)
            raise
        return endpoint

    def _take_lease(self) -> None:
        """Hold the work_dir's lease (if any); FailedPreconditionError naming its holder."""
        lease = self._durable.lease
        if lease is not None and not lease.try_take():
            raise errors.FailedPreconditionError(
                f"The work_dir {self._config.work_dir!r} is in use: its lease ({lease.path}) "
                f"is held by another dispatcher ({lease.holder()}), and two dispatchers must "
                "never write one journal. Start this one with --standby "
                "(DispatcherConfig(standby=True)) to take over when that one dies, or give it "
                "another --work-dir.")

    def _load(self) -> None:
        """Replay the journal (fault-tolerant mode) and make the grant key: the state this
        dispatcher serves. Call holding the lease."""
        with self._cond:
            if self._config.fault_tolerant_mode:
                journal = Journal(self._config.work_dir)
                report = self._replay(journal)
                self._durable.adopt(journal)
                self.journal_report = report
                self._records = len(report.entries)
                self._state.unread_jobs.clear()  # their consumers count as just seen
            if not self._state.grant_key:
                self._commit(JournalEntry(grant_key=grants.new_key()))

    def _stand_by(self) -> None:
        """A standby's wait for the lease, then its takeover: replay, then serve."""
        log.warning("clusterwire: tf.data service dispatcher %s: %s", self.target,
                    self._standby_reason)
        if self._made_token:
            log.warning("clusterwire: tf.data service dispatcher %s is a standby without a "
                        "worker token (worker_token_file, %s): once it takes over, only "
                        "workers of its own process can register. Give it the primary's.",
                        self.target, worker_auth.ENV_FILE)
        if not self._durable.lease.wait(self._stopping):
            return
        try:
            self._load()
        except BaseException as err:
            if self._stopping.is_set():
                return
            self._takeover_error = err
            log.error("clusterwire: tf.data service dispatcher %s took the lease of work_dir "
                      "%r but cannot serve it: %s", self.target, self._config.work_dir, err)
            self.stop(0)
            return
        self._durable.describe(self.target)
        self._gc_thread.start()
        self._serving.set()
        self._endpoint.set_ready(True)
        log.warning("clusterwire: tf.data service dispatcher %s took over work_dir %r (%d "
                    "journal records replayed) and serves.", self.target,
                    self._config.work_dir, len(self.journal_report.entries))

    def _replay(self, journal: Journal) -> ReadReport:
        report = journal.read()
        for entry in report.entries:
            buffers = None
            if entry.WhichOneof("kind") == "dataset":
                buffers = read_payload(self._config.work_dir, entry.dataset.dataset_id,
                                       list(entry.dataset.buffer_lengths))
            self._state.apply(entry, buffers)
        return report

    # ---- lifecycle ----

    @property
    def target(self) -> str:
        """``protocol://host:port`` that clients and workers use."""
        return f"{self._config.protocol}://{self._host}:{self._endpoint.port}"

    @property
    def config(self) -> DispatcherConfig:
        """The configuration, with the bound port."""
        return self._config._replace(port=self._endpoint.port)

    def start(self) -> None:
        """Start serving (idempotent); FailedPreconditionError after stop()."""
        with self._lock:
            if self._stopped.is_set():
                raise errors.FailedPreconditionError("This dispatcher was stopped.")
            if not self._started:
                self._endpoint.start()
                if self._serving.is_set():
                    self._gc_thread.start()
                else:
                    self._standby_thread.start()
                self._started = True

    @property
    def standing_by(self) -> bool:
        """A standby that does not hold the work_dir's lease yet (it answers every request
        with UnavailableError)."""
        return not self._serving.is_set()

    def wait_serving(self, timeout: float | None = None) -> bool:
        """Block until this dispatcher serves (True: a standby took over), it is stopped or
        ``timeout`` passes (False); a standby that took the lease but could not replay the
        journal raises that error. Signal handlers still run while the main thread waits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._serving.is_set() and not self._stopped.is_set():
            left = _STOP_CHECK_S if deadline is None else min(
                _STOP_CHECK_S, deadline - time.monotonic())
            if left <= 0:
                break
            wait_event(self._serving, left)
        if self._takeover_error is not None:
            raise self._takeover_error
        return self._serving.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Block until the server is stopped (or ``timeout`` passes); True once stopped.

        Signal handlers (Ctrl-C) still run promptly while the main thread waits here.
        """
        return wait_event(self._stopped, timeout)

    def stop(self, grace: float | None = None) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._made_token:
            worker_auth.withdraw(self._endpoint.port, self._worker_token)
        if self._finalizer.detach() is not None:
            _shutdown(self._endpoint, self._stopping, self._durable, self._monitoring, grace)
            with self._cond:
                self._cond.notify_all()
        self._stopped.set()

    def __enter__(self) -> DispatchServer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def num_workers(self) -> int:
        """How many workers are alive (heard from within worker_timeout_ms)."""
        with self._cond:
            return len(self._state.live_workers(self._worker_timeout))

    def num_jobs(self) -> int:
        """How many jobs exist (not yet garbage collected)."""
        with self._cond:
            return len(self._state.jobs)

    # ---- decisions ----

    def _commit(self, entry: JournalEntry, buffers: list[Any] | None = None,
                peer: str = "") -> None:
        """Journal (fault-tolerant mode) and apply one decision (``peer``: whose request made
        a new job or dataset; not journaled); call with the lock held."""
        if self._durable.journal is not None:
            self._durable.journal.append(entry)
            self._records += 1
        self._state.apply(entry, buffers, peer)
        self._cond.notify_all()
        if self._records > self._snapshot_size() + _COMPACT_SLACK:
            self._compact()

    def _snapshot_size(self) -> int:
        state = self._state
        return 1 + len(state.datasets) + 2 * len(state.jobs) + len(state.workers)

    def _compact(self) -> None:
        """Replace the journal by a snapshot of the state, so a restart replays O(state)."""
        if self._durable.journal is not None:
            snapshot = self._state.snapshot()
            self._durable.journal.rewrite(snapshot)
            self._records = len(snapshot)

    def _handle(self, request: DataRequest, buffers: list[Any], peer: str
                ) -> tuple[DataResponse, list]:
        if not self._serving.is_set():
            raise errors.UnavailableError(self._standby_reason)
        kind = request.WhichOneof("kind")
        handler = getattr(self, f"_on_{kind}", None) if kind else None
        if handler is None or kind == "get_elements":
            raise errors.UnimplementedError(
                f"The dispatcher does not serve {kind!r} requests (is this a worker address?).")
        if kind in _CREATING:  # the new entry counts in its peer's share (fair_shares)
            return handler(getattr(request, kind), buffers, peer)
        return handler(getattr(request, kind), buffers)

    def _on_register_dataset(self, request, buffers, peer: str):
        if not self._config.allow_cloudpickle:
            graph.check_no_pickled(request.dataset)
        graph.from_def(request.dataset, buffers)  # rejects malformed
        fingerprint = graph.fingerprint(request.dataset, buffers)
        with self._cond:
            dataset_id = request.dataset_id
            if dataset_id:
                known = self._state.datasets.get(dataset_id)
                if known is not None:
                    if known.fingerprint != fingerprint:
                        raise errors.InvalidArgumentError(
                            "Datasets with the same ID should have the same structure: "
                            f"dataset id {dataset_id!r} is already registered with a "
                            "different dataset.")
                    return self._registered(dataset_id), []
            else:
                # The peer's own, or one whose creator a restart forgot (the same id as
                # before the restart).
                known = self._state.by_fingerprint
                known_id = known.get((fingerprint, request.compression, peer)) or known.get(
                    (fingerprint, request.compression, ""))
                if known_id is not None:
                    self._state.datasets[known_id].last_used = time.monotonic()
                    return self._registered(known_id), []
                dataset_id = self._state.new_dataset_id()
            lengths = [memoryview(b).nbytes for b in buffers]
            self._make_room_for_dataset(sum(lengths), peer)
            self._displaced_datasets.forget(dataset_id)
            if self._durable.journal is not None:
                write_payload(self._config.work_dir, dataset_id, buffers)
            self._commit(JournalEntry(dataset=JournalDataset(
                dataset_id=dataset_id, fingerprint=fingerprint,
                compression=request.compression, dataset=request.dataset,
                buffer_lengths=lengths)), buffers, peer)
        return self._registered(dataset_id), []

    def _make_room_for_dataset(self, nbytes: int, peer: str) -> None:
        """Make room for a dataset of ``nbytes`` from ``peer`` in a full table (by count,
        then by bytes), displacing datasets by ``fair_shares``' rule (with the jobs that read
        them); ResourceExhaustedError when the rule refuses. Call with the lock held."""
        most, most_bytes = self._quotas.max_datasets, self._quotas.max_dataset_bytes
        if nbytes > most_bytes:
            raise errors.ResourceExhaustedError(
                f"A dataset of {nbytes} bytes is larger than the tf.data service dispatcher's "
                f"limit for all its datasets ({most_bytes} bytes, limits max_dataset_bytes): "
                "read the data from files on the workers (readable_dirs) instead of sending "
                "it in the dataset, or raise the dispatcher's max_dataset_bytes.")
        state = self._state
        for shares, size, limit, over in (
                (state.dataset_shares, 1, f"{most} datasets, limits max_datasets",
                 lambda: len(state.datasets) + 1 - most),
                (state.dataset_bytes, nbytes,
                 f"{most_bytes} bytes of datasets, limits max_dataset_bytes",
                 lambda: state.dataset_bytes.total + nbytes - most_bytes)):
            need = over()
            if need <= 0:
                continue
            room = shares.make_room(peer, need, size, state.unused_datasets)
            if room is None:
                raise shares.refusal(
                    "This tf.data service dispatcher's dataset table", limit, peer, size,
                    "Datasets no job uses go first; those jobs used are collected "
                    "dataset_gc_timeout_ms after their last job. Retry later, or register "
                    "fewer datasets from this peer.")
            for dataset_id in room:
                self._displace_dataset(dataset_id, shares.displacement(
                    f"Dataset {dataset_id}", "this tf.data service dispatcher's dataset table",
                    limit, dataset_id, peer))
            self._remove_datasets(room)

    def _displace_dataset(self, dataset_id: str, why: str) -> None:
        """Tell ``dataset_id``'s users, and those of the jobs reading it (removed with it),
        why it goes. Call with the lock held."""
        self._displaced_datasets.remember(dataset_id, why)
        for job in [j for j in self._state.jobs.values() if j.info.dataset_id == dataset_id]:
            self._displaced_jobs.remember(
                job.info.job_id, f"Job {job.info.job_id} was removed with its dataset. {why}")
            self._commit(JournalEntry(removed_job=job.info.job_id))

    def _remove_datasets(self, dataset_ids: list[str]) -> None:
        """Forget datasets (and their payload files). Call with the lock held."""
        for dataset_id in dataset_ids:
            self._commit(JournalEntry(removed_dataset=dataset_id))
        if dataset_ids and self._durable.journal is not None:
            self._compact()  # no record names their payloads any more
            for dataset_id in dataset_ids:
                remove_payload(self._config.work_dir, dataset_id)

    @staticmethod
    def _registered(dataset_id: str) -> DataResponse:
        response = DataResponse()
        response.register_dataset.dataset_id = dataset_id
        return response

    def _dataset(self, dataset_id: str):
        record = self._state.datasets.get(dataset_id)
        if record is None:
            why = self._displaced_datasets.why(dataset_id)
            if why is not None:
                raise errors.ResourceExhaustedError(why)
            raise errors.NotFoundError(f"Dataset id {dataset_id} not found.")
        record.last_used = time.monotonic()
        return record

    def _on_get_dataset(self, request, _buffers):
        with self._cond:
            record = self._dataset(request.dataset_id)
        response = DataResponse()
        response.get_dataset.dataset.CopyFrom(record.dataset)
        response.get_dataset.compression = record.compression
        return response, record.buffers

    def _on_get_or_create_job(self, request, _buffers, peer: str):
        policy = policy_of(request.sharding_policy)
        with self._cond:
            record = self._dataset(request.dataset_id)
            if request.resume_group:
                request.job_key = self._resume_wave_key(request, peer)
            job_id = self._state.job_keys.get(request.job_key)
            if job_id is None and (request.resume or request.merged):
                raise errors.NotFoundError(
                    f"The job of the saved position ({request.job_key!r}) is gone: it was "
                    "collected after job_gc_timeout_ms, or the dispatcher restarted without "
                    "fault_tolerant_mode. A position resumes only while its job lives.")
            if job_id is None:
                job_id = self._create_job(request, record, policy, peer)
            job = self._state.jobs[job_id]
            if job.info.sharding_policy != policy:
                raise errors.InvalidArgumentError(
                    f"Tried to create job with name {request.job_key.rsplit('/', 1)[0]!r} "
                    f"and processing mode {policy.name}, but found an existing job with "
                    f"different processing mode {ShardingPolicy(job.info.sharding_policy).name}.")
            if request.resume:
                self._resume(job, request)
            elif request.merged:
                self._merge(job, request)
            job.last_active = time.monotonic()
            response = DataResponse()
            response.job.CopyFrom(job.info)
            response.job.workers.extend(self._workers_for(job))
            response.job.grant = grants.grant(self._state.grant_key, StreamSpec(
                job_id=job.info.job_id, dataset_id=job.info.dataset_id,
                owner=job.info.owner), "")
        return response, []

    def _create_job(self, request, record, policy: ShardingPolicy, peer: str) -> int:
        shares, room, most = self._state.job_shares, [], self._quotas.max_jobs
        limit = f"{most} jobs, limits max_jobs"
        if len(self._state.jobs) >= most:
            room = shares.make_room(peer, len(self._state.jobs) + 1 - most,
                                    unused=self._state.unread_jobs)
            if room is None:
                raise shares.refusal(
                    "This tf.data service dispatcher's job table", limit, peer,
                    1, "Jobs nobody read go first; a job goes when its consumers release it, "
                    "or job_gc_timeout_ms after its last consumer. Retry later, or read fewer "
                    "jobs at once from this peer.")
        pipe = graph.from_def(record.dataset, record.buffers)
        order = self._config.worker_addresses
        if policy in STATIC_POLICIES and not order:
            raise errors.FailedPreconditionError(
                f"Static sharding policy <{policy.name}> requires configuring "
                "`worker_addresses` in DispatcherConfig, so the dispatcher knows which "
                "worker reads which shard.")
        if policy == ShardingPolicy.FILE and not pipe.source.has_files():
            raise errors.InvalidArgumentError(
                "Sharding policy FILE needs a dataset read from files (Dataset.from_files, "
                "list_files, TFRecordDataset, from_parquet or from_tar_shards as its source); "
                "use DATA or FILE_OR_DATA.")
        if request.num_consumers:
            cardinality = pipe.cardinality()
            if cardinality != INFINITE:
                raise errors.FailedPreconditionError(
                    "Round robin reads require that the input dataset has infinite "
                    f"cardinality, but the dataset has cardinality {cardinality}.")
            if policy != ShardingPolicy.OFF:
                raise errors.InvalidArgumentError(
                    "Round robin reads (consumer_index/num_consumers) need "
                    "processing_mode='parallel_epochs'.")
        info = JobInfo(job_id=self._state.new_job_id(), dataset_id=record.dataset_id,
                       sharding_policy=policy, num_consumers=request.num_consumers,
                       compression=record.compression, cardinality=pipe.cardinality(),
                       owner="" if request.named else request.consumer_id)
        if policy in STATIC_POLICIES:
            info.worker_order.extend(order)
        job = JournalJob(job=info, job_key=request.job_key, named=request.named)
        if policy == ShardingPolicy.DYNAMIC:
            plan = split_plan(pipe)
            job.split_units = plan.split_units(
                len(self._state.live_workers(self._worker_timeout)))
            job.total_units, job.epochs = plan.units, plan.epochs
        for job_id in room:  # checked above; displaced only now that the new job is sound
            self._displaced_jobs.remember(job_id, shares.displacement(
                f"Job {job_id}", "this tf.data service dispatcher's job table",
                limit, job_id, peer))
            self._commit(JournalEntry(removed_job=job_id))
        self._commit(JournalEntry(job=job), peer=peer)
        return info.job_id

    def _resume(self, job: Job, request) -> None:
        """A consumer restarts from a saved distributed_epoch position (checked here against
        what the job handed it). Call with the lock held."""
        consumer = request.consumer_id
        if job.info.sharding_policy != ShardingPolicy.DYNAMIC or consumer in job.released \
                or consumer not in job.resumable:
            why = ("it stopped without keeping its splits (its position was not saved, or it "
                   "was away longer than job_gc_timeout_ms)" if consumer in job.released
                   else "its position was never saved in this job")
            raise errors.FailedPreconditionError(
                f"Consumer {consumer!r} of job {job.info.job_id} cannot resume: {why}. Start "
                "a new iteration instead.")
        if job.is_stale(consumer, request.generation):
            raise errors.FailedPreconditionError(
                f"Consumer {consumer!r} of job {job.info.job_id} was resumed again since "
                "(from a later iterator): this position is superseded.")
        self._check_saved(job, consumer, request.handed, list(request.partial),
                          list(request.completed))
        self._commit(JournalEntry(resumed=JournalResume(
            job_id=job.info.job_id, consumer_id=consumer, handed=request.handed,
            partial=request.partial, completed=request.completed,
            generation=request.generation)))

    def _check_saved(self, job: Job, consumer: str, handed: int, partial: list[SplitOffset],
                     completed: list[int]) -> None:
        """``consumer``'s saved position (after its first ``handed`` hand-outs, ``partial``
        and ``completed`` splits) is one the job can have given it: its hand-outs from there
        are kept, it names only splits handed to it, each offset checked (_check_offsets).
        Call with the lock held."""
        base = job.handout_base.get(consumer, 0)
        kept = len(job.handouts.get(consumer, [])) + base
        if not base <= handed <= kept:
            raise errors.FailedPreconditionError(
                f"The saved position is after hand-out {handed} of consumer {consumer!r}, "
                f"but the job keeps its hand-outs {base} to {kept}: the position is too old "
                "(or not of this job). Resume from a later one.")
        splits = {split for split, _ in job.handouts.get(consumer, [])}
        stray = [s for s in [*(p.split_id for p in partial), *completed] if s not in splits]
        if stray:
            raise errors.InvalidArgumentError(
                f"The saved position names split {stray[0]}, which job {job.info.job_id} did "
                f"not hand to consumer {consumer!r}: the position is not this consumer's.")
        self._check_offsets(job, consumer, partial,
                            {p.split_id: _handed_at(job, consumer, p.split_id) for p in partial})

    def _merge(self, job: Job, request) -> None:
        """A new consumer resumes the job position merged from the positions of all the
        job's consumers (``position.merge_states``): the first one to ask has the unread
        parts of their splits given back to the pool (each position checked as a resume's),
        the others join. Only positions saved by the job's consumers (who hold its grant:
        the ``group``) merge. Call with the lock held."""
        if job.info.sharding_policy != ShardingPolicy.DYNAMIC:
            raise errors.InvalidArgumentError(
                f"Job {job.info.job_id} reads in {mode_name(job.info.sharding_policy)} mode: "
                "only distributed_epoch positions merge.")
        group = group_of(grants.grant(self._state.grant_key, StreamSpec(
            job_id=job.info.job_id, dataset_id=job.info.dataset_id, owner=job.info.owner), ""))
        if not hmac.compare_digest(request.merge_group.encode(), group.encode()):
            raise errors.PermissionDeniedError(
                f"The merged position's group is not job {job.info.job_id}'s: only positions "
                "its own consumers saved merge (or the position is of a dispatcher that lost "
                "its state). Pass what merge_states() returned, unchanged.")
        merged = list(request.merged)
        applied = merge_id(merged)
        if applied in job.merges:
            return  # another new consumer of the same merge: it joins
        names = Counter(p.consumer_id for p in merged)
        twice = sorted(name for name, count in names.items() if count > 1)
        if twice:
            raise errors.InvalidArgumentError(
                f"The merged position lists consumer {twice[0]!r} twice: merge one position "
                "per consumer, all saved at the same step.")
        for position in merged:
            consumer = position.consumer_id
            if consumer in job.resumable and consumer not in job.released:
                self._check_saved(job, consumer, position.handed, list(position.partial),
                                  list(position.completed))
            elif position.partial or position.handed != (
                    len(job.handouts.get(consumer, [])) + job.handout_base.get(consumer, 0)):
                # Only a consumer that had all its splits read (its iteration ended before
                # it saved) gives nothing back without having kept its splits.
                raise errors.FailedPreconditionError(
                    f"The merged position names consumer {consumer!r} of job "
                    f"{job.info.job_id}, which cannot resume: it was resumed from another "
                    "position (merged or its own) since, its position was never saved, or it "
                    "was away longer than job_gc_timeout_ms. Merge the positions the job's "
                    "current consumers saved.")
        missing = sorted(job.resumable - job.released - set(names))
        if missing:
            raise errors.FailedPreconditionError(
                f"The merged position lacks the position of consumer {missing[0]!r} of job "
                f"{job.info.job_id} (its position was saved too): merge the positions of all "
                "the job's consumers, saved at the same step.")
        self._commit(JournalEntry(merged=JournalMerge(
            job_id=job.info.job_id, merge_id=applied, consumers=merged)))

    def _check_offsets(self, job: Job, consumer: str, offsets: list[SplitOffset],
                       floors: dict[int, int], lower: bool = False) -> None:
        """Each split offset ``consumer`` hands back is within its split (where
        ``position.split_limit`` knows its size), not below its floor (``lower``: ignored
        there) and vouched for above it (``position.check_split_offset``): a consumer cannot
        make the split's next reader skip elements it never read, nor have another
        consumer's elements read again. Call with the lock held."""
        if not offsets:
            return
        record = self._dataset(job.info.dataset_id)
        pipe = graph.from_def(record.dataset, record.buffers)
        ops = split_plan(pipe).ops
        for at in offsets:
            start, end = job.split_range(at.split_id)
            check_split_offset(self._state.grant_key, job.info.job_id, job.info.dataset_id,
                               consumer, at, floors.get(at.split_id, 0),
                               split_limit(pipe.source, ops, end - start), lower)

    def _resume_wave_key(self, request, peer: str) -> str:
        """The job key of a round-robin resume: its wave's. Round-robin consumers of one job
        resume from the same round (else their rounds would be read in different jobs, each
        waiting for the others' positions). A wave ends when every consumer resumed or after
        the client timeout; the next one, at any round, reads a new job (consumers resume
        again, from a later checkpoint or the same one). The waves are a table shared fairly
        between peers (``_make_room_for_wave``)."""
        group, round_ = request.resume_group, request.resume_round
        now = time.monotonic()
        wave = self._resumed_rounds.get(group)
        if wave is None and (why := self._displaced_waves.why(group)) is not None:
            self._displaced_waves.forget(group)  # told once: the group's next wave is new
            raise errors.ResourceExhaustedError(why)
        retried = wave is not None and request.consumer_id in wave.consumers
        if wave is None or not retried and (wave.complete
                                            or now - wave.started > self._client_timeout):
            if wave is None:
                self._make_room_for_wave(peer, now)
            wave = self._resumed_rounds[group] = _ResumeWave(
                round_, now, time.time_ns(), request.num_consumers)
            self._wave_shares.discard(group)  # a new wave counts for its peer, as the newest
            self._wave_shares.add(group, peer)
        if wave.round != round_:
            raise errors.FailedPreconditionError(
                f"A consumer of round-robin job {group!r} resumes from round {round_}, another "
                f"resumed from round {wave.round}: round-robin consumers resume together, "
                "from positions saved at the same step.")
        wave.consumers.add(request.consumer_id)
        return f"{request.job_key}-{wave.serial}"  # after the last '/': not shown in status

    def _make_room_for_wave(self, peer: str, now: float) -> None:
        """Room for a new resume wave of ``peer`` in a full table (max_jobs waves): waves
        past the client timeout go (nobody joins them), then by ``fair_shares``' rule
        (waves every consumer resumed in are those nobody uses), their later consumers told
        why; ResourceExhaustedError when the rule refuses. Call with the lock held."""
        waves, shares, most = self._resumed_rounds, self._wave_shares, self._quotas.max_jobs
        if len(waves) < most:
            return
        for group in [g for g, w in waves.items() if now - w.started > self._client_timeout]:
            del waves[group]
            shares.discard(group)
        if len(waves) < most:
            return
        limit = f"{most} waves, limits max_jobs"
        room = shares.make_room(peer, len(waves) + 1 - most, unused=sorted(
            (g for g in waves if waves[g].complete), key=lambda g: waves[g].started))
        if room is None:
            raise shares.refusal(
                "This tf.data service dispatcher's table of round-robin resume waves", limit,
                peer, 1, "A wave goes once all its consumers resumed and another peer needs "
                f"room, or {self._client_timeout:g} s after it began. Retry later, or resume "
                "fewer round-robin jobs at once from this peer.")
        for group in room:
            if not waves[group].complete:
                self._displaced_waves.remember(group, shares.displacement(
                    f"The resume wave of round-robin job {group!r}", "this tf.data service "
                    "dispatcher's table of round-robin resume waves", limit, group, peer))
            del waves[group]
            shares.discard(group)

    def _keep_resumable(self, job: Job, consumer: str) -> None:
        """``consumer`` saved its position: from now on its splits stay its own while it is
        away (for job_gc_timeout_ms). Call with the lock held."""
        if consumer not in job.resumable and consumer not in job.released:
            self._commit(JournalEntry(resumable=JournalSplit(job_id=job.info.job_id,
                                                             consumer_id=consumer)))

    def _workers_for(self, job: Job) -> list:
        order = list(job.info.worker_order) or None
        return self._state.live_workers(self._worker_timeout, order)

    def _job(self, job_id: int) -> Job:
        job = self._state.jobs.get(job_id)
        if job is None:
            why = self._displaced_jobs.why(job_id)
            if why is not None:
                raise errors.ResourceExhaustedError(why)
            raise errors.NotFoundError(
                f"Job {job_id} not found: it finished and was garbage collected after "
                "job_gc_timeout_ms without consumers.")
        return job

    def _seen(self, job: Job, consumer: str) -> None:
        now = time.monotonic()
        job.last_active = now
        self._state.unread_jobs.pop(job.info.job_id, None)
        if consumer not in job.released:  # a heartbeat overtaken by the release
            job.saw(consumer, now)

    def _on_client_heartbeat(self, request, _buffers):
        with self._cond:
            job = self._job(request.job_id)
            if (request.finished and not job.info.finished
                    and job.info.sharding_policy != ShardingPolicy.DYNAMIC):
                self._commit(JournalEntry(finished_job=job.info.job_id))
            _refuse_if_superseded(job, request)
            if request.resumable:
                self._keep_resumable(job, request.consumer_id)
            if request.release:
                self._release(job, request)
            else:
                self._seen(job, request.consumer_id)
            now = time.monotonic()
            replies = self._heartbeat_replies
            return replies.reply(
                job, self._state.live_view(self._worker_timeout, now), self._state.workers,
                request.workers_version, replies.interval_ms(self._state.jobs.values(), now)), []

    def _release(self, job: Job, request) -> None:
        """A consumer stopped: remove its anonymous job, or give a named job's splits it
        held back to the pool at the offsets it reached; a resumable consumer's splits stay
        its own (dormant) at those offsets. Call with the lock held."""
        consumer = request.consumer_id
        job.last_active = time.monotonic()
        mine = sorted(job.assigned.of(consumer))
        reached = {u.split_id: u.offset for u in request.unfinished}
        self._check_offsets(job, consumer, [u for u in request.unfinished if u.split_id in mine],
                            dict(job.offsets), lower=True)
        record = JournalSplitsDone(
            job_id=job.info.job_id, consumer_id=consumer, split_ids=mine,
            offsets=[max(reached.get(s, 0), job.offsets.get(s, 0)) for s in mine])
        if consumer in job.resumable:
            self._commit(JournalEntry(kept=record))
            return
        job.consumers.pop(consumer, None)
        job.released.add(consumer)
        if not job.named and job.info.owner in ("", consumer):
            self._commit(JournalEntry(removed_job=job.info.job_id))
        elif mine:
            self._commit(JournalEntry(returned=record))

    def _on_get_split(self, request, _buffers):
        with self._cond:
            job = self._job(request.job_id)
            if request.consumer_id in job.released:
                raise errors.CancelledError(
                    f"Consumer {request.consumer_id!r} released job {job.info.job_id}; a new "
                    "iteration reads as a new consumer.")
            _refuse_if_superseded(job, request)
            self._expire_consumers(job, time.monotonic())
            if request.resumable:
                self._keep_resumable(job, request.consumer_id)
            self._seen(job, request.consumer_id)
            return self._next_split(job, request.consumer_id, set(request.held),
                                    list(request.done)), []

    def _next_split(self, job: Job, consumer: str, held: set[int], done: list[int]
                    ) -> DataResponse:
        done_here = [s for s in done if job.assigned.get(s) == consumer]
        if done_here:
            self._commit(JournalEntry(done=JournalSplitsDone(
                job_id=job.info.job_id, consumer_id=consumer, split_ids=done_here)))
        response = DataResponse()
        result = response.get_split
        lost = [s for s in job.assigned.of(consumer) if s not in held]
        if lost:  # assigned before, but the answer never reached the consumer
            split_id = min(lost)
        elif job.pool or job.next_split < job.total_splits:
            split_id = job.pool[0] if job.pool else job.next_split
            self._commit(JournalEntry(assign=JournalSplit(
                job_id=job.info.job_id, split_id=split_id, consumer_id=consumer)))
        else:
            # Splits other consumers hold may come back to the pool (a consumer stopping
            # early or timing out): the end is the end of all of them.
            result.end_of_splits = job.all_splits_done
            if job.all_splits_done and not job.info.finished:
                self._commit(JournalEntry(finished_job=job.info.job_id))
            return response
        result.has_split = True
        result.split.split_id = split_id
        result.split.unit_start, result.split.unit_end = job.split_range(split_id)
        result.split.offset = job.offsets.get(split_id, 0)
        result.split.handout = job.handout_index(consumer, split_id)
        if result.split.offset:
            result.split.vouch.CopyFrom(vouches.vouch(
                self._state.grant_key, job.info.dataset_id, vouches.split_stream(split_id),
                job.info.job_id, consumer, result.split.offset, result.split.offset))
        result.split.grant = grants.grant(self._state.grant_key, StreamSpec(
            job_id=job.info.job_id, dataset_id=job.info.dataset_id, is_split=True,
            split_id=split_id, unit_start=result.split.unit_start,
            unit_end=result.split.unit_end, handed_at=result.split.offset), consumer)
        return response

    def _on_worker_heartbeat(self, request, _buffers):
        worker = request.worker
        worker_auth.check(self._worker_token, request.worker_token, worker.address)
        order = self._config.worker_addresses
        if order and worker.address not in order:
            raise errors.FailedPreconditionError(
                f"Worker {worker.address} is not in the dispatcher's configured "
                f"worker_addresses {order}.")
        with self._cond:
            if self._state.workers.get(worker.address) != worker:
                self._commit(JournalEntry(worker=worker))
            self._state.saw_worker(worker.address, time.monotonic())
            if ENABLED:
                self._heartbeats.inc(self._monitoring.name)
            response = DataResponse()
            response.worker_heartbeat.live_jobs.extend(self._state.jobs)
            response.worker_heartbeat.grant_key = self._state.grant_key
        return response, []

    def _on_get_status(self, _request, _buffers):
        response = self._monitoring.status(
            "dispatcher", f"{self._host}:{self._endpoint.port}", self._config.protocol)
        report = response.status_report
        now = time.monotonic()
        with self._cond:
            report.workers.extend(
                WorkerSummary(address=address,
                              heartbeat_age_seconds=now - self._state.worker_seen.get(address, 0))
                for address in sorted(self._state.workers))
            report.jobs.extend(
                JobSummary(job_id=job.info.job_id,
                           job_name=job.key.rsplit("/", 1)[0] if job.named else "",
                           dataset_id=job.info.dataset_id,
                           processing_mode=mode_name(job.info.sharding_policy),
                           num_consumers=len(job.consumers), splits_handed=job.splits_handed,
                           splits_completed=job.splits_completed, finished=job.info.finished)
                for job in self._state.jobs.values())
        return response, []

    # ---- garbage collection ----

    def _gc_loop(self) -> None:
        while not self._stopping.wait(self._gc_interval):
            with self._cond:
                self._collect(time.monotonic())

    def _expire_consumers(self, job: Job, now: float) -> None:
        """Give the splits of consumers unheard of for the client timeout back to the pool;
        a resumable consumer's only once it has been away for job_gc_timeout_ms. The
        consumers are in the order they were last heard from: only the timed-out ones and
        the first of the others are looked at."""
        while job.consumers:
            consumer, seen = next(iter(job.consumers.items()))
            if now - seen <= self._client_timeout:
                break
            del job.consumers[consumer]
            if consumer in job.resumable:
                job.dormant[consumer] = seen
            else:
                self._return_splits(job, consumer)
        for consumer, since in list(job.dormant.items()):
            if self._gc_timeout is not None and now - since > self._gc_timeout:
                job.released.add(consumer)
                self._return_splits(job, consumer)

    def _return_splits(self, job: Job, consumer: str) -> None:
        mine = job.assigned.of(consumer)
        if mine or consumer in job.dormant:
            self._commit(JournalEntry(returned=JournalSplitsDone(
                job_id=job.info.job_id, consumer_id=consumer, split_ids=mine,
                offsets=[job.offsets.get(s, 0) for s in mine])))

    def _collect(self, now: float) -> None:
        for job in list(self._state.jobs.values()):
            self._expire_consumers(job, now)
            if (self._gc_timeout is not None and not job.consumers
                    and now - job.last_active > self._gc_timeout):
                self._commit(JournalEntry(removed_job=job.info.job_id))
        if self._dataset_gc_timeout is None:
            return
        used = {job.info.dataset_id for job in self._state.jobs.values()}
        unused = [d for d, record in self._state.datasets.items()
                  if d not in used and now - record.last_used > self._dataset_gc_timeout]
        self._remove_datasets(unused)


@dataclass
class _ResumeWave:
    """Round-robin consumers of one job resuming from one round."""

    round: int
    started: float
    serial: int  # in its job's key: unique across dispatcher restarts
    num_consumers: int
    consumers: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """Every consumer resumed in it."""
        return len(self.consumers) >= self.num_consumers


class _Durable:
    """A dispatcher's side of its work_dir: the lease and, once replayed, the journal."""

    def __init__(self, lease: Lease | None):
        self.lease = lease
        self.journal: Journal | None = None
        self._closed = False
        self._lock = threading.Lock()

    def adopt(self, journal: Journal) -> None:
        """Write to ``journal`` from now on; CancelledError if closed meanwhile."""
        with self._lock:
            if self._closed:
                raise errors.CancelledError("This dispatcher was stopped.")
            self.journal = journal

    def describe(self, target: str) -> None:
        """Name this dispatcher, at ``target``, in the lease file."""
        if self.lease is not None:
            self.lease.describe(target)

    def close(self) -> None:
        """Close the journal, then let go of the lease (idempotent)."""
        with self._lock:
            self._closed = True
            if self.journal is not None:
                self.journal.close()
            if self.lease is not None:
                self.lease.release()


def _shutdown(endpoint: Shell, stopping: threading.Event, durable: _Durable,
              monitoring: Monitoring, grace: float | None) -> None:
    stopping.set()
    try:
        endpoint.stop(grace)
    finally:
        monitoring.close()
        durable.close()


def _samples(server: str, state: DispatcherState, lock: threading.Condition,
             worker_timeout: float, durable: _Durable) -> list[Sample]:
    """The dispatcher's gauges and split counts (a registry source; it must not hold the
    DispatchServer, whose collection stops it)."""
    with lock:
        workers = len(state.live_workers(worker_timeout))
        samples = [Sample(catalog.DATA_WORKERS, (server,), workers),
                   Sample(catalog.DATA_JOBS, (server,), len(state.jobs))]
        for job in state.jobs.values():
            if job.info.sharding_policy == ShardingPolicy.DYNAMIC:
                labels = (server, str(job.info.job_id))
                samples += [Sample(catalog.DATA_SPLITS_HANDED, labels, job.splits_handed),
                            Sample(catalog.DATA_SPLITS_DONE, labels, job.splits_completed)]
    samples.append(Sample(catalog.DATA_JOURNAL_BYTES, (server,),
                          0 if durable.journal is None else durable.journal.nbytes()))
    return samples


def _handed_at(job: Job, consumer: str, split_id: int) -> int:
    """The offset ``split_id`` was last handed to ``consumer`` at (0: none kept)."""
    index = job.handout_index(consumer, split_id)
    if index < 0:
        return 0
    return job.handouts[consumer][index - job.handout_base.get(consumer, 0)][1]


def _refuse_if_superseded(job: Job, request) -> None:
    """CancelledError for a request of an iterator whose consumer a later one resumed."""
    if job.is_stale(request.consumer_id, request.generation):
        raise errors.CancelledError(
            f"Consumer {request.consumer_id!r} of job {job.info.job_id} was resumed by a "
            "later iterator; this one stops.")
