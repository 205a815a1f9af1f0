"""JobReader: one iteration of a distributed dataset, reading a job's elements from workers.

Background threads fetch batches of elements from the workers into a
bounded queue that ``__next__`` drains:

* parallel_epochs and static sharding: one reader thread per worker stream.
* distributed_epoch: ``SLOTS_PER_WORKER`` threads per worker, each reading
  one split at a time. The consumer owns its splits: it counts the elements
  received of each, and when a worker fails it moves the split to another
  worker, which skips the elements already received. For a deterministic
  pipeline no element is lost or repeated. Finished splits are acknowledged
  to the dispatcher with the next split request.

Batches are decoded (and decompressed) in order on ``_DECODERS`` threads, so a
reader thread asks for its next batch as soon as one arrives. Only the job's
first read asks for a single element (a fast first element); later reads,
also of new splits, ask for whole batches.

A heartbeat thread keeps the job alive at the dispatcher and learns which
workers are alive (new workers join, dead ones are dropped).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.data import elements
from clusterwire.data.modes import STATIC_POLICIES, ShardingPolicy
from clusterwire.data.rpc import DispatcherClient, WorkerChannels
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    DataRequest,
    GetElementsRequest,
    GetOrCreateJobRequest,
    GetSplitRequest,
    JobInfo,
    StreamSpec,
    WorkerInfo,
)

SLOTS_PER_WORKER = 2
HEARTBEAT_S = 0.5
_NO_WORKER_POLL_S = 0.02
_READ_WAIT_S = 1.0
_READ_TIMEOUT_S = 15.0
_MAX_ELEMENTS = 1024
_MAX_BYTES = 8 << 20
_RETRY_S = 0.05
# A parallel_epochs worker unreachable this long is given up even while the dispatcher lists it.
_WORKER_GONE_S = 5.0
_WORKER_FAILURES = (errors.UnavailableError, errors.DeadlineExceededError, errors.CancelledError)
_END = object()
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


@dataclass
class _Split:
    split_id: int
    unit_start: int
    unit_end: int
    grant: bytes
    received: int = 0
    attempt: int = 0


@dataclass
class _Batch:
    """Received elements, decoded (and decompressed) on a decoder thread, so the reader
    thread asks for the next batch at once."""

    headers: Any  # the response's ElementHeaders
    buffers: list[Any]

    def __len__(self) -> int:
        return len(self.headers)

    def decode(self) -> list[Any]:
        return elements.decode_all(self.headers, self.buffers)



def _is_local(address: str) -> bool:
    host = split_host_port(address)[0]
    return host in ("localhost", "::1") or host.startswith("127.")


class JobReader(Iterator[Any]):
    """Iterates over the elements of one job (created or joined on construction)."""

    def __init__(self, dispatcher: DispatcherClient, options: ReadOptions, iteration: int):
        self._dispatcher = dispatcher
        self._options = options
        self._consumer = uuid.uuid4().hex
        self._channels = WorkerChannels(dispatcher.security)
        self._decoder = ThreadPoolExecutor(_DECODERS, "clusterwire-data-decode")
        self._queue: queue.Queue = queue.Queue(maxsize=16)
        self._batch: deque = deque()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._split_lock = threading.Lock()
        self._seq = itertools.count(1)
        self._attempts = itertools.count(1)
        self._workers: dict[str, WorkerInfo] = {}
        self._failed: set[str] = set()
        self._started: dict[str, int] = {}  # worker -> running reader threads
        self._running = 0
        self._orphans: list[_Split] = []
        self._held: dict[int, _Split] = {}
        self._done_splits: list[int] = []
        self._end_of_splits = False
        self._round_robin_started = False
        self._finished = False
        self._delivered = False  # a batch was read (later splits start with a whole batch)
        named = options.job_name is not None
        key = f"{options.job_name}/{iteration}" if named else f"anonymous/{self._consumer}"
        response, _ = dispatcher.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=options.dataset_id, sharding_policy=options.policy, job_key=key,
            named=named, num_consumers=options.num_consumers,
            target_workers=options.target_workers)))
        self._job: JobInfo = response.job
        if self._job.finished:
            self._finished = True
            return
        self._update_workers(list(self._job.workers))
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name="clusterwire-data-client-heartbeat")
        self._heartbeat.start()

    # ---- iteration ----

    def __iter__(self) -> JobReader:
        return self

    def __next__(self) -> Any:
        while not self._batch:
            if self._finished:
                raise StopIteration
            kind, payload = self._queue.get()
            if kind is _END:
                self._finish()
                raise StopIteration
            if kind == "error":
                self.close()
                raise payload
            try:
                self._batch.extend(payload.result())
            except errors.OpError:
                self.close()
                raise
        return self._batch.popleft()

    def _finish(self) -> None:
        self._finished = True
        self._release(finished=True)

    def close(self) -> None:
        """Stop reading; the job is released at the dispatcher (idempotent)."""
        if not self._stop.is_set() and not self._finished:
            self._release(finished=False)
        self._finished = True

    def __del__(self) -> None:
        if hasattr(self, "_job"):
            self.close()

    def _release(self, finished: bool) -> None:
        self._stop.set()
        self._decoder.shutdown(wait=False, cancel_futures=True)
        request = DataRequest(client_heartbeat=ClientHeartbeatRequest(
            job_id=self._job.job_id, consumer_id=self._consumer, finished=finished,
            release=True))
        threading.Thread(target=self._send_quietly, args=(request,), daemon=True).start()

    def _send_quietly(self, request: DataRequest) -> None:
        try:
            self._dispatcher.call(request)
        except errors.OpError:
            pass  # best effort: the job is collected after job_gc_timeout_ms anyway
        finally:
            self._channels.close()

    def _put(self, kind: Any, payload: Any = None) -> None:
        if kind == "batch":
            try:
                payload = self._decoder.submit(payload.decode)
            except RuntimeError:  # closed meanwhile
                return
        while not self._stop.is_set():
            try:
                self._queue.put((kind, payload), timeout=0.1)
                return
            except queue.Full:
                continue

    # ---- workers ----

    def _heartbeat_loop(self) -> None:
        request = DataRequest(client_heartbeat=ClientHeartbeatRequest(
            job_id=self._job.job_id, consumer_id=self._consumer))
        while not self._stop.wait(HEARTBEAT_S if self._workers else _NO_WORKER_POLL_S):
            try:
                response, _ = self._dispatcher.call(request)
            except errors.CancelledError:
                return
            except errors.OpError as err:
                self._put("error", err)
                return
            self._update_workers(list(response.client_heartbeat.workers))

    def _update_workers(self, workers: list[WorkerInfo]) -> None:
        if self._options.target_workers == "LOCAL":
            workers = [w for w in workers if _is_local(w.address)]
        with self._lock:
            self._workers = {w.address: w for w in workers}
            self._failed &= set(self._workers)
            new = [w for w in workers if w.address not in self._started]
            for worker in new:
                self._started[worker.address] = 0
        if self._options.num_consumers:
            if new and not self._round_robin_started:
                self._round_robin_started = True
                self._spawn(self._round_robin, new[0].address)
            return
        for worker in new:
            if self._job.sharding_policy == ShardingPolicy.DYNAMIC:
                for _ in range(SLOTS_PER_WORKER):
                    self._spawn(self._split_slot, worker.address)
            else:
                self._spawn(self._stream_reader, worker.address)

    def _spawn(self, target: Any, address: str) -> None:
        with self._lock:
            self._running += 1
            self._started[address] = self._started.get(address, 0) + 1
        threading.Thread(target=self._run, args=(target, address), daemon=True,
                         name="clusterwire-data-read").start()

    def _run(self, target: Any, address: str) -> None:
        try:
            target(address)
        except errors.OpError as err:
            self._put("error", err)
        except Exception as err:  # a bug: surface it rather than hang
            self._put("error", errors.InternalError(f"{type(err).__name__}: {err}"))
        finally:
            with self._lock:
                self._running -= 1
                self._started[address] -= 1
                ended = self._running == 0 and not self._orphans and (
                    self._job.sharding_policy != ShardingPolicy.DYNAMIC or self._end_of_splits)
            if ended:
                self._put(_END)

    def _endpoint(self, address: str) -> tuple[str, str] | None:
        with self._lock:
            worker = self._workers.get(address)
        if worker is None:
            return None
        wanted = self._options.data_transfer_protocol
        if wanted and worker.transfer_protocol == wanted:
            return worker.transfer_protocol, worker.transfer_address
        return worker.protocol, worker.address

    def _read(self, address: str, spec: StreamSpec, seq: int, offset: int = 0,
              first: bool = False, position: int = 0) -> tuple[_Batch | list[Any], bool]:
        """One batch from a worker (a single element when ``first``, to start fast).

        A retry must repeat ``seq``: the worker then answers with the same
        elements instead of handing out new ones.
        """
        request = DataRequest(get_elements=GetElementsRequest(
            stream=spec, consumer_id=self._consumer, request_seq=seq, offset=offset,
            max_elements=1 if first else self._options.max_elements, max_bytes=_MAX_BYTES,
            wait_seconds=_READ_WAIT_S, position=position))
        endpoint = self._endpoint(address)
        if endpoint is None:
            raise errors.UnavailableError(f"Worker {address} left the job.")
        response, buffers = self._channels.call(*endpoint, request, _READ_TIMEOUT_S)
        return _Batch(response.get_elements.elements, buffers), response.get_elements.end_of_stream

    def _spec(self) -> StreamSpec:
        return StreamSpec(job_id=self._job.job_id, dataset_id=self._job.dataset_id,
                          sharding_policy=self._job.sharding_policy,
                          compression=self._compression(), grant=self._job.grant)

    def _compression(self) -> str:
        wanted, registered = self._options.compression, self._job.compression
        return registered if wanted and registered else ""

    # ---- parallel_epochs / static sharding ----

    def _stream_reader(self, address: str) -> None:
        spec = self._spec()
        order = list(self._job.worker_order)
        if self._job.sharding_policy in STATIC_POLICIES and address in order:
            spec.shard_index, spec.num_shards = order.index(address), len(order)
        first = True
        while not self._stop.is_set():
            batch, end = self._read_retrying(address, spec, first=first)
            first = False
            if batch:
                self._put("batch", batch)
            if end:
                return

    def _read_retrying(self, address: str, spec: StreamSpec, **read: Any
                       ) -> tuple[_Batch | list[Any], bool]:
        """``_read`` retried (same sequence number) while the worker is listed and was
        reachable within ``_WORKER_GONE_S``; an empty end when it is given up."""
        seq, failing_since = next(self._seq), None
        while not self._stop.is_set():
            try:
                return self._read(address, spec, seq, **read)
            except _WORKER_FAILURES:
                now = time.monotonic()
                failing_since = failing_since or now
                with self._lock:
                    gone = address not in self._workers
                if gone or now - failing_since > _WORKER_GONE_S:
                    return [], True  # the worker died: its copy of the data is lost, as in TF
                self._stop.wait(_RETRY_S)
        return [], True

    # ---- round-robin reads ----

    def _round_robin(self, _address: str) -> None:
        """Round r comes from worker r mod W, the same for every consumer (strict order)."""
        with self._lock:
            workers = sorted(self._workers)
        spec = self._spec()
        spec.num_consumers = consumers = self._options.num_consumers
        for round_ in itertools.count():
            address = workers[round_ % len(workers)]
            position = (round_ // len(workers)) * consumers + (self._options.consumer_index or 0)
            batch: _Batch | list[Any] = []
            while not batch and not self._stop.is_set():
                batch, end = self._read_retrying(address, spec, position=position)
                if end:
                    raise errors.UnavailableError(
                        f"Round-robin reads lost worker {address} (or its stream ended).")
            if self._stop.is_set():
                return
            self._put("batch", batch)

    # ---- distributed_epoch ----

    def _split_slot(self, address: str) -> None:
        while not self._stop.is_set():
            with self._lock:
                if address in self._failed or address not in self._workers:
                    return
            split = self._next_split()
            if split is None:
                return
            if not self._read_split(address, split):
                return

    def _next_split(self) -> _Split | None:
        with self._lock:
            if self._orphans:
                return self._orphans.pop()
        with self._split_lock:
            with self._lock:
                done, self._done_splits = self._done_splits, []
                held = list(self._held)
            response, _ = self._dispatcher.call(DataRequest(get_split=GetSplitRequest(
                job_id=self._job.job_id, consumer_id=self._consumer, held=held, done=done)))
            result = response.get_split
            with self._lock:
                if result.end_of_splits:
                    self._end_of_splits = True
                if not result.has_split:
                    return None
                split = _Split(result.split.split_id, result.split.unit_start,
                               result.split.unit_end, result.split.grant)
                self._held[split.split_id] = split
                return split

    def _read_split(self, address: str, split: _Split) -> bool:
        """Read ``split`` from ``address`` to its end; False if the worker failed."""
        split.attempt = next(self._attempts)
        spec = self._spec()
        spec.is_split, spec.split_id, spec.attempt = True, split.split_id, split.attempt
        spec.unit_start, spec.unit_end, spec.grant = split.unit_start, split.unit_end, split.grant
        while not self._stop.is_set():
            try:
                # Only the job's first read asks for a single element (to start fast).
                first = not split.received and not self._delivered
                batch, end = self._read(address, spec, next(self._seq), split.received, first)
            except _WORKER_FAILURES:
                self._orphan(address, split)
                return False
            split.received += len(batch)
            if batch:
                self._delivered = True
                self._put("batch", batch)
            if end:
                with self._lock:
                    del self._held[split.split_id]
                    self._done_splits.append(split.split_id)
                return True
        return False

    def _orphan(self, address: str, split: _Split) -> None:
        """Move ``split`` off a failed worker; another worker resumes at its offset."""
        with self._lock:
            self._failed.add(address)
            self._orphans.append(split)
            alive = [a for a in self._workers if a not in self._failed]
            target = min(alive, key=lambda a: self._started.get(a, 0)) if alive else None
        if target is not None:
            self._spawn(self._split_slot, target)
