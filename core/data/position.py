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
of that round). Positions of version 1 carry no vouches and are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterwire.data import vouches
from clusterwire.data.modes import ShardingPolicy
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
from clusterwire.errors import InvalidArgumentError, PermissionDeniedError
from clusterwire.protos.data_service_pb2 import SplitOffset, StreamSpec, Vouch

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
    group: str = ""  # round-robin reads: the digest of the job's grant (see the module doc)

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
                "finished": self.finished, "group": self.group}

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
            return cls(
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
                group=_typed(state, "group", str) if "group" in state else "")
        except (TypeError, ValueError) as err:  # e.g. a partial entry that is not a pair
            raise InvalidArgumentError(f"Malformed data-service position: {err}.") from None


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
