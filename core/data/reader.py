"""JobReader: one iteration of a distributed dataset, reading a job's elements from workers.

Background threads fetch batches of elements from the workers into a
bounded queue that ``__next__`` drains:

* parallel_epochs and static sharding: one reader thread per worker stream.
* distributed_epoch: ``SLOTS_PER_WORKER`` threads per worker, each reading
  one split at a time. The consumer owns its splits: it counts the elements
  received of each, and when a worker fails it moves the split to another
  worker, which skips the elements already received. For a deterministic
  pipeline no element is lost or repeated. Finished splits are acknowledged
  to the dispatcher with the next split request (or, stopped first, with the release).

Batches are decoded (and decompressed) in order on ``_DECODERS`` threads, so a
reader thread asks for its next batch as soon as one arrives. Only the job's
first read asks for a single element (a fast first element); later reads,
also of new splits, ask for whole batches.

A heartbeat thread keeps the job alive at the dispatcher and learns which
workers are alive (new workers join, dead ones are dropped).

``__next__`` times how long the training loop waits for each element: the histogram
``clusterwire_data_consumer_wait_seconds`` of the process (its count: the elements read),
exported when the training process serves its metrics
(``clusterwire.metrics.endpoint.serve_metrics``). Each reader counts into its own histogram
(no lock per element); a scrape adds up the live readers' and those of readers gone.

Workers that stop answering (a read times out after ``read_timeout_s`` or fails) are
retried while the dispatcher lists them:

* distributed_epoch: the worker's splits move to the other workers at once; the worker is
  probed with backoff and, once it answers, reads splits again (orphaned ones first). A
  split that no worker could take for ``stalled_s`` fails the iteration with an
  UnavailableError: never a silent hang.
* parallel_epochs (and static sharding): the read is repeated (same sequence number:
  nothing lost) with backoff. A worker the dispatcher drops (or that does not answer for
  ``stalled_s``) is given up, as in TF: the other workers' elements keep coming and a
  warning names the worker and what is lost. If that leaves a partial copy of the data (or
  a static shard incomplete), the iteration ends with a DataLossError, not a normal end: a
  user counting on whole epochs must not mistake a truncated one for complete, while an
  endless (repeated) training input goes on as in TF. A worker that delivered nothing is as
  one that never joined (one copy fewer, none partial): a warning only.

A worker refusing a stream over its stream limits (other consumers hold them) is asked again
with backoff for up to ``busy_s`` before its ResourceExhaustedError is raised.

These windows, timeouts and idle times are the fields of ``TIMINGS``
(``clusterwire.data.read_timings.ReadTimings``).

Stopping early (``close()``, a ``take``/``break``, or the reader collected) releases what
the consumer held: its streams on every worker it read from (each named with the grant the
consumer read it with, so nobody can release another consumer's streams) and its job at the
dispatcher (which removes an anonymous job, or gives a named job's unfinished splits to its
other consumers at the element this consumer returned last). As in TF, elements a consumer
fetched are its own: those it buffered from splits it had read to their end, but never
returned, are lost with it (as a TF iterator's prefetched ones; other consumers do not wait
for a consumer's user to take what it fetched).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.data import elements, provenance
from clusterwire.data.modes import STATIC_POLICIES, ShardingPolicy, mode_name
from clusterwire.data.position import JobPosition, Offset, Position, group_of
from clusterwire.data.read_timings import ReadTimings
from clusterwire.data.rpc import DispatcherClient, WorkerChannels
from clusterwire.metrics import REGISTRY, catalog
from clusterwire.metrics.registry import ENABLED, Histogram, Sample
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    DataRequest,
    GetElementsRequest,
    GetOrCreateJobRequest,
    GetSplitRequest,
    JobInfo,
    ReleaseStreamsRequest,
    SplitOffset,
    StreamSpec,
    Vouch,
    WorkerInfo,
)

log = logging.getLogger(__name__)

SLOTS_PER_WORKER = 2
_MAX_ELEMENTS = 1024
_MAX_BYTES = 8 << 20
#: The readers' retry windows, timeouts and idle times (``clusterwire.data.read_timings``);
#: a reader takes the table as it is when the reader is made.
TIMINGS = ReadTimings()
_WORKER_FAILURES = (errors.UnavailableError, errors.DeadlineExceededError, errors.CancelledError)
_END = object()
_CLOSED = object()  # wakes a __next__ waiting when close() comes from another thread
# Threads decoding (decompressing) received batches while the readers fetch the next ones.
_DECODERS = 2


@dataclass(frozen=True)
class ReadOptions:
    """What a consumer asked for in ``distribute`` / ``from_dataset_id``."""

    dataset_id: str
    policy: ShardingPolicy
    job_name: str | None
    consumer_index: int | None
    num_consumers: int
    max_elements: int
    data_transfer_protocol: str | None
    compression: str  # what this client accepts: "", "auto" or "snappy"
    target_workers: str
    trainer_id: str = ""  # reads through the workers' cross-trainer caches as this trainer
    element_ids: bool = False  # yields (id, element) pairs (data/provenance.py)


@dataclass
class _Split:
    split_id: int
    unit_start: int
    unit_end: int
    grant: bytes
    received: int = 0  # elements read from workers: where a new attempt starts
    consumed: int = 0  # elements returned by __next__: where another consumer resumes
    attempt: int = 0
    orphaned_at: float = 0.0
    address: str = ""  # the worker reading it
    handout: int = -1  # its index among the splits the job handed this consumer
    handed_at: int = 0  # the offset it was handed at (its grant's)
    ended: bool = False  # read to its end (``consumed`` may still be behind ``received``)
    # The service's word for ``consumed`` and for ``received`` (data/vouches.py; None at 0).
    vouch: Vouch | None = None
    received_vouch: Vouch | None = None


class _SplitLedger:
    """A distributed_epoch consumer's splits, as its position counts them (callers hold the
    reader's lock): every split handed before hand-out ``handed`` is in ``unread`` or was
    read completely; later ones read completely are in ``_completed`` (split -> hand-out),
    the others' hand-outs in ``_handouts``. A resumed position's completed splits are never
    handed again, so ``handed`` stays below each and every later position lists them."""

    def __init__(self) -> None:
        self.unread: dict[int, _Split] = {}
        self.handed = 0
        self._handouts: set[int] = set()
        self._completed: dict[int, int] = {}
        self._resumed_completed: frozenset[int] = frozenset()

    def resume(self, handed: int, completed: Iterable[int]) -> None:
        """Start from a saved position's hand-out count and completed splits."""
        self.handed, self._resumed_completed = handed, frozenset(completed)

    def handed_out(self, split: _Split) -> None:
        """The job handed this consumer ``split``."""
        self.unread[split.split_id] = split
        if split.handout >= self.handed:
            self._handouts.add(split.handout)
            while self.handed in self._handouts:
                self._handouts.discard(self.handed)
                self.handed += 1

    def returned(self, split: _Split) -> None:
        """Once ``split`` is read to its end and all of it returned, it leaves the
        position's partial ones."""
        if split.ended and split.consumed >= split.received and \
                self.unread.pop(split.split_id, None) is not None:
            if split.handout >= self.handed:
                self._completed[split.split_id] = split.handout
            for done in [s for s, at in self._completed.items() if at < self.handed]:
                del self._completed[done]

    def partial(self) -> dict[int, Offset]:
        """The splits handed and not all returned: the elements returned of each."""
        return {s.split_id: Offset(s.consumed, s.vouch) for s in self.unread.values()}

    def completed(self) -> tuple[int, ...]:
        """The splits handed after ``handed`` and read completely."""
        return tuple(sorted(self._resumed_completed.union(
            split for split, at in self._completed.items() if at >= self.handed)))


@dataclass
class _StreamPosition:
    """Elements of one worker's stream returned by __next__ (parallel_epochs, static)."""

    consumed: int = 0
    vouch: Vouch | None = None  # the service's word for ``consumed`` (None at 0)


@dataclass
class _Failure:
    """A distributed_epoch worker that failed a read, probed with backoff."""

    delay: float
    next_try: float
    probing: bool = False


@dataclass
class _WorkerTable:
    """What a reader knows of its job's workers (callers hold the reader's lock)."""

    listed: dict[str, WorkerInfo] = field(default_factory=dict)  # by the dispatcher, now
    failed: dict[str, _Failure] = field(default_factory=dict)  # probed (distributed_epoch)
    threads: dict[str, int] = field(default_factory=dict)  # worker -> its reader threads
    running: int = 0  # reader threads, in all
    opened: dict[str, dict[Any, StreamSpec]] = field(default_factory=dict)  # not ended
    dropped: dict[str, str] = field(default_factory=dict)  # given up -> what was lost


@dataclass
class _SplitsInFlight:
    """A distributed_epoch reader's splits between the dispatcher and its position
    (callers hold the reader's lock)."""

    orphans: list[_Split] = field(default_factory=list)  # off a failed worker, to read
    held: dict[int, _Split] = field(default_factory=dict)  # handed, not read to the end
    done: list[_Split] = field(default_factory=list)  # read to the end, not acknowledged
    end_of_splits: bool = False  # the dispatcher said no split is left to hand out


@dataclass
class _Resumed:
    """Where a read resumed from a saved position starts (empty for a new read)."""

    offsets: dict[str, Offset] = field(default_factory=dict)  # worker stream -> elements
    first_round: int = 0  # round-robin reads: resumed from this round
    workers: list[str] | None = None  # the round-robin position's workers
    exhausted: Position | None = None  # resumed after the end: this position


@dataclass
class _Batch:
    """Received elements, decoded (and decompressed) on a decoder thread, so the reader
    thread asks for the next batch at once."""

    headers: Any  # the response's ElementHeaders
    buffers: list[Any]
    vouch: Vouch | None = None  # the worker's word for the elements (data/vouches.py)

    def __len__(self) -> int:
        return len(self.headers)

    def decode(self) -> list[Any]:
        return elements.decode_all(self.headers, self.buffers)


class _ConsumerWaits:
    """The process's consumer-wait histogram: every reader's own, added up when read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[Histogram] = set()
        self._gone = Histogram(catalog.DATA_CONSUMER_WAIT.buckets)
        self._reporting = False

    def track(self, reader: JobReader) -> Histogram:
        """A histogram for ``reader`` to count its waits in (reported until it is collected,
        then added to those of the readers gone)."""
        waits = Histogram(catalog.DATA_CONSUMER_WAIT.buckets)
        with self._lock:
            self._live.add(waits)
            if not self._reporting:
                REGISTRY.add_source(self.samples)
                self._reporting = True
        weakref.finalize(reader, self._retire, waits)
        return waits

    def _retire(self, waits: Histogram) -> None:
        with self._lock:
            self._live.discard(waits)
            self._gone.add(waits)

    def samples(self) -> list[Sample]:
        """The histogram (a registry source)."""
        with self._lock:
            total, live = self._gone.copy(), list(self._live)
        for waits in live:
            total.add(waits)
        return [Sample(catalog.DATA_CONSUMER_WAIT, (), total)]


_WAITS = _ConsumerWaits()


def _is_local(address: str) -> bool:
    host = split_host_port(address)[0]
    return host in ("localhost", "::1") or host.startswith("127.")


class JobReader(Iterator[Any]):
    """Iterates over the elements of one job (created or joined on construction).

    ``close()`` (also reached by a ``take``, a ``break`` or garbage collection) releases the
    consumer's streams on the workers and its job at the dispatcher; see the module docstring.
    The time each ``next()`` waits for its element is counted in the process's
    ``clusterwire_data_consumer_wait_seconds`` histogram, which the training process
    exports by calling ``clusterwire.metrics.endpoint.serve_metrics(port)``.
    """

    def __init__(self, dispatcher: DispatcherClient, options: ReadOptions, iteration: int,
                 position: Position | JobPosition | None = None):
        self._dispatcher = dispatcher
        self._options = options
        self._times = TIMINGS
        self._iteration = iteration
        self._consumer = uuid.uuid4().hex
        self._channels = WorkerChannels(dispatcher.security)
        self._decoder = ThreadPoolExecutor(_DECODERS, "clusterwire-data-decode")
        self._queue: queue.Queue = queue.Queue(maxsize=16)
        self._batch: deque = deque()
        # [split or stream, elements of it still in _batch, the worker's vouch for them]
        self._credits: deque[list] = deque()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._split_lock = threading.Lock()
        self._seq = itertools.count(1)
        # Attempts at splits grow across processes: a resumed consumer's reads (same consumer
        # id) must not land in the streams its earlier process opened.
        self._attempts = itertools.count(time.time_ns())
        self._workers = _WorkerTable()
        self._reading = _SplitsInFlight()
        self._ended = False
        self._stalled = False
        self._round_robin_started = False
        self._finished = False
        self._released = False
        self._delivered = False  # a batch was read (later splits start with a whole batch)
        # The consumer's position (state_dict): elements returned, each worker stream's
        # (parallel_epochs, static) and, in distributed_epoch, the splits handed to it.
        self._elements = 0
        self._positions: dict[str, _StreamPosition] = {}
        self._splits = _SplitLedger()
        self._resumable = False  # the dispatcher keeps this consumer's splits for a resume
        self._generation = 0  # of a resumed consumer: later than any earlier iterator's
        self._resumed = _Resumed()
        self._round_workers: list[str] | None = None  # the workers rounds go to (in order)
        self._private = options.job_name is None  # no other consumer reads its streams
        self._returned_all = False  # the iteration ended (not stopped early)
        self._waits = _WAITS.track(self) if ENABLED else None
        # Element ids the position leaves out: read with ids, dropped in __next__.
        self._skip = position.skip if position is not None else ()
        self._publish = (provenance.Publisher(frozenset(self._skip), options.element_ids)
                         if options.element_ids or self._skip else None)
        if position is not None and position.finished:
            self._resume_after_the_end(options, position)
        else:
            self._join_job(options, iteration, position)

    def _join_job(self, options: ReadOptions, iteration: int,
                  position: Position | JobPosition | None) -> None:
        """Create or join the job at the dispatcher and start reading its workers (and
        the heartbeat that keeps it alive), unless it has finished already."""
        request = self._job_request(options, iteration, position)
        self._key = request.job_key
        response, _ = self._dispatcher.call(DataRequest(get_or_create_job=request))
        self._job: JobInfo = response.job
        if self._job.finished:
            self._finished = self._released = self._returned_all = True
            return
        self._update_workers(list(self._job.workers))
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name="clusterwire-data-client-heartbeat")
        self._heartbeat.start()

    def _resume_after_the_end(self, options: ReadOptions,
                              position: Position | JobPosition) -> None:
        """Resumed from a position saved after the iteration ended: it ends at once, and
        its position stays that one."""
        _check_resumable(options, position)
        self._resumed.exhausted = position if isinstance(position, Position) else Position(
            position.dataset_id, position.processing_mode, position.iteration,
            position.job_key, self._consumer, finished=True, group=position.group,
            skip=position.skip)
        self._job = JobInfo(sharding_policy=options.policy)
        self._finished = self._released = True

    def _job_request(self, options: ReadOptions, iteration: int,
                     position: Position | JobPosition | None) -> GetOrCreateJobRequest:
        """The job this consumer reads: a new or named one, or the one it resumes."""
        named = options.job_name is not None
        key = f"{options.job_name}/{iteration}" if named else f"anonymous/{self._consumer}"
        request = GetOrCreateJobRequest(
            dataset_id=options.dataset_id, sharding_policy=options.policy, job_key=key,
            named=named, num_consumers=options.num_consumers,
            target_workers=options.target_workers, consumer_id=self._consumer)
        if position is None:
            return request
        _check_resumable(options, position)
        if isinstance(position, JobPosition):
            # A new consumer of the job: the first one has the merged consumers' unread
            # splits given back to the pool, the others join.
            request.job_key = position.job_key
            request.merged.extend(position.requests())
            request.merge_group = position.group
            return request
        self._elements = position.elements
        if options.num_consumers:
            # Every consumer resumes from the same round, in the job of the rounds from there,
            # named by the group only the read job's consumers know (another client cannot
            # take or block it; the last part of a key is not shown in status).
            group = position.group or key
            request.job_key = f"{key}/round-{position.elements}" + (
                f"/{position.group}" if position.group else "")
            request.resume_group, request.resume_round = group, position.elements
            self._resumed.first_round = position.elements
            self._resumed.workers = list(position.workers)
            self._resumed.offsets = dict(position.streams)  # the vouches for the skips
            return request
        if options.policy != ShardingPolicy.DYNAMIC:
            # A job of its own whose worker streams skip what was returned before.
            request.named, self._private = False, True
            self._resumed.offsets = dict(position.streams)
            return request
        self._consumer = request.consumer_id = position.consumer_id
        request.job_key, request.resume = position.job_key, True
        request.handed = position.handed
        request.partial.extend(SplitOffset(split_id=split, offset=offset.count,
                                           vouch=offset.vouch)
                               for split, offset in position.partial.items())
        request.completed.extend(position.completed)
        self._splits.resume(position.handed, position.completed)
        request.generation = self._generation = time.time_ns()
        self._resumable = True
        return request

    # ---- position ----

    def state_dict(self) -> dict[str, Any]:
        """This consumer's position: a small JSON-serialisable dict from which
        ``distribute(..., state=...)`` / ``from_dataset_id(..., state=...)`` resume the
        iteration, in this process or another one (see data/position.py). Elements returned
        after it are returned once more by the resumed iteration, no others.

        In distributed_epoch the first call tells the dispatcher to keep this consumer's
        splits for it while it is away (for job_gc_timeout_ms), even after ``close()``.
        """
        position = self.position()
        self.keep_splits()
        return position.to_dict()

    def position(self) -> Position:
        """The position ``state_dict()`` would return now, without ``keep_splits()``: for
        an iterator handing this one's elements on later (one that prefetches), which
        remembers the position of each element it holds."""
        if self._resumed.exhausted is not None:
            return self._resumed.exhausted
        policy = ShardingPolicy(self._job.sharding_policy)
        if policy != ShardingPolicy.DYNAMIC and not self._private \
                and not self._options.num_consumers:
            raise errors.FailedPreconditionError(
                f"Consumers of a named {mode_name(policy)} job share its worker streams, so "
                "one consumer's position is not a position in them. Save positions of "
                "distributed_epoch reads (each split is one consumer's), or read without "
                "job_name.")
        with self._lock:
            partial, completed = self._splits.partial(), self._splits.completed()
            streams = {address: Offset(p.consumed, p.vouch)
                       for address, p in self._positions.items()}
            workers = self._round_workers or (sorted(self._workers.listed)
                                              if self._options.num_consumers else [])
        return Position(
            dataset_id=self._options.dataset_id, processing_mode=int(policy),
            iteration=self._iteration, job_key=self._key, consumer_id=self._consumer,
            handed=self._splits.handed, partial=partial, completed=completed,
            streams={**self._resumed.offsets, **streams}, elements=self._elements,
            workers=tuple(workers), consumer_index=self._options.consumer_index or 0,
            num_consumers=self._options.num_consumers, finished=self._returned_all,
            group=group_of(self._job.grant)
            if self._options.num_consumers or policy == ShardingPolicy.DYNAMIC else "",
            skip=self._skip)

    def keep_splits(self) -> None:
        """distributed_epoch: have the dispatcher keep this consumer's splits for it while it
        is away (job_gc_timeout_ms), to resume from a saved position (once is enough)."""
        if (self._job.sharding_policy == ShardingPolicy.DYNAMIC and not self._resumable
                and not self._finished):
            self._dispatcher.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
                job_id=self._job.job_id, consumer_id=self._consumer, resumable=True,
                generation=self._generation)))
            self._resumable = True

    # ---- iteration ----

    def __iter__(self) -> JobReader:
        return self

    def __next__(self) -> Any:
        started = perf_counter()
        element = self._next_element()
        while self._publish is not None:
            element = self._publish(element)
            if element is not provenance.DROPPED:
                break
            element = self._next_element()  # a skipped one: returned as far as positions go
        self._elements += 1
        if self._waits is not None:
            self._waits.observe(perf_counter() - started)
        return element

    def _next_element(self) -> Any:
        """The next element received, counted as returned in the position."""
        while not self._batch:
            if self._finished:
                raise StopIteration
            kind, payload, position, vouch = self._queue.get()
            if kind is _CLOSED:
                continue
            if kind is _END:
                self._finish()
                raise StopIteration
            if kind == "error":
                self.close()
                raise payload
            try:
                decoded = payload.result()
            except errors.OpError:
                self.close()
                raise
            self._batch.extend(decoded)
            if position is not None and decoded:
                self._credits.append([position, len(decoded), vouch])
        if self._credits:
            credit = self._credits[0]
            credit[0].consumed += 1
            credit[0].vouch = credit[2]
            credit[1] -= 1
            if not credit[1]:
                self._credits.popleft()
                if isinstance(credit[0], _Split):
                    with self._lock:
                        self._splits.returned(credit[0])
        return self._batch.popleft()

    def _finish(self) -> None:
        self._release(finished=True)
        self._returned_all = not self._workers.dropped  # a resumed iteration ends at once
        if self._workers.dropped:
            raise errors.DataLossError(
                "The parallel_epochs iteration ended without the rest of the elements of "
                f"{len(self._workers.dropped)} worker(s): "
                + "; ".join(f"{a} ({lost})" for a, lost in sorted(self._workers.dropped.items()))
                + ". Each worker's copy of the data is its own (as in TF); keep workers up "
                "(or raise the dispatcher's worker_timeout_ms), or use distributed_epoch, "
                "which moves a lost worker's splits to the others.")

    def close(self) -> None:
        """Stop reading and release the consumer's streams and its job (idempotent).

        Waits up to ``release_wait_s`` (``TIMINGS``) for the workers and the dispatcher to
        confirm; the releases go on in the background after that.
        """
        self._release(finished=False)

    def __del__(self) -> None:
        if hasattr(self, "_job"):
            self._release(finished=False, wait=False)

    def _release(self, finished: bool, wait: bool = True) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            self._finished = True
            self._stop.set()
            # A split read to its end whose acknowledgement was not sent (this consumer
            # stopped first) is given back at its end: its elements are this consumer's.
            unfinished = [SplitOffset(split_id=s.split_id, offset=s.consumed, vouch=s.vouch)
                          for s in self._reading.held.values()] + [
                SplitOffset(split_id=s.split_id, offset=s.received, vouch=s.received_vouch)
                for s in self._reading.done]
            streams = {a: list(specs.values())
                       for a, specs in self._workers.opened.items() if specs}
        with contextlib.suppress(queue.Full):  # full: __next__ is not waiting
            self._queue.put_nowait((_CLOSED, None, None, None))
        self._decoder.shutdown(wait=False, cancel_futures=True)
        request = DataRequest(client_heartbeat=ClientHeartbeatRequest(
            job_id=self._job.job_id, consumer_id=self._consumer, finished=finished,
            release=True, unfinished=unfinished, resumable=self._resumable,
            generation=self._generation))
        sender = threading.Thread(target=self._send_releases, args=(request, streams),
                                  daemon=True, name="clusterwire-data-release")
        sender.start()
        if wait:
            sender.join(self._times.release_wait_s)

    def _send_releases(self, request: DataRequest, streams: dict[str, list[StreamSpec]]
                       ) -> None:
        """Release the streams on each worker (in parallel) and the job at the dispatcher."""
        try:
            workers = [threading.Thread(target=self._release_streams, args=item, daemon=True)
                       for item in streams.items()]
            for thread in workers:
                thread.start()
            with contextlib.suppress(errors.OpError):  # else collected after job_gc_timeout
                self._dispatcher.call(request)
            for thread in workers:
                thread.join()
        finally:
            self._channels.close()
            self._dispatcher.close()

    def _release_streams(self, address: str, specs: list[StreamSpec]) -> None:
        endpoint = self._endpoint(address)
        if endpoint is None:
            return  # the worker left: its streams went with it or go with the job
        request = DataRequest(release_streams=ReleaseStreamsRequest(
            consumer_id=self._consumer, streams=specs))
        try:
            self._channels.call(*endpoint, request, self._times.release_timeout_s)
        except errors.OpError as err:
            log.debug("Releasing %d streams on worker %s failed: %s", len(specs), address, err)

    def _put(self, kind: Any, payload: Any = None,
             position: _Split | _StreamPosition | None = None) -> None:
        """Queue a batch (and what its elements advance when returned, with the worker's
        vouch for them), an error or _END."""
        vouch = None
        if kind == "batch":
            vouch = payload.vouch
            try:
                payload = self._decoder.submit(payload.decode)
            except RuntimeError:  # closed meanwhile
                return
        while not self._stop.is_set():
            try:
                self._queue.put((kind, payload, position, vouch), timeout=0.1)
                return
            except queue.Full:
                continue

    def _fail(self, err: errors.OpError) -> None:
        """Hand ``err`` to ``__next__`` without blocking the caller on a full queue."""
        threading.Thread(target=self._put, args=("error", err), daemon=True).start()

    # ---- workers ----

    def _heartbeat_loop(self) -> None:
        times = self._times
        # The dispatcher's list of the job's workers and its version: the reply carries a
        # list only when the version changed (0: none held yet, or a dispatcher that does
        # not version its lists and always sends one). Its floor on the interval keeps a
        # dispatcher of many consumers at its consumer_heartbeat_rate.
        version, workers, floor_s = 0, [], 0.0
        while not self._stop.wait(max(floor_s, times.heartbeat_s if self._workers.listed
                                      else times.no_worker_poll_s)):
            request = DataRequest(client_heartbeat=ClientHeartbeatRequest(
                job_id=self._job.job_id, consumer_id=self._consumer,
                resumable=self._resumable, generation=self._generation,
                workers_version=version))
            try:
                response, _ = self._dispatcher.call(request)
            except errors.CancelledError:
                return
            except errors.OpError as err:
                self._put("error", err)
                return
            beat = response.client_heartbeat
            if not beat.workers_version or beat.workers_version != version:
                version, workers = beat.workers_version, list(beat.workers)
            floor_s = beat.heartbeat_interval_ms / 1000
            self._update_workers(workers)
            if self._job.sharding_policy == ShardingPolicy.DYNAMIC:
                self._revive()

    def _update_workers(self, workers: list[WorkerInfo]) -> None:
        if self._options.target_workers == "LOCAL":
            workers = [w for w in workers if _is_local(w.address)]
        dynamic = self._job.sharding_policy == ShardingPolicy.DYNAMIC
        with self._lock:
            listed = {w.address: w for w in workers}
            unlisted = [w for a, w in self._workers.listed.items() if a not in listed]
            self._workers.listed = listed
            for address in [a for a in self._workers.failed if a not in self._workers.listed]:
                del self._workers.failed[address]  # listed again later: a fresh start
            new = [w.address for w in workers if w.address not in self._workers.threads]
            if dynamic:
                slots = self._reserve_slots(new) or self._reserve_poller()
            else:
                for address in new:
                    self._workers.threads[address] = 0
        if self._stop.is_set():
            return
        if dynamic and not self._options.num_consumers:
            # The dispatcher stopped hearing from these: their reads in flight fail now and
            # their splits move on (or wait for them), not at the read's timeout.
            for worker in unlisted:
                self._channels.close_channel(*self._endpoint_of(worker))
        if self._options.num_consumers:
            if new and not self._round_robin_started:
                self._round_robin_started = True
                self._spawn(self._round_robin, new[0])
        elif dynamic:
            self._start_slots(slots)
        else:
            for address in new:
                self._spawn(self._stream_reader, address)

    def _spawn(self, target: Any, address: str) -> None:
        with self._lock:
            self._reserve(address)
        self._start(target, address)

    def _reserve(self, address: str, threads: int = 1) -> None:
        """Count reader threads about to start (call with the lock held)."""
        self._workers.running += threads
        self._workers.threads[address] = self._workers.threads.get(address, 0) + threads

    def _start(self, target: Any, address: str) -> None:
        threading.Thread(target=self._run, args=(target, address), daemon=True,
                         name="clusterwire-data-read").start()

    # ---- split slots (distributed_epoch) ----

    def _reserve_slots(self, addresses: list[str]) -> list[str]:
        """Reserve split slots up to ``SLOTS_PER_WORKER`` on each listed, unfailed worker of
        ``addresses`` while splits may come; the addresses to start them on (lock held)."""
        if self._reading.end_of_splits and not self._reading.orphans:
            return []
        slots = []
        workers = self._workers
        for address in addresses:
            missing = SLOTS_PER_WORKER - workers.threads.get(address, 0)
            if address in workers.listed and address not in workers.failed and missing > 0:
                self._reserve(address, missing)
                slots += [address] * missing
        return slots

    def _reserve_poller(self) -> list[str]:
        """With no slot running and the splits not ended, one slot asks the dispatcher again
        (another consumer may give splits back); lock held."""
        if self._workers.running or (self._reading.end_of_splits and not self._reading.orphans):
            return []
        idle = [a for a in self._workers.listed if a not in self._workers.failed]
        if idle:
            self._reserve(idle[0])
        return idle[:1]

    def _start_slots(self, addresses: list[str]) -> None:
        for address in addresses:
            self._start(self._split_slot, address)

    def _fill_idle_workers(self) -> None:
        """A split came (more may follow): every listed worker gets its slots again."""
        with self._lock:
            slots = self._reserve_slots(list(self._workers.listed))
        if not self._stop.is_set():
            self._start_slots(slots)

    def _run(self, target: Any, address: str) -> None:
        try:
            target(address)
        except errors.OpError as err:
            self._put("error", err)
        except Exception as err:  # a bug: surface it rather than hang
            self._put("error", errors.InternalError(f"{type(err).__name__}: {err}"))
        finally:
            with self._lock:
                self._workers.running -= 1
                self._workers.threads[address] -= 1
                reading = self._reading
                ended = not self._ended and self._workers.running == 0 and not reading.orphans \
                    and (self._job.sharding_policy != ShardingPolicy.DYNAMIC
                         or reading.end_of_splits)
                self._ended = self._ended or ended
            if ended:
                self._put(_END)

    def _endpoint(self, address: str) -> tuple[str, str] | None:
        with self._lock:
            worker = self._workers.listed.get(address)
        return None if worker is None else self._endpoint_of(worker)

    def _endpoint_of(self, worker: WorkerInfo) -> tuple[str, str]:
        """(protocol, address) this consumer reads ``worker`` at."""
        wanted = self._options.data_transfer_protocol
        if wanted and worker.transfer_protocol == wanted:
            return worker.transfer_protocol, worker.transfer_address
        return worker.protocol, worker.address

    def _track(self, address: str, key: Any, spec: StreamSpec, ended: bool) -> None:
        """Remember the streams this consumer has open on each worker (to release them)."""
        with self._lock:
            specs = self._workers.opened.setdefault(address, {})
            if ended:
                specs.pop(key, None)
            else:
                specs[key] = spec

    def _read(self, address: str, spec: StreamSpec, seq: int, offset: int = 0,
              first: bool = False, position: int = 0, vouch: Vouch | None = None
              ) -> tuple[_Batch, bool]:
        """One batch from a worker (a single element when ``first``, to start fast), the
        stream starting at ``offset`` (with the service's ``vouch`` for it) if it is new.

        A retry must repeat ``seq``: the worker then answers with the same
        elements instead of handing out new ones.
        """
        request = DataRequest(get_elements=GetElementsRequest(
            stream=spec, consumer_id=self._consumer, request_seq=seq, offset=offset,
            max_elements=1 if first else self._options.max_elements, max_bytes=_MAX_BYTES,
            wait_seconds=self._times.read_wait_s, position=position, vouch=vouch))
        key = spec.split_id if spec.is_split else "job"
        self._track(address, key, spec, ended=False)
        response, buffers = self._call_when_not_busy(address, request)
        end = response.get_elements.end_of_stream
        if end:
            self._track(address, key, spec, ended=True)
        read = response.get_elements
        return _Batch(read.elements, buffers, read.vouch if read.HasField("vouch") else None), end

    def _call_when_not_busy(self, address: str, request: DataRequest) -> tuple[Any, list]:
        """Call the worker; while it refuses the stream over its stream limits, call again
        with backoff for up to ``busy_s``."""
        times = self._times
        deadline, delay = None, times.retry_s
        while True:
            endpoint = self._endpoint(address)
            if endpoint is None:
                raise errors.UnavailableError(f"Worker {address} left the job.")
            try:
                return self._channels.call(*endpoint, request, times.read_timeout_s)
            except errors.ResourceExhaustedError as err:
                if not err.retry_later:  # over its stream limits: others' streams end
                    raise
                deadline = deadline or time.monotonic() + times.busy_s
                if time.monotonic() + delay > deadline:
                    raise errors.ResourceExhaustedError(
                        f"{err.message} (asked again for {times.busy_s:g} s)") from None
            if self._stop.wait(delay):
                raise errors.CancelledError("The reader was closed.")
            delay = times.backoff(delay)

    def _spec(self) -> StreamSpec:
        return StreamSpec(job_id=self._job.job_id, dataset_id=self._job.dataset_id,
                          sharding_policy=self._job.sharding_policy,
                          compression=self._compression(), grant=self._job.grant,
                          owner=self._job.owner, trainer_id=self._options.trainer_id,
                          element_ids=self._publish is not None)

    def _compression(self) -> str:
        wanted, registered = self._options.compression, self._job.compression
        return registered if wanted and registered else ""

    # ---- parallel_epochs / static sharding ----

    def _stream_reader(self, address: str) -> None:
        spec = self._spec()
        order = list(self._job.worker_order)
        if self._job.sharding_policy in STATIC_POLICIES and address in order:
            spec.shard_index, spec.num_shards = order.index(address), len(order)
        start = self._resumed.offsets.get(address, Offset(0))
        offset = start.count
        with self._lock:
            position = self._positions.setdefault(address,
                                                  _StreamPosition(offset, start.vouch))
        # Every read names where this consumer is (``received``, with the service's vouch):
        # a worker that closed the stream (idle past its timeout) starts it again there.
        first, received, vouch = True, offset, start.vouch
        while not self._stop.is_set():
            read = self._read_retrying(address, spec, first=first,
                                       offset=received if spec.owner or first else 0,
                                       vouch=vouch if spec.owner or first else None)
            if read is None:
                self._drop(address, spec, received)
                return
            batch, end = read
            first = False
            received += len(batch)
            vouch = batch.vouch or vouch
            if batch:
                self._put("batch", batch, position)
            if end:
                return

    def _read_retrying(self, address: str, spec: StreamSpec, **read: Any
                       ) -> tuple[_Batch, bool] | None:
        """``_read`` repeated (same sequence number, backoff) while the worker fails but the
        dispatcher lists it, for up to ``stalled_s``; None when the worker is given up."""
        times = self._times
        seq, failing_since, delay = next(self._seq), None, times.retry_s
        while not self._stop.is_set():
            try:
                return self._read(address, spec, seq, **read)
            except _WORKER_FAILURES:
                now = time.monotonic()
                failing_since = failing_since or now
                with self._lock:
                    gone = address not in self._workers.listed
                if gone or now - failing_since > times.stalled_s:
                    return None
                self._stop.wait(delay)
                delay = times.backoff(delay)
        return _Batch([], []), True

    def _drop(self, address: str, spec: StreamSpec, received: int) -> None:
        """Give up a worker's remaining elements, loudly: a warning now and, if that leaves
        a partial copy of the data (or a static shard incomplete), a DataLossError at the end
        of the iteration. A parallel_epochs worker that delivered nothing is as one that never
        joined: the iteration has one copy fewer, none of them partial."""
        if self._stop.is_set():
            return
        with self._lock:
            why = ("the dispatcher no longer lists it" if address not in self._workers.listed
                   else f"it did not answer for {self._times.stalled_s:g} s")
        cardinality = self._job.cardinality
        lost = (f"{cardinality - received} of its {cardinality} elements dropped"
                if cardinality > 0 and not spec.num_shards
                else f"its elements after the first {received} dropped")
        partial = received > 0 or spec.num_shards > 0
        if partial:
            self._workers.dropped[address] = lost
        log.warning("tf.data service worker %s of job %d stopped answering and %s: %s. The "
                    "iteration goes on with the other workers%s.", address, self._job.job_id,
                    why, lost, " and will end with a DataLossError" if partial else "")

    # ---- round-robin reads ----

    def _round_robin(self, _address: str) -> None:
        """Round r comes from worker r mod W, the same for every consumer (strict order).
        Resumed from round R, worker w's stream skips the elements of the rounds before R."""
        with self._lock:
            workers = self._round_workers = sorted(self._workers.listed)
        if self._resumed.workers is not None and workers != self._resumed.workers:
            raise errors.FailedPreconditionError(
                f"The saved round-robin position read from workers {self._resumed.workers}, "
                f"but the job has {workers}: rounds go to other workers now. Resume with the "
                "same workers, or start a new iteration.")
        spec = self._spec()
        spec.num_consumers = consumers = self._options.num_consumers
        first, count = self._resumed.first_round, len(workers)
        skipped = {address: ((first + (i - first) % count) // count) * consumers
                   for i, address in enumerate(workers)}
        # Rounds returned from each worker, with its vouch for the last one's element.
        starts = {address: self._resumed.offsets.get(address, Offset(0)) for address in workers}
        with self._lock:
            returned = {address: self._positions.setdefault(
                address, _StreamPosition(starts[address].count, starts[address].vouch))
                for address in workers}
        for round_ in itertools.count(first):
            address = workers[round_ % count]
            position = ((round_ // count) * consumers + (self._options.consumer_index or 0)
                        - skipped[address])
            batch: _Batch | None = None
            while not batch and not self._stop.is_set():
                read = self._read_retrying(address, spec, position=position,
                                           offset=skipped[address],
                                           vouch=starts[address].vouch)
                if read is None or read[1]:
                    raise errors.UnavailableError(
                        f"Round-robin reads lost worker {address} (or its stream ended).")
                batch = read[0]
            if self._stop.is_set():
                return
            self._put("batch", batch, returned[address])

    # ---- distributed_epoch ----

    def _split_slot(self, address: str) -> None:
        while not self._stop.is_set():
            with self._lock:
                if address in self._workers.failed or address not in self._workers.listed:
                    return
            split = self._next_split()
            if split is None:
                return
            if not self._read_split(address, split):
                return

    def _next_split(self) -> _Split | None:
        with self._lock:
            if self._reading.orphans:
                return self._reading.orphans.pop()
        with self._split_lock:
            with self._lock:
                done, self._reading.done = self._reading.done, []
                held = list(self._reading.held)
            try:
                response, _ = self._dispatcher.call(DataRequest(get_split=GetSplitRequest(
                    job_id=self._job.job_id, consumer_id=self._consumer, held=held,
                    done=[s.split_id for s in done], resumable=self._resumable,
                    generation=self._generation)))
            except errors.OpError:
                with self._lock:  # still to acknowledge: with the release, at the latest
                    self._reading.done[:0] = done
                raise
            result = response.get_split
            with self._lock:
                if result.end_of_splits:
                    self._reading.end_of_splits = True
                if not result.has_split:
                    return None
                handed_at = result.split.vouch if result.split.HasField("vouch") else None
                split = _Split(result.split.split_id, result.split.unit_start,
                               result.split.unit_end, result.split.grant,
                               received=result.split.offset, consumed=result.split.offset,
                               handout=result.split.handout, handed_at=result.split.offset,
                               vouch=handed_at, received_vouch=handed_at)
                self._reading.held[split.split_id] = split
                self._splits.handed_out(split)
        self._fill_idle_workers()
        return split

    def _read_split(self, address: str, split: _Split) -> bool:
        """Read ``split`` from ``address`` to its end; False if the worker failed."""
        split.attempt, split.address = next(self._attempts), address
        spec = self._spec()
        spec.is_split, spec.split_id, spec.attempt = True, split.split_id, split.attempt
        spec.unit_start, spec.unit_end, spec.grant = split.unit_start, split.unit_end, split.grant
        spec.handed_at = split.handed_at
        while not self._stop.is_set():
            try:
                # Only the job's first read asks for a single element (to start fast).
                first = not split.received and not self._delivered
                batch, end = self._read(address, spec, next(self._seq), split.received, first,
                                        vouch=split.received_vouch)
            except _WORKER_FAILURES:
                self._orphan(address, split)
                return False
            split.received += len(batch)
            if batch.vouch is not None:
                split.received_vouch = batch.vouch
            if batch:
                self._delivered = True
                self._put("batch", batch, split)
            if end:
                with self._lock:
                    del self._reading.held[split.split_id]
                    self._reading.done.append(split)
                    split.ended = True
                    self._splits.returned(split)
                return True
        return False

    def _orphan(self, address: str, split: _Split) -> None:
        """Move ``split`` off a failed worker; another worker resumes at its offset. The
        failed one is probed (``_revive``) until it answers again."""
        if self._stop.is_set():
            return
        with self._lock:
            retry = self._times.retry_s
            self._workers.failed.setdefault(address, _Failure(retry, time.monotonic() + retry))
            split.orphaned_at = time.monotonic()
            self._reading.orphans.append(split)
            alive = [a for a in self._workers.listed if a not in self._workers.failed]
            target = min(alive, key=lambda a: self._workers.threads.get(a, 0)) if alive else None
        if target is not None:
            self._spawn(self._split_slot, target)

    def _revive(self) -> None:
        """Probe the failed workers the dispatcher still lists (with backoff); fail the
        iteration if an orphaned split found no worker for ``stalled_s``."""
        now = time.monotonic()
        with self._lock:
            due = [a for a, f in self._workers.failed.items()
                   if a in self._workers.listed and not f.probing and f.next_try <= now]
            for address in due:
                self._workers.failed[address].probing = True
            stuck = [s for s in self._reading.orphans
                     if now - s.orphaned_at > self._times.stalled_s]
            failed = sorted(self._workers.failed)
        if stuck and not self._stalled:
            self._stalled = True
            who = f"worker(s) {', '.join(failed)}" if failed else "its worker(s)"
            self._fail(errors.UnavailableError(
                f"No tf.data service worker could read split {stuck[0].split_id} of job "
                f"{self._job.job_id} for {self._times.stalled_s:g} s: {who} stopped answering "
                "and no other worker is available. Check those workers, or add workers; the "
                "elements returned so far are complete and unrepeated."))
        for address in due:
            threading.Thread(target=self._probe, args=(address,), daemon=True,
                             name="clusterwire-data-probe").start()

    def _probe(self, address: str) -> None:
        """Release this consumer's stale split streams on a failed worker (those it reads
        elsewhere now): answered, the worker reads splits again."""
        with self._lock:
            opened = self._workers.opened.get(address, {})
            stale = {key: spec for key, spec in opened.items()
                     if key not in self._reading.held or self._reading.held[key].address != address}
        endpoint = self._endpoint(address)
        answered = endpoint is not None
        if answered:
            try:
                self._channels.call(*endpoint, DataRequest(release_streams=ReleaseStreamsRequest(
                    consumer_id=self._consumer, streams=stale.values())),
                    self._times.probe_timeout_s)
            except errors.OpError:
                answered = False
        with self._lock:
            failure = self._workers.failed.get(address)
            if failure is None:
                return
            slots = []
            if answered:
                for key in stale:
                    opened.pop(key, None)
                del self._workers.failed[address]
                slots = self._reserve_slots([address])
            else:
                failure.probing = False
                failure.next_try = time.monotonic() + failure.delay
                failure.delay = self._times.backoff(failure.delay)
        if not self._stop.is_set():
            self._start_slots(slots)


def _check_resumable(options: ReadOptions, position: Position | JobPosition) -> None:
    """InvalidArgumentError unless ``position`` is of a read like the one ``options`` ask."""
    if position.dataset_id != options.dataset_id:
        raise errors.InvalidArgumentError(
            f"The saved position is of dataset {position.dataset_id!r}, this read is of "
            f"{options.dataset_id!r}: resume with the same dataset and dispatcher (a "
            "dispatcher restarted without fault_tolerant_mode gives datasets new ids).")
    if position.processing_mode != options.policy:
        raise errors.InvalidArgumentError(
            f"The saved position is of a {mode_name(position.processing_mode)} read, this "
            f"read is {mode_name(options.policy)}: resume in the "
            "processing mode the position was saved in.")
    if isinstance(position, Position) and (position.consumer_index, position.num_consumers) != (
            options.consumer_index or 0, options.num_consumers):
        raise errors.InvalidArgumentError(
            f"The saved position is of consumer {position.consumer_index} of "
            f"{position.num_consumers} (round-robin reads), this read is consumer "
            f"{options.consumer_index or 0} of {options.num_consumers}: each consumer "
            "resumes from its own position.")
