"""WorkerServer: runs dataset pipelines and serves their elements to consumers.

A worker registers with the dispatcher and heartbeats; it learns datasets
from the dispatcher on first use and starts a stream when a consumer first
asks for one (a whole dataset, a static shard, or one split of the source).

A consumer that stops reading releases its streams (``ReleaseStreamsRequest``, each stream
named with the grant the consumer read it with), so they stop counting against the stream
limits at once rather than when the job is collected:

* a split stream is its consumer's alone (its grant names the consumer): closed;
* an anonymous job's stream is its one consumer's (the grant names it, ``StreamSpec.owner``):
  closed;
* a named job's stream is shared: it stays for the job's other consumers (and, as in TF, for
  consumers joining the job later). Once every consumer that read it has released it, it is
  *abandoned*; an abandoned stream is closed only when another stream could not start
  otherwise, and a consumer reading it later gets a FailedPreconditionError.

A released stream is not opened again by a read of the same attempt (a read racing the
release would otherwise start one nobody releases); a later attempt at a split may open it.

A read naming a trainer (``StreamSpec.trainer_id``, from ``CrossTrainerCache``) reads the
job's shared stream through its cross-trainer cache. TF's requirements (a named,
parallel_epochs job of an infinite dataset, no round-robin reads) are checked when the stream
opens; every consumer of a job reads it with a trainer id, or none does. A worker caches as
many jobs at once as its memory's share for caches holds (``cross_trainer_cache.cache_plan``);
a cached job nobody read for ``limits.idle_cache_s`` gives its slot to a job that needs one (its
cache is dropped; a trainer coming back starts a new window). While every slot is read, they
are shared fairly between the peers that opened them (``clusterwire.fair_shares``): a peer
holding fewer takes the slot of the peer holding the most, whose trainers are told why.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_host_port, split_target
from clusterwire.at_exit import stop_at_exit
from clusterwire.data import compression, elements, grants, graph, provenance, vouches, worker_auth
from clusterwire.data.config import (
    CROSS_TRAINER_CACHE_SIZE_BYTES,
    DISPATCHER_TIMEOUT_MS,
    HEARTBEAT_INTERVAL_MS,
    WorkerConfig,
    as_config,
    runtime_ms,
    server_limits,
    server_listen_options,
    server_security,
    warn_if_unsafe,
)
from clusterwire.data.cross_trainer_cache import cache_plan, machine_memory
from clusterwire.data.limits import ThreadBudget
from clusterwire.data.modes import COMPRESSION_SNAPPY, ShardingPolicy
from clusterwire.data.monitoring import MonitoredServer, Monitoring
from clusterwire.data.permissions import WorkerPermissions
from clusterwire.data.pipeline import Pipeline, split_plan
from clusterwire.data.position import check_stream_offset
from clusterwire.data.rpc import DispatcherClient, serve
from clusterwire.data.splits import file_shard
from clusterwire.data.streams import Stream
from clusterwire.fair_shares import Displaced, FairShares
from clusterwire.metrics import REGISTRY, catalog
from clusterwire.metrics.registry import ENABLED, Sample
from clusterwire.protos.data_service_pb2 import (
    DataRequest,
    DataResponse,
    GetDatasetRequest,
    GetElementsRequest,
    ReleaseStreamsRequest,
    StreamSpec,
    Vouch,
    WorkerHeartbeatRequest,
    WorkerInfo,
)
from clusterwire.security import Security
from clusterwire.shell import Shell
from clusterwire.waiting import wait_event

# The worker's stream quotas (open streams, per consumer, idle times, removed jobs kept) are
# its config's ``limits`` (clusterwire.data.quotas.ServiceLimits).
_FINISHED_STREAM_S = 30.0
_REMOVED_JOB = (
    "Job {job} is no longer one of the dispatcher's jobs (it was released, collected after "
    "job_gc_timeout_ms, or displaced from the dispatcher's full job table: the dispatcher "
    "says which). This worker does not start its streams again, which would hand out their "
    "elements a second time: start a new iteration.")
_IDLE_SHARED = (
    "This tf.data service worker closed job {job}'s shared stream after {idle:g} s without a "
    "read. Its consumers cannot continue it (starting it again would hand out its elements a "
    "second time): start a new iteration.")
_MAX_READ_BYTES = 8 << 20  # a read's batch when it names no max_bytes
#: Why a stream was refused for now (its ResourceExhaustedError has ``retry_later``).
_OVER_LIMITS = "over its stream limits"
_FIRST_REGISTRATION_S = 5.0
_STOP_CHECK_S = 1.0  # how often wait_registered looks whether the worker was stopped

log = logging.getLogger("clusterwire")


def _substitute(address: str, placeholder: str, port: int) -> str:
    return address.replace(placeholder, str(port))


def _worker_config(config: WorkerConfig | dict | None, dispatcher_address: str | None,
                   port: Any, protocol: str | None) -> WorkerConfig:
    """The worker's config: ``config`` (or one made of the arguments) with the arguments
    given beside it in place of its fields."""
    config = as_config(config, WorkerConfig)
    if config is None:
        return WorkerConfig(dispatcher_address=dispatcher_address, port=port or 0,
                            protocol=protocol)
    overrides = {k: v for k, v in (("dispatcher_address", dispatcher_address),
                                   ("port", port), ("protocol", protocol)) if v is not None}
    if not overrides:
        return config
    # Validate only the overrides: re-building the whole config would turn its stored 0 ms
    # fields (runtime defaults) into 1 ms (TF's mapping of 0).
    checked = WorkerConfig(**{"dispatcher_address": config.dispatcher_address, **overrides})
    return config._replace(**{k: getattr(checked, k) for k in overrides})


class WorkerServer(MonitoredServer):
    """A tf.data service worker (``tf.data.experimental.service.WorkerServer``).

    ``WorkerServer(port=0, dispatcher_address=None, protocol="grpc",
    start=True, config=None)``; as in TF, a ``WorkerConfig`` may be the first
    argument. ``dispatcher_address`` is ``host:port`` (a ``protocol://``
    prefix is accepted). Without a dispatcher address: ValueError.

    Its metrics (elements and bytes sent per job, buffered elements, open streams, and the
    requests it served) carry the label ``server`` = ``metrics_name``; with the config's
    ``metrics_port`` they are served at ``metrics_url``; a ``GetStatusRequest``
    (``clusterwire.data.service_status``) returns them.
    """

    def __init__(self, port: Any = None, dispatcher_address: str | None = None,
                 protocol: str | None = None, start: bool = True,
                 config: WorkerConfig | dict | None = None):
        if isinstance(port, (WorkerConfig, dict)):
            port, config = None, port
        self._config = config = _worker_config(config, dispatcher_address, port, protocol)
        self._quotas = server_limits(config)
        warn_if_unsafe(config, "worker")
        self._permissions = WorkerPermissions(config.function_modules, config.readable_dirs)
        # Every pipeline this worker builds from a client's definition runs under these.
        self._limits = (config.pipeline_limits,
                        ThreadBudget(config.pipeline_limits.max_pipeline_threads))
        security = server_security(config)
        self._worker_token = worker_auth.load(config.worker_token_file, security)
        self._streams: dict[tuple[int, int, str, int], Stream] = {}
        self._lock = threading.Lock()
        self._info = self._serve(config, security)
        self._sent = REGISTRY.family(catalog.DATA_ELEMENTS)
        self._sent_bytes = REGISTRY.family(catalog.DATA_ELEMENT_BYTES)
        _, dispatcher = split_target(config.dispatcher_address)
        self._dispatcher = DispatcherClient(
            config.protocol, dispatcher,
            runtime_ms(config.dispatcher_timeout_ms, DISPATCHER_TIMEOUT_MS) / 1000, security)
        self._heartbeat_s = runtime_ms(config.heartbeat_interval_ms, HEARTBEAT_INTERVAL_MS) / 1000
        self._cache_bytes, self._cache_slots = cache_plan(
            config.cross_trainer_cache_size_bytes, machine_memory(),
            CROSS_TRAINER_CACHE_SIZE_BYTES, self._quotas.max_cached_jobs)
        # (job, consumer, split or -1) -> (the last attempt released, when)
        self._released: dict[tuple[int, str, int], tuple[int, float]] = {}
        self._ledger = vouches.Ledger()  # where each vouched stream's answers stand
        self._evicted: dict[int, float] = {}  # jobs whose abandoned shared stream was closed
        # (job, split or -1, consumer or "") of streams displaced for another peer's, and why
        self._displaced: Displaced[tuple[int, int, str]] = Displaced(
            16 * self._quotas.max_open_streams)
        # The jobs of the dispatcher's last heartbeat answer, and the jobs it no longer lists
        # that this worker knew (listed before, or streams it ran): never opened again.
        self._live_jobs: set[int] = set()
        self._removed_jobs: Displaced[int] = Displaced(self._quotas.removed_jobs_kept)
        # Jobs whose shared stream was closed idle (an anonymous job's own stream is opened
        # again where its consumer says it is, with the service's vouch).
        self._idle_shared: Displaced[int] = Displaced(self._quotas.removed_jobs_kept)
        self._datasets: dict[str, Pipeline] = {}
        self._dataset_locks: dict[str, threading.Lock] = {}
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._started = False
        self._registered = threading.Event()
        self._registration_problem: str | None = None  # why the last attempt failed
        self._grant_key = b""  # from the dispatcher's heartbeat answers
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                            name="clusterwire-data-heartbeat")
        self._finalizer = stop_at_exit(self, _shutdown, self._endpoints(), self._stopping,
                                       self._dispatcher, self._streams, self._monitoring, None)
        if start:
            self.start()

    def _serve(self, config: WorkerConfig, security: Security) -> WorkerInfo:
        """Start the listeners (the worker's and, with data_transfer_protocol, the
        data-transfer one) and the metrics; what the dispatcher is told of them. On failure
        nothing started is left serving."""
        options = server_listen_options(security)
        host = split_host_port(_substitute(config.worker_address, "%port%", 0))[0]
        self._monitoring = Monitoring("data-worker")
        name = self._monitoring.name
        self._transfer: Shell | None = None
        try:
            self._endpoint = serve(config.protocol, host, config.port, self._handle, name,
                                   options, config.send_tracebacks)
        except BaseException:
            self._monitoring.close()
            raise
        info = WorkerInfo(address=_substitute(config.worker_address, "%port%",
                                              self._endpoint.port),
                          protocol=config.protocol)
        try:
            if config.data_transfer_protocol:
                transfer_host = split_host_port(
                    _substitute(config.data_transfer_address, "%dts_port%", 0))[0]
                self._transfer = serve(config.data_transfer_protocol, transfer_host, 0,
                                       self._handle, f"{name}/transfer", options,
                                       config.send_tracebacks)
                info.transfer_protocol = config.data_transfer_protocol
                info.transfer_address = _substitute(config.data_transfer_address, "%dts_port%",
                                                    self._transfer.port)
            self._monitoring.start(functools.partial(_samples, name, self._streams, self._lock),
                                   config.metrics_port, config.metrics_host, security)
        except BaseException:
            for endpoint in self._endpoints():
                endpoint.stop(0)
            self._monitoring.close()
            raise
        return info

    def _endpoints(self) -> list[Shell]:
        return [e for e in (self._endpoint, self._transfer) if e is not None]

    # ---- lifecycle ----

    @property
    def address(self) -> str:
        """The worker address the dispatcher tells clients."""
        return self._info.address

    @property
    def config(self) -> WorkerConfig:
        """The configuration, with the bound port."""
        return self._config._replace(port=self._endpoint.port)

    def start(self) -> None:
        """Serve and register with the dispatcher (waits up to 5 s for the registration;
        the worker keeps trying after that, as TF's does: ``wait_registered``)."""
        with self._lock:
            if self._stopped.is_set():
                raise errors.FailedPreconditionError("This worker was stopped.")
            if self._started:
                return
            for endpoint in self._endpoints():
                endpoint.start()
            self._heartbeats.start()
            self._started = True
        self._registered.wait(_FIRST_REGISTRATION_S)

    def join(self, timeout: float | None = None) -> bool:
        """Block until the server is stopped (or ``timeout`` passes); True once stopped.

        Signal handlers (Ctrl-C) still run promptly while the main thread waits here.
        """
        return wait_event(self._stopped, timeout)

    @property
    def registered(self) -> bool:
        """Whether the dispatcher has accepted this worker (clients get elements only then)."""
        return self._registered.is_set()

    @property
    def registration_problem(self) -> str | None:
        """Why the dispatcher has not accepted this worker yet (the last attempt's error:
        unreachable, refused, a wrong worker token...); None once registered or before the
        first attempt ended."""
        return None if self._registered.is_set() else self._registration_problem

    def wait_registered(self, timeout: float | None = None) -> bool:
        """Block until the dispatcher has accepted this worker (True), the worker is stopped
        or ``timeout`` passes (False). Signal handlers still run while the main thread
        waits here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stopping.is_set():
            left = _STOP_CHECK_S if deadline is None else min(
                _STOP_CHECK_S, deadline - time.monotonic())
            if left <= 0:
                break
            if wait_event(self._registered, left):
                return True
        return self._registered.is_set()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving, stop every pipeline and free the port (idempotent)."""
        if self._finalizer.detach() is not None:
            _shutdown(self._endpoints(), self._stopping, self._dispatcher, self._streams,
                      self._monitoring, grace)
        self._stopped.set()

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # ---- dispatcher ----

    def _heartbeat_loop(self) -> None:
        request = DataRequest(worker_heartbeat=WorkerHeartbeatRequest(worker=self._info))
        refused = False
        while not self._stopping.is_set():
            request.worker_heartbeat.worker_token = (
                self._worker_token or worker_auth.local_token(self._dispatcher.address))
            with self._lock:  # the answer judges these only: later jobs may be unlisted
                known = {*self._live_jobs, *(key[0] for key in self._streams),
                         *(key[0] for key in self._released), *self._evicted}
            registered = self._registered.is_set()
            try:
                # Until registered, each attempt fails at once with its reason (said by
                # registration_problem), not after dispatcher_timeout_ms of retries.
                response, _ = self._dispatcher.call(request, retry=registered)
            except errors.CancelledError:
                return
            except errors.OpError as err:
                if not registered:
                    self._registration_problem = err.message
                if isinstance(err, errors.PermissionDeniedError) and not refused:
                    refused = True  # said once; the operator may still fix the dispatcher
                    log.error("clusterwire: tf.data service worker %s: %s", self._info.address,
                              err.message)
                if self._stopping.wait(min(self._heartbeat_s, 1.0)):
                    return
                continue
            self._grant_key = response.worker_heartbeat.grant_key
            self._registered.set()
            self._drop_streams(set(response.worker_heartbeat.live_jobs), known)
            if self._stopping.wait(self._heartbeat_s):
                return

    def _drop_streams(self, live_jobs: set[int], known: set[int]) -> None:
        """Close the streams of the jobs the dispatcher no longer lists among the ``known``
        ones (those this worker knew when it sent the heartbeat: a job created since is not
        listed yet), and idle ones; a removed job's streams are never opened again."""
        now, idle_s = time.monotonic(), self._quotas.idle_stream_s
        removed = known - live_jobs
        with self._lock:
            for job in removed:
                self._removed_jobs.remember(job, _REMOVED_JOB.format(job=job))
            self._live_jobs = live_jobs
            dead = [key for key, stream in self._streams.items()
                    if key[0] in removed or now - stream.last_used > idle_s
                    or (key[1] >= 0 and stream.finished
                        and now - stream.last_used > _FINISHED_STREAM_S)]
            streams = [self._streams.pop(key) for key in dead]
            for key, stream in zip(dead, streams, strict=True):
                if key[1] < 0 and not stream.owner and key[0] not in removed \
                        and not stream.finished:
                    self._idle_shared.remember(
                        key[0], _IDLE_SHARED.format(job=key[0], idle=idle_s))
            self._released = {k: r for k, r in self._released.items()
                              if k[0] not in removed and now - r[1] < idle_s}
            self._evicted = {j: t for j, t in self._evicted.items()
                             if j not in removed and now - t < idle_s}
        for stream in streams:
            stream.close()
        for family in (self._sent, self._sent_bytes):
            for sample in family.samples():
                server, job = sample.labels
                if server == self._monitoring.name and int(job) not in live_jobs:
                    family.remove(server=server, job_id=job)

    def _pipeline(self, dataset_id: str) -> Pipeline:
        with self._lock:
            found = self._datasets.get(dataset_id)
            lock = self._dataset_locks.setdefault(dataset_id, threading.Lock())
        if found is not None:
            return found
        with lock:
            with self._lock:
                found = self._datasets.get(dataset_id)
            if found is None:
                response, buffers = self._dispatcher.call(
                    DataRequest(get_dataset=GetDatasetRequest(dataset_id=dataset_id)))
                found = graph.from_def(response.get_dataset.dataset, buffers,
                                       self._permissions, self._config.allow_cloudpickle,
                                       self._limits)
                with self._lock:
                    self._datasets[dataset_id] = found
        return found

    # ---- serving ----

    def _handle(self, request: DataRequest, _buffers: list[Any], peer: str
                ) -> tuple[DataResponse, list]:
        kind = request.WhichOneof("kind")
        if kind == "get_status":
            return self._monitoring.status(
                "worker", self.address, self._config.protocol,
                [e.name for e in self._endpoints() if e is not self._endpoint]), []
        if kind not in ("get_elements", "release_streams"):
            raise errors.UnimplementedError(
                f"A tf.data service worker serves element reads, not {kind!r} (is this the "
                "dispatcher's address?).")
        if not self._grant_key:
            raise errors.UnavailableError(
                "This tf.data service worker has not registered with its dispatcher yet.")
        if kind == "release_streams":
            return self._release_streams(request.release_streams), []
        return self._get_elements(request.get_elements, peer)

    def _check_grant(self, spec: StreamSpec, consumer_id: str) -> None:
        grants.check(self._grant_key, spec, consumer_id)
        if not spec.is_split and spec.owner and spec.owner != consumer_id:
            raise errors.PermissionDeniedError(
                f"Job {spec.job_id} is another consumer's anonymous job: only it reads or "
                "releases its streams. Read your own job through distribute() or "
                "from_dataset_id().")

    def _release_streams(self, request: ReleaseStreamsRequest) -> DataResponse:
        """Close the consumer's own streams; a named job's shared stream only forgets it.

        Every grant is checked before anything is closed: a release naming one stream the
        consumer was not granted closes nothing.
        """
        consumer = request.consumer_id
        for spec in request.streams:
            self._check_grant(spec, consumer)
        now, closed = time.monotonic(), []
        with self._lock:
            for spec in request.streams:
                if not spec.is_split and not spec.owner:
                    shared = self._streams.get((spec.job_id, -1, "", 0))
                    if shared is not None:
                        shared.forget(consumer)
                    continue
                split = spec.split_id if spec.is_split else -1
                last = self._released.get((spec.job_id, consumer, split), (-1, now))[0]
                self._released[(spec.job_id, consumer, split)] = (max(last, spec.attempt), now)
                closed += [self._streams.pop(key) for key in list(self._streams)
                           if key[0] == spec.job_id and (
                               key[1:3] == (split, consumer) and key[3] <= spec.attempt
                               if spec.is_split else key[1] == -1)]
        for stream in closed:
            stream.close()
        response = DataResponse()
        response.release_streams.closed = len(closed)
        return response

    def _get_elements(self, read: GetElementsRequest, peer: str) -> tuple[DataResponse, list]:
        spec = read.stream
        self._check_grant(spec, read.consumer_id)
        key = ((spec.job_id, spec.split_id, read.consumer_id, spec.attempt) if spec.is_split
               else (spec.job_id, -1, "", 0))
        with self._lock:
            stream = self._streams.get(key)
        if stream is None:
            stream = self._open(spec, read.offset, key, read.consumer_id, peer,
                                read.vouch if read.HasField("vouch") else None)
        if stream.element_ids != spec.element_ids:
            raise errors.InvalidArgumentError(
                f"Job {spec.job_id}'s stream on this worker is read "
                f"{'with' if stream.element_ids else 'without'} element ids, this read asks "
                f"{'with' if spec.element_ids else 'without'}: every consumer of a named job "
                "passes the same element_ids (use another job_name for the other kind).")
        if stream.cache is not None or spec.trainer_id:
            taken, end = self._read_cached(stream, read), False
        elif spec.num_consumers:
            taken, end = stream.fetch_at(read.consumer_id, read.request_seq, read.position,
                                         read.wait_seconds)
        else:
            taken, end = stream.fetch(read.consumer_id, read.request_seq,
                                      max(read.max_elements, 1),
                                      read.max_bytes or _MAX_READ_BYTES, read.wait_seconds)
        if taken and ENABLED:
            job, server = str(spec.job_id), self._monitoring.name
            self._sent.inc(server, job, amount=len(taken))
            self._sent_bytes.inc(server, job, amount=sum(e.nbytes for e in taken))
        response = DataResponse()
        response.get_elements.elements.extend(e.header for e in taken)
        response.get_elements.end_of_stream = end
        if (taken if spec.num_consumers else stream.owner and stream.cache is None):
            self._vouch(response.get_elements.vouch, stream, spec, read, len(taken))
        return response, [b for e in taken for b in e.buffers]

    @staticmethod
    def _read_cached(stream: Stream, read: GetElementsRequest) -> list:
        """A read of a job's stream through its cross-trainer cache."""
        spec = read.stream
        if stream.cache is None or not spec.trainer_id:
            cached, asked = ("enabled", "disabled") if stream.cache else ("disabled", "enabled")
            raise errors.InvalidArgumentError(
                f"Tried to read job {spec.job_id}, but found an existing stream of it with "
                f"different parameters: Existing cross-trainer cache: <{cached}>; got "
                f"<{asked}>. Every consumer of a job passes cross_trainer_cache (each with "
                "its trainer_id), or none does: use another job_name for the other kind.")
        return stream.fetch_cached(spec.trainer_id, read.consumer_id, read.request_seq,
                                   max(read.max_elements, 1), read.max_bytes or _MAX_READ_BYTES,
                                   read.wait_seconds)

    def cross_trainer_cache_bytes(self) -> int:
        """Bytes the cross-trainer caches of this worker's jobs hold (each at most
        ``cross_trainer_cache_size_bytes``; its stream produces one element more ahead)."""
        with self._lock:
            caches = [s.cache for s in self._streams.values() if s.cache is not None]
        return sum(cache.nbytes for cache in caches)

    def _vouch(self, into: Vouch, stream: Stream, spec: StreamSpec, read: GetElementsRequest,
               count: int) -> None:
        """Vouch for the elements this answer hands of a split's, an anonymous job's or a
        round-robin job's stream (a position within them can be resumed: data/vouches.py)."""
        if spec.num_consumers:  # the element at read.position of those after the skip
            start, end = stream.skip + read.position, stream.skip + read.position + count
            what = vouches.round_robin_stream(self.address, spec.num_consumers)
        else:
            start, end = self._ledger.handed(stream, read.request_seq, count)
            what = (vouches.split_stream(spec.split_id) if spec.is_split
                    else vouches.worker_stream(self.address))
        into.CopyFrom(vouches.vouch(self._grant_key, spec.dataset_id, what, spec.job_id,
                                    read.consumer_id, start, end))

    def _open(self, spec: StreamSpec, offset: int, key: tuple, consumer_id: str, peer: str,
              vouch: Vouch | None = None) -> Stream:
        if spec.compression == COMPRESSION_SNAPPY:
            compression.require()
        mode = spec.compression if compression.available() else ""
        pipe = self._pipeline(spec.dataset_id)
        if spec.trainer_id:
            _check_cross_trainer_cache(spec, pipe)
        if spec.element_ids:
            provenance.check(pipe)
        if offset or spec.handed_at:
            check_stream_offset(self._grant_key, spec, consumer_id, offset, vouch, pipe,
                                self.address)
        with self._lock:
            stream = self._streams.get(key)
            if stream is not None:
                return stream
            self._check_openable(spec, consumer_id, key)
            cache_room = self._cache_room(spec.job_id, peer) if spec.trainer_id else []
            if offset and not (spec.is_split or spec.owner or spec.num_consumers):
                raise errors.InvalidArgumentError(
                    f"A read of job {spec.job_id}'s shared stream asked to skip {offset} "
                    "elements: only a split, an anonymous job's own stream or a resumed "
                    "round-robin job's stream starts later.")
            # A new attempt at a split replaces the consumer's earlier ones.
            attempts = [k for k in self._streams if spec.is_split and k[:3] == key[:3]]
            if any(k[3] > key[3] for k in attempts):
                raise errors.CancelledError(
                    f"Attempt {spec.attempt} at split {spec.split_id} was superseded by a "
                    "later one of the same consumer.")
            replaced = self._admit(spec, key, attempts, consumer_id, peer)
            for cached, why in cache_room:  # the cached jobs it displaces go only now
                if why is not None:
                    self._displaced.remember(cached[:3], why)
                if cached in self._streams:
                    replaced.append(self._streams.pop(cached))
            # A split's later attempt, or a resumed consumer's stream, skips `offset`.
            opened: list[Stream] = []
            stream = self._streams[key] = Stream(
                self._elements(pipe, spec, lambda: bool(opened) and opened[0].closed),
                lambda e: elements.encode(e, mode),
                cache_bytes=self._cache_bytes if spec.trainer_id else 0, skip=offset,
                owner=consumer_id if spec.is_split or spec.owner else "", peer=peer,
                element_ids=spec.element_ids, max_bytes=self._quotas.stream_buffer_bytes,
                max_elements=self._quotas.stream_buffer_elements,
                max_trainers=self._quotas.max_cache_trainers)
            opened.append(stream)
        for old in replaced:
            old.close()
        return stream

    def _cache_room(self, job_id: int, peer: str) -> list[tuple[tuple, str | None]]:
        """The cached jobs' streams a new cached job of ``peer`` takes the slots of (none
        while a slot is free), each with why for its readers (None: a job nobody read for
        ``limits.idle_cache_s``, which goes first, whoever's it is, or one every trainer released;
        its trainers may open it again); the others by ``fair_shares``' rule (a job every
        trainer released is one nobody uses), the streams counting for the peers that
        opened them. ResourceExhaustedError when the rule refuses. Lock held; nothing
        changes until the caller applies it."""
        cached = [k for k, s in self._streams.items() if s.cache is not None]
        need = len(cached) + 1 - self._cache_slots
        if need <= 0:
            return []
        now, idle_s = time.monotonic(), self._quotas.idle_cache_s
        idle = sorted((k for k in cached if now - self._streams[k].last_used > idle_s),
                      key=lambda k: self._streams[k].last_used)[:need]
        room: list[tuple[tuple, str | None]] = [(k, None) for k in idle]
        if len(room) == need:
            return room
        shares: FairShares[tuple] = FairShares()
        for k in cached:  # oldest first: the streams dict is in the order they opened
            if k not in idle:
                shares.add(k, self._streams[k].peer)
        abandoned = sorted((k for k in cached if k not in idle and self._streams[k].abandoned),
                           key=lambda k: self._streams[k].last_used)
        limit = (f"{self._cache_slots} cached jobs of up to {self._cache_bytes} bytes each, "
                 "from its memory")
        taken = shares.make_room(peer, need - len(room), unused=abandoned)
        if taken is None:
            raise shares.refusal(
                f"This tf.data service worker is {_OVER_LIMITS}: its table of cross-trainer "
                "caches", limit, peer, 1,
                f"A job nobody reads for {idle_s:g} s (limits idle_cache_s) gives its slot "
                f"up. Retry later (reading job {job_id}), share a job_name between the "
                "trainers, or add workers.", retry_later=True)
        return room + [(k, None if k in abandoned else shares.displacement(
            f"The cross-trainer cache of job {k[0]}", "this tf.data service worker's "
            "table of cross-trainer caches", limit, k, peer)) for k in taken]

    @property
    def pipeline_threads(self) -> int:
        """Pipeline threads (parallel map and interleave pools, prefetch producers) this
        worker's streams hold, at most ``pipeline_limits.max_pipeline_threads``."""
        return self._limits[1].used

    @property
    def cross_trainer_cache_slots(self) -> int:
        """Jobs this worker keeps a cross-trainer cache of at once (``cache_plan``)."""
        return self._cache_slots

    def _check_openable(self, spec: StreamSpec, consumer_id: str, key: tuple) -> None:
        """Refuse streams of a released consumer, of a job whose shared stream was evicted,
        of a job the dispatcher removed, and streams displaced for another peer's; call with
        the lock held."""
        why = self._displaced.why(key[:3])
        if why is not None:
            raise errors.ResourceExhaustedError(why)
        why = self._removed_jobs.why(spec.job_id)
        if why is not None:
            raise errors.NotFoundError(why)
        why = self._idle_shared.why(spec.job_id) if key[1] < 0 and not spec.owner else None
        if why is not None:
            raise errors.FailedPreconditionError(why)
        released = self._released.get(
            (spec.job_id, consumer_id, spec.split_id if spec.is_split else -1))
        if released is not None and spec.attempt <= released[0]:
            raise errors.CancelledError(
                f"Consumer {consumer_id!r} released this stream of job {spec.job_id}.")
        if not spec.is_split and not spec.owner and spec.job_id in self._evicted:
            raise errors.FailedPreconditionError(
                f"This tf.data service worker closed job {spec.job_id}'s stream after every "
                "consumer that read it had released it, to serve other jobs. A consumer "
                "joining that job later cannot continue it: start a new iteration or use "
                "another job_name.")

    def _admit(self, spec: StreamSpec, key: tuple, attempts: list[tuple], consumer_id: str,
               peer: str) -> list[Stream]:
        """Room for a new stream of ``peer`` under the limits (a full worker gives up
        abandoned streams first, ``_abandoned``, then streams by ``fair_shares``' rule), or
        ResourceExhaustedError; returns the streams it replaces (popped). Lock held."""
        running = [k for k, s in self._streams.items() if not s.finished and k not in attempts]
        # A consumer's share counts its split streams and its anonymous jobs' streams, in
        # every job (a named job's shared stream is nobody's).
        mine = sum(self._streams[k].owner == consumer_id for k in running) \
            if spec.is_split or spec.owner else 0
        per_consumer, most = self._quotas.max_streams_per_consumer, self._quotas.max_open_streams
        if mine >= per_consumer:
            raise errors.ResourceExhaustedError(
                f"This tf.data service worker is {_OVER_LIMITS}: it runs {len(running)} "
                f"streams, {mine} of them for this consumer (reading job {spec.job_id}); its "
                f"limit is {per_consumer} a consumer (limits max_streams_per_consumer). Retry "
                "later or add workers.", retry_later=True)
        evicted: list[tuple] = []
        now = time.monotonic()
        limit = f"{most} streams, limits max_open_streams"
        if len(running) >= most:
            shares: FairShares[tuple] = FairShares()
            for k in running:  # oldest first: the streams dict is in the order they opened
                shares.add(k, self._streams[k].peer)
            abandoned = sorted((k for k in running if self._abandoned(k, now)),
                               key=lambda k: self._streams[k].last_used)
            room = shares.make_room(peer, len(running) - most + 1,
                                    unused=abandoned)
            if room is None:
                raise shares.refusal(
                    f"This tf.data service worker is {_OVER_LIMITS}: its stream table",
                    limit, peer, 1,
                    f"Retry later (reading job {spec.job_id}), or add workers.", retry_later=True)
            evicted = room
            for k in evicted:
                if k not in abandoned:  # its readers are told at their next read
                    self._displaced.remember(k[:3], shares.displacement(
                        f"The stream of job {k[0]}" + (f", split {k[1]}" if k[1] >= 0 else ""),
                        "this tf.data service worker's stream table",
                        limit, k, peer))
                elif k[1] == -1:  # a shared stream: a consumer joining its job later is told
                    self._evicted[k[0]] = now
        # Only once the new stream is admitted do the attempts it replaces go.
        return [self._streams.pop(k) for k in [*attempts, *evicted]]

    def _abandoned(self, key: tuple, now: float) -> bool:
        """Whether the stream of ``key`` may give its room: a shared stream every consumer
        released, or a split's stream idle for ``limits.idle_split_stream_s``. Lock
        held."""
        stream = self._streams[key]
        if key[1] == -1:
            return stream.abandoned
        return now - stream.last_used > self._quotas.idle_split_stream_s

    @staticmethod
    def _elements(pipe: Pipeline, spec: StreamSpec, closed: Callable[[], bool]):
        """The stream's pipeline run; its source ends once ``closed()``, so a pipeline that
        computes without producing (a huge ``skip``, a filter keeping nothing) stops with
        its stream."""
        if spec.element_ids:
            pipe = provenance.tagged(pipe)
        if spec.is_split:
            plan = split_plan(pipe)
            return pipe.run(_until(closed, lambda: pipe.source.read(spec.unit_start,
                                                                     spec.unit_end)), plan.ops)
        policy = ShardingPolicy(spec.sharding_policy)
        shard = file_shard(pipe.source, spec.shard_index, spec.num_shards) \
            if spec.num_shards and policy in (ShardingPolicy.FILE, ShardingPolicy.FILE_OR_DATA) \
            else None
        if shard is not None:
            return pipe.run(_until(closed, shard.iterate))
        run = pipe.run(_until(closed, pipe.source.iterate))
        if spec.num_shards and policy in (ShardingPolicy.DATA, ShardingPolicy.FILE_OR_DATA):
            return itertools.islice(run, spec.shard_index, None, spec.num_shards)
        return run


def _until(closed: Callable[[], bool], source: Callable[[], Iterator[Any]]
           ) -> Callable[[], Iterator[Any]]:
    """``source``'s iterators, ending once ``closed()``."""
    def run() -> Iterator[Any]:
        for element in source():
            if closed():
                return
            yield element
    return run


def _check_cross_trainer_cache(spec: StreamSpec, pipe: Pipeline) -> None:
    """TF's requirements of a job read through a cross-trainer cache."""
    if spec.owner:
        raise errors.InvalidArgumentError(
            "Cross-trainer caching requires named jobs. Got empty `job_name`.")
    cardinality = pipe.cardinality()
    if cardinality >= 0:
        raise errors.InvalidArgumentError(
            "Cross-trainer caching requires the input dataset to be infinite. Got input with "
            f"cardinality {cardinality}. Add a .repeat() to the dataset.")
    if spec.num_consumers:
        raise errors.InvalidArgumentError(
            "Cross-trainer caching does not support coordinated reads. Got number of "
            f"coordinated consumers: {spec.num_consumers}. Drop consumer_index and "
            "num_consumers, or cross_trainer_cache.")
    if spec.is_split or spec.sharding_policy != ShardingPolicy.OFF:
        policy = next((p.name for p in ShardingPolicy if p == spec.sharding_policy),
                      spec.sharding_policy)
        raise errors.InvalidArgumentError(
            "Cross-trainer caching requires processing_mode='parallel_epochs' "
            "(ShardingPolicy.OFF), where each worker produces the whole dataset for the "
            f"trainers to share; got {policy}.")


def _shutdown(endpoints: list[Shell], stopping: threading.Event,
              dispatcher: DispatcherClient, streams: dict, monitoring: Monitoring,
              grace: float | None) -> None:
    stopping.set()
    try:
        for endpoint in endpoints:
            endpoint.stop(grace)
    finally:
        monitoring.close()
        dispatcher.close()
        for stream in list(streams.values()):
            stream.close()


def _samples(server: str, streams: dict[Any, Stream], lock: threading.Lock) -> list[Sample]:
    """The worker's stream gauges (a registry source; it must not hold the WorkerServer,
    whose collection stops it)."""
    with lock:
        kept = list(streams.values())
    finished = sum(s.finished for s in kept)
    return [Sample(catalog.DATA_BUFFERED, (server,), sum(s.buffered for s in kept)),
            Sample(catalog.DATA_STREAMS, (server,), len(kept) - finished),
            Sample(catalog.DATA_FINISHED_STREAMS, (server,), finished)]
