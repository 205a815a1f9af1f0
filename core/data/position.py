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
* round-robin reads (``num_consumers``): the rounds returned (``elements``, one a round) and
  the workers they went to. The consumers of a job resume together, from the same round (as
  a synchronous trainer's ranks saved at one step), in a job of the rounds from there on
  whose worker streams skip the earlier rounds' elements. ``group`` names the job they read
  by a digest of its grant, which only its consumers hold: another client cannot join or
  block their resume without having joined that job.

What the service trusts of a position: the dispatcher checks a distributed_epoch position
against what the job handed the consumer (its own splits only, each offset within its
split: ``split_limit``); a worker skips a resumed stream's elements only while a reader
reads it (``streams.Stream``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterwire.data.modes import ShardingPolicy
from clusterwire.data.pipeline import (
    Batch,
    Enumerate,
    Filter,
    Map,
    Op,
    Prefetch,
    Repeat,
    Shuffle,
    Skip,
    Source,
    Take,
)
from clusterwire.errors import InvalidArgumentError

VERSION = 1


@dataclass(frozen=True)
class Position:
    """Where one consumer is in one iteration of a distributed dataset."""

    dataset_id: str
    processing_mode: int  # the job's ShardingPolicy
    iteration: int
    job_key: str = ""
    consumer_id: str = ""
    handed: int = 0
    partial: dict[int, int] = field(default_factory=dict)  # split id -> elements returned
    completed: tuple[int, ...] = ()
    streams: dict[str, int] = field(default_factory=dict)  # worker -> elements returned
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
                "partial": [[split, offset] for split, offset in sorted(self.partial.items())],
                "completed": sorted(self.completed), "streams": dict(sorted(self.streams.items())),
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
            raise InvalidArgumentError(
                f"Data-service position version {state.get('version')!r} is not "
                f"{VERSION}: save the position with this clusterwire, or start anew.")
        try:
            return cls(
                dataset_id=_typed(state, "dataset_id", str),
                processing_mode=_policy(state),
                iteration=_count(state, "iteration"),
                job_key=_typed(state, "job_key", str),
                consumer_id=_typed(state, "consumer_id", str),
                handed=_count(state, "handed"),
                partial={_nonnegative(split, "partial"): _nonnegative(offset, "partial")
                         for split, offset in _typed(state, "partial", list)},
                completed=tuple(_nonnegative(split, "completed")
                                for split in _typed(state, "completed", list)),
                streams={_key(worker): _nonnegative(count, "streams")
                         for worker, count in _typed(state, "streams", Mapping).items()},
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


def check_offset(split_id: int, offset: int, limit: int | None) -> None:
    """InvalidArgumentError unless ``offset`` elements of split ``split_id`` (of at most
    ``limit`` elements; None: unbounded) can have been read."""
    if offset < 0 or (limit is not None and offset > limit):
        bound = "" if limit is None else f" (it holds at most {limit} elements)"
        raise InvalidArgumentError(
            f"A position or release puts split {split_id} at offset {offset}, outside the "
            f"split{bound}: pass the position state_dict() returned, unchanged.")
