"""A consumer's position in a job: what ``state_dict()`` returns, and where a resumed
iteration starts (``distribute(..., state=...)`` / ``from_dataset_id(..., state=...)``).

It is a small JSON-serialisable dict, saved beside a model checkpoint:

* distributed_epoch: the job and the consumer (the same consumer resumes in the same job),
  how many splits the job had handed it (``handed``: every earlier one is read completely or
  listed in ``partial`` with the elements returned of it) and the splits handed later but
  already read completely (``completed``). The dispatcher gives the consumer back every other
  split it had been handed, so each element is returned once over the whole run, those
  returned after the saved position once more.
* parallel_epochs (and static sharding): the elements returned of each worker's stream
  (``streams``). A resumed iteration is a new job whose streams skip those elements.
* round-robin reads (``num_consumers``): the rounds returned (``elements``, one a round),
  the workers they went to and, for each worker, the rounds returned from it (``streams``).
  The consumers of a job resume together, from the same round (as a synchronous trainer's
  ranks saved at one step), in a job of the rounds from there on whose worker streams skip
  the earlier rounds' elements. ``group`` names the job they read by a digest of its grant,
  which only its consumers hold: another client cannot join or block their resume without
  having joined that job.

A job position (``merge_states``) is the positions of all consumers of one distributed_epoch
job saved at the same step, in one dict that any number of new consumers of the job resume
from (``JobPosition``): the first of them has the dispatcher give the unread parts of those
consumers' splits back to the job's pool (the splits handed after each position, at their
hand-out offsets; the partly read ones at the elements returned); from then on the merged
consumers are done, and the new ones share the pool and then the splits never handed out,
as any consumers of the job do. Its size grows with the number of consumers merged times
the splits each held unfinished (at most ``SLOTS_PER_WORKER`` per worker it read from, plus
those whose elements it had fetched but not yet returned), each with a vouch of about 150
bytes; not with the dataset or the elements read. Positions of the other modes do not merge
(``merge_states`` says why): a parallel_epochs consumer reads every worker's whole copy of
the data, so there is no epoch shared by the job to divide; round-robin rounds go to
consumer ``r mod num_consumers`` of a number fixed for the job; a static shard is one
worker's.

A job position may also name element ids (``merge_states(..., skip_ids=...)``, at most
``limits.MAX_SKIP_IDS``) that its new consumers leave out: they read the job's elements with
their provenance ids (``data/provenance.py``) and drop those (a batch the rows named; the
batch when it loses them all), counting them as returned, and every position they save
carries the ids on. The list never reaches the dispatcher or the workers: it needs no vouch
(it is the trainer's own choice) and can drop only elements the consumer was handed.

What the service trusts of a position: every nonzero offset in it (a split's in
distributed_epoch, a worker stream's otherwise) comes with a vouch (``data/vouches.py``): the
HMAC, under the dispatcher's grant key, by which a worker (or the dispatcher, for the offset a
split is handed out at) said it handed this consumer elements up to there. The dispatcher
checks a distributed_epoch position against what the job handed the consumer (its own splits
only, never below the offset a split was handed at, each offset within its split where
``split_limit`` knows the split's size, and vouched for); a worker skips a resumed stream's
elements only for a vouched offset, only while a reader reads it (``streams.Stream``), and so
at most what it already produced for that consumer (a round-robin consumer's vouch is of the
last element it returned from the worker: the skip also passes the other consumers' elements
of that round). Positions of version 1 carry no vouches and are refused. A job position's
offsets are checked the same way, each against the consumer that read it, and its ``group``
(the digest of the job's grant, saved in every distributed_epoch position) against the job's:
only positions saved by the job's own consumers merge into one the dispatcher takes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterwire.data import provenance, vouches
from clusterwire.data.limits import MAX_SKIP_IDS
from clusterwire.data.modes import ShardingPolicy, mode_name
from clusterwire.data.pipeline import (
    Batch,
    Enumerate,
    Filter,
    Map,
    Op,
    Pipeline,
    Prefetch,
    Repeat,
    Shuffle,
    Skip,
    Source,
    Take,
    split_plan,
)
from clusterwire.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from clusterwire.protos.data_service_pb2 import ConsumerPosition, SplitOffset, StreamSpec, Vouch

#: 2: offsets carry vouches (version 1's did not, and are refused).
VERSION = 2


@dataclass(frozen=True)
class Offset:
    """Elements of a split or stream returned, and the service's vouch for that count
    (``data/vouches.py``; None where none came: 0 needs none)."""

    count: int
    vouch: Vouch | None = None

    def to_json(self) -> Any:
        """The vouch as saved in a position's dict (None: none)."""
        if self.vouch is None:
            return None
        v = self.vouch
        return {"job": v.job_id, "consumer": v.consumer_id, "start": v.start, "end": v.end,
                "mac": v.mac.hex()}


@dataclass(frozen=True)
class Position:
    """Where one consumer is in one iteration of a distributed dataset."""

    dataset_id: str
    processing_mode: int  # the job's ShardingPolicy
    iteration: int
    job_key: str = ""
    consumer_id: str = ""
    handed: int = 0
    partial: dict[int, Offset] = field(default_factory=dict)  # split id -> elements returned
    completed: tuple[int, ...] = ()
    streams: dict[str, Offset] = field(default_factory=dict)  # worker -> elements returned
    elements: int = 0  # returned in this iteration, before and after resuming
    workers: tuple[str, ...] = ()  # round-robin reads: the workers, in round order
    consumer_index: int = 0
    num_consumers: int = 0
    finished: bool = False  # the iteration had ended: a resumed one ends at once
    group: str = ""  # the digest of the job's grant (distributed_epoch, round-robin reads)
    skip: tuple[int, ...] = ()  # element ids its reads leave out (``merge_states``' skip_ids)

    def to_dict(self) -> dict[str, Any]:
        """The position as a JSON-serialisable dict."""
        return {"version": VERSION, "dataset_id": self.dataset_id,
                "processing_mode": self.processing_mode, "iteration": self.iteration,
                "job_key": self.job_key, "consumer_id": self.consumer_id,
                "handed": self.handed,
                "partial": [[split, offset.count, offset.to_json()]
                            for split, offset in sorted(self.partial.items())],
                "completed": sorted(self.completed),
                "streams": {worker: [offset.count, offset.to_json()]
                            for worker, offset in sorted(self.streams.items())},
                "elements": self.elements, "workers": list(self.workers),
                "consumer_index": self.consumer_index, "num_consumers": self.num_consumers,
                "finished": self.finished, "group": self.group, "skip": list(self.skip)}

    @classmethod
    def from_dict(cls, state: Any) -> Position:
        """The position a ``state_dict()`` returned; InvalidArgumentError naming what is
        wrong with anything else."""
        if not isinstance(state, Mapping):
            raise InvalidArgumentError(
                f"A data-service position must be the dict state_dict() returned, got "
                f"{type(state).__name__}.")
        if state.get("version") != VERSION:
            unsigned = (" (version 1 positions carry no vouch for their offsets, which the "
                        "service now requires)" if state.get("version") == 1 else "")
            raise InvalidArgumentError(
                f"Data-service position version {state.get('version')!r} is not "
                f"{VERSION}{unsigned}: save the position with this clusterwire, or start "
                "the iteration anew.")
        try:
            position = cls(
                dataset_id=_typed(state, "dataset_id", str),
                processing_mode=_policy(state),
                iteration=_count(state, "iteration"),
                job_key=_typed(state, "job_key", str),
                consumer_id=_typed(state, "consumer_id", str),
                handed=_count(state, "handed"),
                partial={_nonnegative(entry[0], "partial"): _offset(entry[1:], "partial")
                         for entry in _typed(state, "partial", list)},
                completed=tuple(_nonnegative(split, "completed")
                                for split in _typed(state, "completed", list)),
                streams={_key(worker): _offset(entry, "streams")
                         for worker, entry in _typed(state, "streams", Mapping).items()},
                elements=_count(state, "elements"),
                workers=tuple(_key(worker) for worker in _typed(state, "workers", list)),
                consumer_index=_count(state, "consumer_index"),
                num_consumers=_count(state, "num_consumers"),
                finished=_typed(state, "finished", bool),
                group=_typed(state, "group", str) if "group" in state else "",
                skip=saved_skip(state.get("skip", [])))
        except (TypeError, ValueError) as err:  # e.g. a partial entry that is not a pair
            raise InvalidArgumentError(f"Malformed data-service position: {err}.") from None
        if position.skip and (position.processing_mode != ShardingPolicy.DYNAMIC
                              or position.num_consumers):
            raise InvalidArgumentError(
                "Only distributed_epoch positions skip element ids (merge_states' skip_ids): "
                "a skipped element of another mode would shift the positions its consumers "
                "count. Pass the dict state_dict() returned, unchanged.")
        return position


@dataclass(frozen=True)
class JobPosition:
    """Where all consumers of one distributed_epoch job were, saved at one step
    (``merge_states``): any number of new consumers of the job resume from it (see the
    module doc)."""

    dataset_id: str
    iteration: int
    job_key: str
    group: str
    consumers: tuple[Position, ...]
    processing_mode: int = int(ShardingPolicy.DYNAMIC)
    skip: tuple[int, ...] = ()  # element ids the resumed consumers leave out

    @property
    def elements(self) -> int:
        """Elements the merged consumers had returned."""
        return sum(p.elements for p in self.consumers)

    @property
    def finished(self) -> bool:
        """Every merged consumer had seen the iteration end: a resumed one ends at once."""
        return all(p.finished for p in self.consumers)

    def to_dict(self) -> dict[str, Any]:
        """The job position as a JSON-serialisable dict."""
        return {"version": VERSION, "kind": "job", "dataset_id": self.dataset_id,
                "processing_mode": self.processing_mode, "iteration": self.iteration,
                "job_key": self.job_key, "group": self.group, "skip": list(self.skip),
                "consumers": [{key: value for key, value in p.to_dict().items()
                               if key in _CONSUMER_KEYS} for p in self.consumers]}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> JobPosition:
        """The job position ``merge_states`` returned; InvalidArgumentError naming what is
        wrong with anything else."""
        common = {key: state.get(key) for key in
                  ("version", "dataset_id", "processing_mode", "iteration", "job_key", "group")}
        consumers = _typed(state, "consumers", list)
        if not consumers:
            raise InvalidArgumentError(
                "A merged data-service position lists no consumers: pass the dict "
                "merge_states() returned, unchanged.")
        positions = []
        for entry in consumers:
            if not isinstance(entry, Mapping):
                raise InvalidArgumentError(
                    f"A merged data-service position's consumer entry {entry!r} is not a "
                    "dict: pass the dict merge_states() returned, unchanged.")
            positions.append(Position.from_dict(
                {**common, **entry, "streams": {}, "workers": [], "consumer_index": 0,
                 "num_consumers": 0}))
        return merge(positions, saved_skip(state.get("skip", [])))

    def requests(self) -> list[ConsumerPosition]:
        """The merged consumers' positions, as the dispatcher takes them."""
        return [ConsumerPosition(
            consumer_id=p.consumer_id, handed=p.handed, completed=sorted(p.completed),
            partial=[SplitOffset(split_id=split, offset=offset.count, vouch=offset.vouch)
                     for split, offset in sorted(p.partial.items())])
            for p in self.consumers]


#: What a job position keeps of each consumer's position (the rest is the job's).
_CONSUMER_KEYS = ("consumer_id", "handed", "partial", "completed", "elements", "finished")


def load(state: Any) -> Position | JobPosition:
    """The position ``state_dict()`` or the job position ``merge_states()`` returned (a
    ``state`` argument); InvalidArgumentError naming what is wrong with anything else."""
    if isinstance(state, Mapping) and state.get("kind") == "job":
        if state.get("version") != VERSION:
            Position.from_dict(state)  # its version error
        return JobPosition.from_dict(state)
    return Position.from_dict(state)


def merge_states(states: Iterable[Any], skip_ids: Any = None) -> dict[str, Any]:
    """One job position, JSON-serialisable, from the positions ``state_dict()`` returned to
    all the consumers of one distributed_epoch job at the same step (gathered by the trainer,
    e.g. with ``torch.distributed.all_gather_object``): any number of new consumers of the
    job pass it as ``state`` and share the rest of the epoch, every element once over the
    whole run (see ``clusterwire.data.position``). InvalidArgumentError for positions of
    other modes (saying why they do not merge), of different jobs, of one consumer twice, or
    a merged position itself.

    ``skip_ids``: element ids (as a read with ``element_ids`` yielded them: ints, a batch's
    list) the resumed consumers leave out, e.g. those of the batches of steps k..k+n after a
    loss spike: those elements are never returned, the rest of the epoch still once. The
    consumers read their elements with ids and drop these (a batch the rows named, and the
    batch if it loses them all); the dispatcher and workers never see the list, so it acts
    on the job's own elements only. Every later position of the job carries them. At most
    ``limits.MAX_SKIP_IDS`` ids, with those the positions carry already
    (ResourceExhaustedError beyond)."""
    return merge(states, skip_ids).to_dict()


def merge(states: Iterable[Any], skip_ids: Any = None) -> JobPosition:
    """``merge_states``' job position, as a ``JobPosition``."""
    positions = []
    for state in states:
        if isinstance(state, JobPosition) or (isinstance(state, Mapping)
                                              and state.get("kind") == "job"):
            raise InvalidArgumentError(
                "merge_states takes the positions of single consumers, got a merged one: "
                "resume from it, and merge the positions its resumed consumers save.")
        positions.append(state if isinstance(state, Position) else Position.from_dict(state))
    if not positions:
        raise InvalidArgumentError(
            "merge_states needs the positions of all consumers of the job, got none.")
    first = positions[0]
    policy = ShardingPolicy(first.processing_mode)
    if first.num_consumers:
        raise InvalidArgumentError(
            "Round-robin positions do not merge: round r goes to consumer r mod "
            f"num_consumers ({first.num_consumers}, fixed for the job), so the rounds left "
            "cannot be shared by another number of consumers. Resume the same num_consumers "
            "together (each from its own position), or start a new iteration with the new "
            "number.")
    if policy != ShardingPolicy.DYNAMIC:
        why = ("each consumer reads every worker's whole copy of the data, so the job has "
               "no epoch shared by its consumers to divide" if policy == ShardingPolicy.OFF
               else "each worker's stream is one static shard, read by the consumer it went to")
        raise InvalidArgumentError(
            f"{mode_name(policy)} positions do not merge: {why}. Resume each consumer from "
            "its own position, or read with processing_mode='distributed_epoch', whose "
            "positions merge for any number of new consumers.")
    seen: set[str] = set()
    for position in positions:
        for key in ("dataset_id", "processing_mode", "iteration", "job_key", "group"):
            if getattr(position, key) != getattr(first, key):
                raise InvalidArgumentError(
                    f"merge_states got positions of different jobs: {key} "
                    f"{getattr(first, key)!r} and {getattr(position, key)!r}. Merge the "
                    "positions of the consumers of one job, saved at the same step.")
        if position.consumer_id in seen:
            raise InvalidArgumentError(
                f"merge_states got two positions of consumer {position.consumer_id!r} (saved "
                "at different steps, or passed twice): merge one position per consumer, "
                "all saved at the same step.")
        seen.add(position.consumer_id)
    if not first.group:
        raise InvalidArgumentError(
            "These positions name no group (saved by an earlier clusterwire): the dispatcher "
            "could not tell they are its job's consumers'. Save them again, then merge.")
    skip = {i for p in positions for i in p.skip}
    skip.update(provenance.flatten([] if skip_ids is None else skip_ids, "skip_ids"))
    return JobPosition(first.dataset_id, first.iteration, first.job_key, first.group,
                       tuple(sorted(positions, key=lambda p: p.consumer_id)),
                       skip=_bounded(sorted(skip)))


def saved_skip(saved: Any) -> tuple[int, ...]:
    """The ``skip`` ids a saved position holds (a list of ids, at most ``MAX_SKIP_IDS``)."""
    if not isinstance(saved, list):
        raise InvalidArgumentError(
            f"Data-service position key 'skip' must be a list of element ids, got "
            f"{saved!r:.80}: pass the dict state_dict() or merge_states() returned, unchanged.")
    _bounded(saved)
    ids = _bounded(provenance.flatten(saved, "Data-service position key 'skip'"))
    return tuple(sorted(set(ids)))


def _bounded(ids: list[Any]) -> tuple[Any, ...]:
    if len(ids) > MAX_SKIP_IDS:
        raise ResourceExhaustedError(
            f"A position may skip at most {MAX_SKIP_IDS} element ids, got {len(ids)}: skip "
            "fewer steps at once (or leave the rest of a bad stretch with a new iteration).")
    return tuple(ids)


def group_of(grant: bytes) -> str:
    """The ``group`` of a position: a digest of the job's grant (see the module doc)."""
    return hashlib.sha256(b"clusterwire round-robin group\x00" + grant).hexdigest()[:32]


def merge_id(consumers: Iterable[ConsumerPosition]) -> str:
    """The dispatcher's name for the merge of ``consumers``' positions (any order)."""
    digest = hashlib.sha256(b"clusterwire merged positions")
    for encoded in sorted(c.SerializeToString(deterministic=True) for c in consumers):
        digest.update(len(encoded).to_bytes(8, "big") + encoded)
    return digest.hexdigest()[:32]


def _typed(state: Mapping[str, Any], key: str, kind: type) -> Any:
    value = state.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidArgumentError(
            f"Data-service position key {key!r} must be a {kind.__name__}, got {value!r}: "
            "pass the dict state_dict() returned, unchanged.")
    return value


def _policy(state: Mapping[str, Any]) -> int:
    value = _typed(state, "processing_mode", int)
    if value not in set(ShardingPolicy):
        raise InvalidArgumentError(
            f"Data-service position key 'processing_mode' holds {value!r}, not a "
            "ShardingPolicy: pass the dict state_dict() returned, unchanged.")
    return value


def _count(state: Mapping[str, Any], key: str) -> int:
    return _nonnegative(_typed(state, key, int), key)


def _nonnegative(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(
            f"Data-service position key {key!r} holds {value!r}, not a count: pass the dict "
            "state_dict() returned, unchanged.")
    return value


def _offset(entry: Any, key: str) -> Offset:
    """An offset saved as [count] or [count, vouch] (to_json)."""
    if not isinstance(entry, list) or len(entry) not in (1, 2):
        raise InvalidArgumentError(
            f"Malformed data-service position: key {key!r} holds {entry!r}, not an offset "
            "and its vouch: pass the dict state_dict() returned, unchanged.")
    count = _nonnegative(entry[0], key)
    saved = entry[1] if len(entry) == 2 else None
    if saved is None:
        return Offset(count)
    if not isinstance(saved, Mapping):
        raise InvalidArgumentError(
            f"Data-service position key {key!r} holds vouch {saved!r}, not a dict: pass the "
            "dict state_dict() returned, unchanged.")
    try:
        return Offset(count, Vouch(
            job_id=_nonnegative(saved["job"], key), consumer_id=_typed(saved, "consumer", str),
            start=_nonnegative(saved["start"], key), end=_nonnegative(saved["end"], key),
            mac=bytes.fromhex(_typed(saved, "mac", str))))
    except KeyError as err:
        raise InvalidArgumentError(
            f"Data-service position key {key!r} holds a vouch without {err}: pass the dict "
            "state_dict() returned, unchanged.") from None


def _key(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentError(
            f"Data-service position names worker {value!r}, not an address.")
    return value


def split_limit(source: Source, ops: tuple[Op, ...], units: int) -> int | None:
    """The most elements a split of ``units`` units of ``source`` yields through ``ops`` (a
    split plan's): the largest offset a position may hold for the split. None where that is
    not known: a source whose units are not one element each (files: lines), an op whose
    output is not bounded by its input (``unbatch``, an endless ``repeat``)."""
    if source.cardinality() != source.units():
        return None
    limit = units
    for op in ops:
        if isinstance(op, (Map, Filter, Prefetch, Shuffle, Enumerate)):
            continue
        if isinstance(op, Batch):
            limit = -(-limit // op.batch_size)
        elif isinstance(op, Take):
            limit = limit if op.count < 0 else min(limit, op.count)
        elif isinstance(op, Skip):
            limit = 0 if op.count < 0 else max(0, limit - op.count)
        elif isinstance(op, Repeat) and (op.count >= 0 or limit == 0):
            limit *= max(op.count, 0)
        else:
            return None
    return limit


def check_split_offset(key: bytes, job_id: int, dataset_id: str, consumer_id: str,
                       at: SplitOffset, floor: int, limit: int | None,
                       lower: bool = False) -> None:
    """The dispatcher's check of a split offset a consumer hands back (resuming, or
    releasing the split): within the split (``check_offset``), not below ``floor`` (where
    the split was handed to this consumer; ``lower``: an offset below it is not an error,
    its caller keeps the higher one) and, above it, vouched for (``vouches.check``)."""
    check_offset(at.split_id, at.offset, limit)
    if at.offset < floor and not lower:
        raise PermissionDeniedError(
            f"A position puts split {at.split_id} at offset {at.offset}, but job {job_id} "
            f"handed it to consumer {consumer_id!r} at offset {floor}: the elements before "
            "are another consumer's. Pass the position state_dict() returned, unchanged.")
    if at.offset > floor:
        vouches.check(key, dataset_id, vouches.split_stream(at.split_id), at.offset,
                      at.vouch if at.HasField("vouch") else None, job_id, consumer_id)


def check_stream_offset(key: bytes, spec: StreamSpec, consumer_id: str, offset: int,
                        vouch: Vouch | None, pipe: Pipeline, address: str) -> None:
    """A worker's check of the offset a stream is asked to start at (a split's later
    attempt, a resumed stream): within its split and not before where it was handed to the
    consumer (``spec.handed_at``, granted), or within a finite dataset, and vouched for (a
    split's by its job and consumer; an anonymous or round-robin job's stream on
    worker ``address`` by any earlier job of the dataset, as a resumed iteration reads a new
    job). A round-robin consumer's vouch is of the last element it read of the stream, so
    the skip may pass the other consumers' elements of that round too."""
    if spec.is_split:
        check_offset(spec.split_id, offset, split_limit(
            pipe.source, split_plan(pipe).ops, spec.unit_end - spec.unit_start))
        if offset < spec.handed_at:
            raise PermissionDeniedError(
                f"A read puts split {spec.split_id} at offset {offset}, but job {spec.job_id} "
                f"handed it to consumer {consumer_id!r} at offset {spec.handed_at}: the "
                "elements before are another consumer's.")
        if offset > spec.handed_at:
            vouches.check(key, spec.dataset_id, vouches.split_stream(spec.split_id), offset,
                          vouch, spec.job_id, consumer_id)
        return
    cardinality = pipe.cardinality()
    if offset < 0 or 0 <= cardinality < offset:
        of = f" of a dataset of {cardinality}" if cardinality >= 0 else ""
        raise InvalidArgumentError(
            f"A read of job {spec.job_id} asked to skip {offset} elements{of}: pass the "
            "position state_dict() returned, unchanged.")
    if spec.num_consumers:
        vouches.check(key, spec.dataset_id,
                      vouches.round_robin_stream(address, spec.num_consumers), offset, vouch,
                      slack=spec.num_consumers - 1)
    else:
        vouches.check(key, spec.dataset_id, vouches.worker_stream(address), offset, vouch)


def check_offset(split_id: int, offset: int, limit: int | None) -> None:
    """InvalidArgumentError unless ``offset`` elements of split ``split_id`` (of at most
    ``limit`` elements; None: unbounded) can have been read."""
    if offset < 0 or (limit is not None and offset > limit):
        bound = "" if limit is None else f" (it holds at most {limit} elements)"
        raise InvalidArgumentError(
            f"A position or release puts split {split_id} at offset {offset}, outside the "
            f"split{bound}: pass the position state_dict() returned, unchanged.")
