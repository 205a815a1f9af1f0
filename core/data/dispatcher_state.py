"""The dispatcher's durable state, changed only by applying journal entries.

Every decision the dispatcher makes is expressed as a ``JournalEntry`` that
is first written to the journal (in fault-tolerant mode) and then applied
here; a restarted dispatcher applies the journal's entries and is back in
the same state. Liveness (heartbeat times) is not journaled: after a replay
every known worker and consumer counts as just seen. Nor is the peer whose request created a
job or a dataset (its share of the table: ``clusterwire.fair_shares``): after a replay every
entry counts for the unknown peer "".
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from clusterwire.data.quotas import ServiceLimits
from clusterwire.fair_shares import FairShares
from clusterwire.protos.data_service_pb2 import (
    ConsumerPosition,
    DatasetDef,
    JobInfo,
    JournalDataset,
    JournalEntry,
    JournalHandouts,
    JournalJob,
    JournalJobProgress,
    JournalSplit,
    WorkerInfo,
)


@dataclass
class DatasetRecord:
    """A registered dataset."""

    dataset_id: str
    fingerprint: str
    compression: str
    dataset: DatasetDef
    buffers: list[Any]
    last_used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.buffers)


class Assignments:
    """A job's assigned splits, split id -> consumer id, with each consumer's splits at
    hand (``of``): a consumer's request looks at its own splits, not at every split the job
    handed out."""

    def __init__(self, items: dict[int, str] | None = None) -> None:
        self._consumer_of: dict[int, str] = {}
        self._splits_of: dict[str, dict[int, None]] = {}  # consumer -> its splits, in order
        for split_id, consumer in (items or {}).items():
            self[split_id] = consumer

    def __setitem__(self, split_id: int, consumer: str) -> None:
        self.pop(split_id, None)
        self._consumer_of[split_id] = consumer
        self._splits_of.setdefault(consumer, {})[split_id] = None

    def __delitem__(self, split_id: int) -> None:
        consumer = self._consumer_of.pop(split_id)
        splits = self._splits_of[consumer]
        del splits[split_id]
        if not splits:
            del self._splits_of[consumer]

    def pop(self, split_id: int, default: str | None = None) -> str | None:
        """Unassign ``split_id``; its consumer (``default`` if it was not assigned)."""
        consumer = self._consumer_of.get(split_id)
        if consumer is None:
            return default
        del self[split_id]
        return consumer

    def get(self, split_id: int) -> str | None:
        return self._consumer_of.get(split_id)

    def of(self, consumer: str) -> list[int]:
        """The splits assigned to ``consumer``, in the order they were assigned."""
        return list(self._splits_of.get(consumer, ()))

    def items(self) -> Iterator[tuple[int, str]]:
        return iter(self._consumer_of.items())

    def consumers(self) -> set[str]:
        """The consumers holding splits."""
        return set(self._splits_of)

    def __len__(self) -> int:
        return len(self._consumer_of)


@dataclass
class Job:
    """A job: a dataset being read in one processing mode by one or more consumers."""

    info: JobInfo
    key: str
    named: bool
    split_units: int = 0
    total_units: int = 0
    epochs: int = 1
    next_split: int = 0
    assigned: Assignments = field(default_factory=Assignments)
    pool: list[int] = field(default_factory=list)  # splits given back, to hand out again
    # split id -> elements of it already consumed (its consumer stopped early)
    offsets: dict[int, int] = field(default_factory=dict)
    # consumer -> last seen, least recently seen first (``saw``): the timed-out ones are the
    # first ones, found without looking at the others
    consumers: OrderedDict[str, float] = field(default_factory=OrderedDict)
    released: set[str] = field(default_factory=set)
    last_active: float = field(default_factory=time.monotonic)
    # consumer -> its hand-outs (split, offset handed at), the first handout_base dropped
    handouts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    handout_base: dict[str, int] = field(default_factory=dict)
    resumable: set[str] = field(default_factory=set)  # saved their position
    dormant: dict[str, float] = field(default_factory=dict)  # resumable, stopped -> since
    generations: dict[str, int] = field(default_factory=dict)  # resumed consumer -> latest
    merges: dict[str, None] = field(default_factory=dict)  # merge ids applied, oldest first
    splits_handed: int = 0  # hand-outs (a split given back and handed again counts again)
    splits_completed: int = 0
    # What its consumers are told of its workers (heartbeat_replies.WorkerList): not
    # journaled, made again after a restart.
    worker_list: Any = field(default=None, repr=False, compare=False)

    def saw(self, consumer: str, now: float) -> None:
        """``consumer`` was heard from at ``now``: the latest time yet (its callers pass
        ``time.monotonic()`` under the state's lock), so ``consumers`` stays in the order of
        last hearing, which expiring the silent ones relies on."""
        self.consumers[consumer] = now
        self.consumers.move_to_end(consumer)

    def is_stale(self, consumer: str, generation: int) -> bool:
        """A request of an earlier generation of a resumed consumer (an old iterator)."""
        return generation < self.generations.get(consumer, 0)

    def handout_index(self, consumer: str, split_id: int) -> int:
        """The index of ``split_id``'s last hand-out to ``consumer`` (-1: none kept)."""
        handouts = self.handouts.get(consumer, [])
        for i in range(len(handouts) - 1, -1, -1):
            if handouts[i][0] == split_id:
                return self.handout_base.get(consumer, 0) + i
        return -1

    def hand_out(self, consumer: str, split_id: int, kept: int) -> None:
        """Remember that ``split_id`` went to ``consumer`` at its current offset (the last
        ``kept`` of each consumer are kept: a position saved before them cannot be
        resumed)."""
        handouts = self.handouts.setdefault(consumer, [])
        handouts.append((split_id, self.offsets.get(split_id, 0)))
        if len(handouts) > kept:
            dropped = len(handouts) - kept
            del handouts[:dropped]
            self.handout_base[consumer] = self.handout_base.get(consumer, 0) + dropped

    def _reclaim(self, consumer: str, split_id: int, offset: int) -> None:
        """Give ``split_id`` back to ``consumer`` (resuming), to be read from ``offset``."""
        self.assigned[split_id] = consumer
        if split_id in self.pool:
            self.pool.remove(split_id)
        if offset:
            self.offsets[split_id] = offset
        else:
            self.offsets.pop(split_id, None)
        self.info.finished = False

    def resume(self, consumer: str, handed: int, partial: dict[int, int],
               completed: set[int], generation: int) -> None:
        """``consumer`` restarts from a position saved after its first ``handed`` hand-outs:
        the splits it left unread (``unread_of``) are its own again, and the rest of those
        still assigned to it are done (the dispatcher checked the position)."""
        unread = self.unread_of(consumer, handed, partial, completed)
        self._finish_read(consumer, unread)
        for split_id, offset in unread.items():
            self._reclaim(consumer, split_id, offset)
        self.dormant.pop(consumer, None)
        self.released.discard(consumer)
        self.saw(consumer, time.monotonic())
        self.generations[consumer] = generation

    def merge(self, merge_id: str, consumers: list[ConsumerPosition], merges_kept: int
              ) -> None:
        """The positions of ``consumers`` were merged (the dispatcher checked them): the
        splits each left unread (``unread_of``) go back to the pool, the rest of those still
        assigned to it are done, and the consumer is done."""
        for position in consumers:
            consumer = position.consumer_id
            unread = self.unread_of(consumer, position.handed,
                                    {at.split_id: at.offset for at in position.partial},
                                    set(position.completed))
            self._finish_read(consumer, unread)
            for split_id, offset in unread.items():
                self._give_back(split_id, offset)
            for kept in (self.handouts, self.handout_base, self.dormant, self.generations,
                         self.consumers):
                kept.pop(consumer, None)
            self.resumable.discard(consumer)
            self.released.add(consumer)
        self.merges[merge_id] = None
        # A new consumer passing the job position of one of the last ``merges_kept`` merges
        # joins the job; of an older one, it is refused.
        while len(self.merges) > merges_kept:
            del self.merges[next(iter(self.merges))]

    def unread_of(self, consumer: str, handed: int, partial: dict[int, int],
                  completed: set[int]) -> dict[int, int]:
        """What a position of ``consumer`` saved after its first ``handed`` hand-outs left
        unread, split -> the offset to read it from: the splits handed to it later (but
        those it had ``completed``) at the offsets they were handed at, then the
        ``partial`` ones at the elements it had returned. Every other split handed to it was
        read completely."""
        base = self.handout_base.get(consumer, 0)
        unread = {split_id: offset
                  for split_id, offset in self.handouts.get(consumer, [])[handed - base:]
                  if split_id not in completed}
        unread.update(partial)
        return unread

    def _finish_read(self, consumer: str, unread: dict[int, int]) -> None:
        """The splits still assigned to ``consumer`` but not ``unread`` are done: it read
        them completely, but died (or was stopped) before its acknowledgement (the next split
        request) reached the dispatcher. Else a resumed consumer would be sent them again
        as lost, and after a merge they would stay assigned to a consumer that is gone."""
        for split_id in [s for s in self.assigned.of(consumer) if s not in unread]:
            del self.assigned[split_id]
            self.offsets.pop(split_id, None)
            self.splits_completed += 1

    def _give_back(self, split_id: int, offset: int) -> None:
        """Put ``split_id`` in the pool, to be read from ``offset``."""
        self.assigned.pop(split_id, None)
        if split_id not in self.pool:
            self.pool.append(split_id)
        if offset:
            self.offsets[split_id] = offset
        else:
            self.offsets.pop(split_id, None)
        self.info.finished = False

    @property
    def splits_per_epoch(self) -> int:
        if self.total_units == 0:
            return 0
        return -(-self.total_units // self.split_units)

    @property
    def total_splits(self) -> float:
        """Splits in the job (inf when it repeats forever)."""
        per_epoch = self.splits_per_epoch
        if per_epoch == 0:
            return 0
        return float("inf") if self.epochs < 0 else per_epoch * self.epochs

    def split_range(self, split_id: int) -> tuple[int, int]:
        """The source units ``[start, end)`` of a split."""
        start = (split_id % self.splits_per_epoch) * self.split_units
        return start, min(start + self.split_units, self.total_units)

    @property
    def all_splits_done(self) -> bool:
        return self.next_split >= self.total_splits and not self.assigned and not self.pool


@dataclass(eq=False)
class LiveWorkers:
    """The live workers as ``DispatcherState.live_view`` found them: heard from within
    ``timeout_s``, every one of them until ``until`` at least."""

    timeout_s: float
    until: float
    addresses: frozenset[str]
    workers: tuple[WorkerInfo, ...]


class DispatcherState:
    """Datasets, jobs, split assignments and workers; mutated by ``apply`` only."""

    def __init__(self, limits: ServiceLimits) -> None:
        self.limits = limits
        self.datasets: dict[str, DatasetRecord] = {}
        # (fingerprint, compression, peer) -> dataset id: a peer registering the same dataset
        # again with the same compression gets the same id, with another one a new id.
        # Another peer's registration is its own (its share: a peer's datasets displaced
        # from a full table never take another peer's jobs with them), but for datasets of
        # peer "" (this process's, or registered before a restart: every peer finds those).
        self.by_fingerprint: dict[tuple[str, str, str], str] = {}
        self.jobs: dict[int, Job] = {}
        self.job_keys: dict[str, int] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.worker_seen: dict[str, float] = {}
        self._live: LiveWorkers | None = None  # live_view's last answer
        self.grant_key = b""
        # Jobs no consumer has read yet and datasets no job has used, oldest first: what a
        # full table gives up first. A consumer's first heartbeat or split request marks its
        # job read (DispatchServer); after a replay every job counts as read.
        self.unread_jobs: dict[int, None] = {}
        self.unused_datasets: dict[str, None] = {}
        # Each job and dataset counts for the peer that created it (datasets by count and
        # by payload bytes): what a full table's fair shares are taken from.
        self.job_shares: FairShares[int] = FairShares()
        self.dataset_shares: FairShares[str] = FairShares()
        self.dataset_bytes: FairShares[str] = FairShares()

    def apply(self, entry: JournalEntry, buffers: list[Any] | None = None,
              peer: str = "") -> None:
        """Apply one decision (``buffers``: a dataset entry's payload buffers; ``peer``: the
        peer whose request made a new job or dataset): the handler of its kind."""
        handler = _APPLY.get(entry.WhichOneof("kind"))
        if handler is not None:
            handler(self, entry, buffers or [], peer, time.monotonic())

    def _apply_dataset(self, entry: JournalEntry, buffers: list[Any], peer: str,
                       now: float) -> None:
        d = entry.dataset
        record = self.datasets[d.dataset_id] = DatasetRecord(
            d.dataset_id, d.fingerprint, d.compression, d.dataset, list(buffers))
        self.by_fingerprint.setdefault((d.fingerprint, d.compression, peer), d.dataset_id)
        self.unused_datasets[d.dataset_id] = None
        self.dataset_shares.add(d.dataset_id, peer)
        self.dataset_bytes.add(d.dataset_id, peer, record.nbytes)

    def _apply_job(self, entry: JournalEntry, buffers: list[Any], peer: str,
                   now: float) -> None:
        j = entry.job
        info = JobInfo()
        info.CopyFrom(j.job)
        self.jobs[info.job_id] = Job(info, j.job_key, j.named, j.split_units,
                                     j.total_units, j.epochs)
        self.job_keys[j.job_key] = info.job_id
        self.unread_jobs[info.job_id] = None
        self.job_shares.add(info.job_id, peer)
        self.unused_datasets.pop(info.dataset_id, None)

    def _apply_assign(self, entry: JournalEntry, buffers: list[Any], peer: str,
                      now: float) -> None:
        job = self.jobs.get(entry.assign.job_id)
        if job is not None:
            split = entry.assign.split_id
            job.assigned[split] = entry.assign.consumer_id
            job.next_split = max(job.next_split, split + 1)
            if split in job.pool:
                job.pool.remove(split)
            job.hand_out(entry.assign.consumer_id, split, self.limits.max_handouts)
            job.splits_handed += 1
            job.consumers.setdefault(entry.assign.consumer_id, now)

    def _apply_done_or_returned(self, entry: JournalEntry, buffers: list[Any], peer: str,
                                now: float) -> None:
        kind = entry.WhichOneof("kind")
        record = getattr(entry, kind)
        job = self.jobs.get(record.job_id)
        if job is not None:
            if kind == "returned":  # the consumer cannot resume any more
                for kept in (job.handouts, job.handout_base, job.dormant):
                    kept.pop(record.consumer_id, None)
                job.resumable.discard(record.consumer_id)
            offsets = dict(zip(record.split_ids, record.offsets, strict=False))
            for split in record.split_ids:
                job.assigned.pop(split, None)
                if kind == "returned":
                    job.pool.append(split)
                    if offsets.get(split):
                        job.offsets[split] = offsets[split]
                else:
                    job.offsets.pop(split, None)
                    if split in job.pool:
                        job.pool.remove(split)
                    job.splits_completed += 1

    def _apply_kept(self, entry: JournalEntry, buffers: list[Any], peer: str,
                    now: float) -> None:
        job = self.jobs.get(entry.kept.job_id)
        if job is not None:
            for split, offset in zip(entry.kept.split_ids, entry.kept.offsets, strict=False):
                if job.assigned.get(split) == entry.kept.consumer_id and offset:
                    job.offsets[split] = offset
            job.consumers.pop(entry.kept.consumer_id, None)
            job.dormant[entry.kept.consumer_id] = now

    def _apply_resumable(self, entry: JournalEntry, buffers: list[Any], peer: str,
                         now: float) -> None:
        job = self.jobs.get(entry.resumable.job_id)
        if job is not None:
            job.resumable.add(entry.resumable.consumer_id)

    def _apply_resumed(self, entry: JournalEntry, buffers: list[Any], peer: str,
                       now: float) -> None:
        r = entry.resumed
        job = self.jobs.get(r.job_id)
        if job is not None:
            job.resume(r.consumer_id, r.handed, {p.split_id: p.offset for p in r.partial},
                       set(r.completed), r.generation)

    def _apply_merged(self, entry: JournalEntry, buffers: list[Any], peer: str,
                      now: float) -> None:
        job = self.jobs.get(entry.merged.job_id)
        if job is not None:
            job.merge(entry.merged.merge_id, list(entry.merged.consumers),
                      self.limits.max_merges)

    def _apply_finished_job(self, entry: JournalEntry, buffers: list[Any], peer: str,
                            now: float) -> None:
        job = self.jobs.get(entry.finished_job)
        if job is not None:
            job.info.finished = True

    def _apply_removed_job(self, entry: JournalEntry, buffers: list[Any], peer: str,
                           now: float) -> None:
        self.unread_jobs.pop(entry.removed_job, None)
        self.job_shares.discard(entry.removed_job)
        job = self.jobs.pop(entry.removed_job, None)
        if job is not None and self.job_keys.get(job.key) == job.info.job_id:
            del self.job_keys[job.key]

    def _apply_worker(self, entry: JournalEntry, buffers: list[Any], peer: str,
                      now: float) -> None:
        self.workers[entry.worker.address] = entry.worker
        self.worker_seen[entry.worker.address] = now
        self._live = None

    def _apply_grant_key(self, entry: JournalEntry, buffers: list[Any], peer: str,
                         now: float) -> None:
        self.grant_key = entry.grant_key

    def _apply_removed_dataset(self, entry: JournalEntry, buffers: list[Any], peer: str,
                               now: float) -> None:
        self.unused_datasets.pop(entry.removed_dataset, None)
        creator = self.dataset_shares.peer_of(entry.removed_dataset) or ""
        self.dataset_shares.discard(entry.removed_dataset)
        self.dataset_bytes.discard(entry.removed_dataset)
        record = self.datasets.pop(entry.removed_dataset, None)
        if record is not None:
            key = (record.fingerprint, record.compression, creator)
            if self.by_fingerprint.get(key) == record.dataset_id:
                del self.by_fingerprint[key]

    def _apply_progress(self, entry: JournalEntry, buffers: list[Any], peer: str,
                        now: float) -> None:
        p = entry.progress
        job = self.jobs.get(p.job_id)
        if job is not None:
            job.next_split, job.pool = p.next_split, list(p.pool)
            job.assigned = Assignments({a.split_id: a.consumer_id for a in p.assigned})
            job.info.finished = p.finished
            job.offsets = dict(p.offsets)
            job.handouts = {h.consumer_id: list(zip(h.split_ids, h.offsets, strict=True))
                            for h in p.handouts}
            job.handout_base = {h.consumer_id: h.base for h in p.handouts}
            job.generations = {h.consumer_id: h.generation for h in p.handouts
                               if h.generation}
            job.resumable = set(p.resumable)
            job.dormant = dict.fromkeys(p.dormant, now)
            job.splits_handed, job.splits_completed = p.splits_handed, p.splits_completed
            job.merges = dict.fromkeys(p.merges)
            for consumer in job.assigned.consumers() - set(job.dormant):
                job.consumers.setdefault(consumer, now)  # else never timed out

    def snapshot(self) -> list[JournalEntry]:
        """Entries that rebuild this state from nothing: what a compacted journal holds."""
        entries = [JournalEntry(grant_key=self.grant_key)]
        for record in self.datasets.values():
            entries.append(JournalEntry(dataset=JournalDataset(
                dataset_id=record.dataset_id, fingerprint=record.fingerprint,
                compression=record.compression, dataset=record.dataset,
                buffer_lengths=[memoryview(b).nbytes for b in record.buffers])))
        for job in self.jobs.values():
            entries.append(JournalEntry(job=JournalJob(
                job=job.info, job_key=job.key, named=job.named, split_units=job.split_units,
                total_units=job.total_units, epochs=job.epochs)))
            entries.append(JournalEntry(progress=JournalJobProgress(
                job_id=job.info.job_id, next_split=job.next_split, pool=job.pool,
                finished=job.info.finished, offsets=job.offsets, assigned=[
                    JournalSplit(job_id=job.info.job_id, split_id=split, consumer_id=consumer)
                    for split, consumer in job.assigned.items()],
                handouts=[JournalHandouts(
                    consumer_id=consumer, base=job.handout_base.get(consumer, 0),
                    split_ids=[s for s, _ in job.handouts.get(consumer, [])],
                    offsets=[o for _, o in job.handouts.get(consumer, [])],
                    generation=job.generations.get(consumer, 0))
                    for consumer in {*job.handouts, *job.generations}],
                resumable=sorted(job.resumable), dormant=sorted(job.dormant),
                splits_handed=job.splits_handed, splits_completed=job.splits_completed,
                merges=list(job.merges))))
        entries.extend(JournalEntry(worker=worker) for worker in self.workers.values())
        return entries

    def new_job_id(self) -> int:
        """An unused, unguessable job id (a client cannot name another client's job)."""
        while True:
            job_id = secrets.randbits(62) + 1
            if job_id not in self.jobs:
                return job_id

    def new_dataset_id(self) -> str:
        """An unused, unguessable dataset id."""
        while True:
            dataset_id = secrets.token_hex(16)
            if dataset_id not in self.datasets:
                return dataset_id

    def live_workers(self, timeout_s: float, order: list[str] | None = None) -> list[WorkerInfo]:
        """Workers heard from within ``timeout_s``, in ``order`` if given (static sharding)."""
        now = time.monotonic()
        if order is None:
            return list(self.live_view(timeout_s, now).workers)
        return [self.workers[a] for a in order
                if a in self.workers and now - self.worker_seen.get(a, 0) <= timeout_s]

    def live_view(self, timeout_s: float, now: float) -> LiveWorkers:
        """The workers heard from within ``timeout_s`` at ``now``, sorted by address: the same
        object until that list changes, so what is made of it can be kept as long."""
        view = self._live
        if view is None or view.timeout_s != timeout_s or now > view.until:
            live = [a for a in sorted(self.workers)
                    if now - self.worker_seen.get(a, 0) <= timeout_s]
            # None of them times out before the one heard from longest ago.
            until = min((self.worker_seen[a] for a in live), default=float("inf")) + timeout_s
            workers = tuple(self.workers[a] for a in live)
            if view is None or workers != view.workers or view.timeout_s != timeout_s:
                view = LiveWorkers(timeout_s, until, frozenset(live), workers)
            else:
                view.until = until
            self._live = view
        return view

    def saw_worker(self, address: str, now: float) -> None:
        """A known worker's heartbeat, at ``now``."""
        self.worker_seen[address] = now
        if self._live is not None and address not in self._live.addresses:
            self._live = None  # back from the dead: listed again


#: The handler of each kind of journal entry (``DispatcherState.apply``).
_APPLY: dict[str, Callable[[DispatcherState, JournalEntry, list[Any], str, float], None]] = {
    "dataset": DispatcherState._apply_dataset,
    "job": DispatcherState._apply_job,
    "assign": DispatcherState._apply_assign,
    "done": DispatcherState._apply_done_or_returned,
    "returned": DispatcherState._apply_done_or_returned,
    "kept": DispatcherState._apply_kept,
    "resumable": DispatcherState._apply_resumable,
    "resumed": DispatcherState._apply_resumed,
    "merged": DispatcherState._apply_merged,
    "finished_job": DispatcherState._apply_finished_job,
    "removed_job": DispatcherState._apply_removed_job,
    "worker": DispatcherState._apply_worker,
    "grant_key": DispatcherState._apply_grant_key,
    "removed_dataset": DispatcherState._apply_removed_dataset,
    "progress": DispatcherState._apply_progress,
}
