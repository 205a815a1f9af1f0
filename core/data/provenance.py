"""Provenance: a stable id for every source element of an epoch, carried with it through a
pipeline (``distribute(..., element_ids=True)``, ``Dataset.with_element_ids()``), and
``replay``, which makes the elements of given ids again without the service.

An id names a source element, whatever reads it: the same however many workers and
consumers read the epoch and however its splits were handed out.

* ``range``, ``from_tensor_slices``: the element's index in the source (``0 .. n - 1``), an int.
* ``global_shuffle`` of those: the index of the element in its input (the id travels with
  the element; the permutation does not change it).
* ``from_files`` (lines), ``TFRecordDataset`` on a list of names (records),
  ``from_tar_shards`` (samples) and ``from_parquet`` (rows; with ``batch_rows`` a batch's
  list), not shuffled by ``global_shuffle``: file index ``f`` (in the list given) and
  record (line, sample, row) ``r`` within the file, packed in one int
  ``f * FILE_STRIDE + r`` (``file_record`` unpacks it): at most ``MAX_FILES`` files of at
  most ``FILE_STRIDE`` records each.
* ``interleave`` / ``flat_map`` over a dataset of file names (``list_files``, or
  ``range`` / ``from_tensor_slices``), when the function returns a read of one file
  (``TFRecordDataset``, ``from_files``, ``from_tar_shards`` or ``from_parquet`` of one name,
  then only ops that keep an element one record: ``_RECORD_OPS``): ``f * FILE_STRIDE + r``
  for record ``r`` of the Dataset the function returns for element ``f`` of the source,
  ``f`` the index in the source's list (``list_files``' *sorted* list: its shuffle, like a
  ``shuffle``, ``take``, ``skip``, ``shard``, ``repeat`` or ``prefetch`` of the names before
  the read (``_NAME_OPS``), does not change it). So in distributed_epoch, where a split is
  a file, the ids do not depend on which split went where. The function is called on the
  source's first element where ids are checked (before anything is read, as TF traces it)
  and on every element read: a Dataset of another kind (several files, a ``range``...) is
  refused with an InvalidArgumentError naming it. A file read of the names
  (``TFRecordDataset(list_files(...))``) may follow the same name ops.
* ``batch`` / ``padded_batch``: the list of its rows' ids (a batch of batches: a list of lists).

Through the other transformations an element keeps its id: ``map`` (the id of its input),
``filter``, ``take_while``, ``shuffle``, ``take``, ``skip``, ``shard``, ``repeat`` (each
repetition repeats the ids), ``prefetch``, ``cache()`` in memory, ``ignore_errors``,
``enumerate`` (the index joins the element, the id stays), ``unbatch`` (each row gets its own
id from the batch's list). Where an id is not defined, ``element_ids`` is refused with an
InvalidArgumentError naming the transformation (``_UNDEFINED`` says why for each); so is a
source without ids (``from_generator``, ``zip``, ``counter``, indexed TFRecord blocks,
``global_shuffle`` of a file read...).

On the wire an element with its id is the pair ``(id, element)``, encoded as one element
(the id a small int64 scalar or array beside the element's buffers): the worker runs the
pipeline with ids (``tagged``) for a stream whose ``StreamSpec.element_ids`` is set; the
consumer turns the ids into Python ints and lists (``public``).

``replay(dataset, ids)`` makes each element from its id alone: the source element of the
id (read by index; a file is read up to the record; through ``interleave``/``flat_map`` the
Dataset the function returns for name ``f`` of the source's list, read with ids up to the
record), then the transformations that change an element's value (``map``; a batch stacks
or pads its rows), so shuffles, splits and workers do not matter. ``filter`` and
``take_while`` are checked: an id they leave out is not in the epoch. Selection by position
(``take``, ``skip``, ``shard``) is not replayed: an id it left out is not refused. Replay
needs a pipeline whose functions are deterministic (a random augmentation must be seeded
from its element); ``enumerate`` and ``unbatch`` (whose values depend on what came before)
are refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from clusterwire.data.ops import batching, formats, global_shuffle, nested, sources, stateful
from clusterwire.data.pipeline import (
    Batch,
    Enumerate,
    Factory,
    FilesSource,
    Filter,
    GeneratorSource,
    Map,
    Op,
    Pipeline,
    Prefetch,
    RangeSource,
    Repeat,
    Shuffle,
    Skip,
    SlicesSource,
    Source,
    Take,
    Unbatch,
    _map_structure,
    _stack,
    call,
    normalize,
    pipeline_of,
)
from clusterwire.errors import InvalidArgumentError

#: Records (or lines) a file may hold for its ids: id = file index * FILE_STRIDE + record.
FILE_STRIDE = 1 << 40
#: Files a file source may list for its ids (the packed id stays an int64).
MAX_FILES = 1 << 23

_ONE_FILE = ("a read of one file: TFRecordDataset, from_files, from_tar_shards or "
             "from_parquet (without batch_rows) of one name, then only map, filter, "
             "take_while, shuffle, take, skip, shard, prefetch or ignore_errors")
_NESTED_WHY = (
    "its elements come from the datasets its function returns; ids are defined where it "
    "reads the names of list_files (or of range / from_tensor_slices) after only "
    "shuffle, take, skip, shard, repeat or prefetch of them, its function returning "
    + _ONE_FILE)

# Transformations through which an id is not defined, and why.
_UNDEFINED: dict[type, str] = {
    stateful.Scan: "its outputs combine the elements before them in its state",
    stateful.Unique: "it keeps one of several equal elements, of different ids",
    batching.Window: "its windows are datasets of several elements",
    batching.GroupByWindow: "it regroups elements into datasets its function reduces",
    batching.BucketBySequenceLength: "its batches are formed by length across the stream",
    batching.Rebatch: "its batches split and join the input's batches",
    nested.Concatenate: "its second dataset's elements have no ids of this source",
    nested.FlatMap: _NESTED_WHY,
    nested.Interleave: _NESTED_WHY,
}
_SOURCES_WITH_IDS = (
    "range, from_tensor_slices, global_shuffle of those, from_files, from_tar_shards, "
    "from_parquet, TFRecordDataset on a list of file names and interleave / flat_map of "
    "list_files' names reading one file each")


#: The Dataset calls that make the sources without a ``kind``.
_PLAIN: dict[type, str] = {RangeSource: "range", SlicesSource: "from_tensor_slices",
                           FilesSource: "from_files", GeneratorSource: "from_generator"}


class ElementIdsUndefinedError(InvalidArgumentError):
    """``element_ids`` are not defined through a transformation or source (an
    InvalidArgumentError; ``ignore_errors`` does not leave it out)."""


def _not_defined(what: str, why: str) -> InvalidArgumentError:
    """The error of a pipeline through which ``element_ids`` are not defined."""
    return ElementIdsUndefinedError(
        f"element_ids (asked for with element_ids=True, or by a position's skip ids) are not "
        f"defined through {what}: {why}. Ids are defined for the "
        f"elements of {_SOURCES_WITH_IDS}, through map, filter, batch, padded_batch, "
        "shuffle, take, skip, shard, repeat, prefetch, enumerate, unbatch, ignore_errors, "
        "take_while and cache() in memory (see clusterwire.data.provenance). Read without "
        "element_ids, or move the transformation after distribute().")


def _name(op: Any) -> str:
    kind = getattr(op, "kind", None)
    return kind if isinstance(kind, str) else _PLAIN.get(type(op), type(op).__name__.lower())


def file_record(element_id: int) -> tuple[int, int]:
    """``(file index, record index)`` of the id of a file source's record (or line)."""
    return divmod(int(element_id), FILE_STRIDE)


# ---- ids as the consumer sees them -------------------------------------------

def public(raw: Any) -> Any:
    """An id as a pipeline carries it (an int64 scalar, or an array for a batch) as the
    consumer gets it: an int, or a (nested) list of ints."""
    if isinstance(raw, np.ndarray) and raw.ndim:
        return raw.tolist()
    return int(raw)


def flatten(ids: Any, what: str = "ids") -> list[int]:
    """The source element ids in ``ids`` (ints, and lists or tuples of them as batches
    carry them): InvalidArgumentError naming anything else."""
    out: list[int] = []
    stack = [ids]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple, range, np.ndarray)):
            stack.extend(reversed(list(item)))
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool) \
                and 0 <= item < 2 ** 63:
            out.append(int(item))
        else:
            raise InvalidArgumentError(
                f"{what} holds {item!r:.80}, not an element id: pass the ids a dataset "
                "read with element_ids yielded (ints, and lists of them for batches).")
    return out


class Publisher:
    """What the consumer does to each ``(id, element)`` pair a stream with ids delivers:
    drop what ``skip`` names (a batch loses the rows it names, and goes when it loses all),
    then hand on ``(id, element)`` with a public id, or the element alone."""

    def __init__(self, skip: frozenset[int], with_ids: bool):
        self._skip = skip
        self._sorted = np.sort(np.fromiter(skip, dtype=np.int64, count=len(skip)))
        self._with_ids = with_ids

    def __call__(self, pair: Any) -> Any:
        """The element to return for ``pair``, or ``DROPPED``."""
        raw, element = pair
        if self._skip:
            ids = np.asarray(raw)
            if ids.ndim == 0:
                if int(ids) in self._skip:
                    return DROPPED
            else:
                # Membership by binary search: np.isin would sort the skip list per element.
                at = np.minimum(np.searchsorted(self._sorted, ids), len(self._sorted) - 1)
                skipped = self._sorted[at] == ids
                rows = ~skipped.reshape(len(ids), -1).all(axis=1)
                if not rows.any():
                    return DROPPED
                if not rows.all():
                    raw = ids[rows]
                    element = _map_structure(lambda t: np.asarray(t)[rows], element)
        return (public(raw), element) if self._with_ids else element


DROPPED = object()


# ---- running a pipeline with ids ---------------------------------------------

@dataclass(frozen=True)
class TaggedSource(Source):
    """``inner``'s elements as ``(id, element)`` pairs (its units and splits are the same)."""

    inner: Source

    @property  # type: ignore[override]
    def split_kind(self) -> str:
        return self.inner.split_kind

    def units(self) -> int | None:
        return self.inner.units()

    def cardinality(self) -> int:
        return self.inner.cardinality()

    def split_epochs(self, units: int, epochs: int) -> tuple[int, int]:
        return self.inner.split_epochs(units, epochs)

    def iterate(self) -> Iterator[Any]:
        inner = self.inner
        if isinstance(inner, global_shuffle.GlobalShuffleSource):
            start, end = inner.epoch_window()
            return self.read(start, end)
        return super().iterate()

    def read(self, start: int, end: int) -> Iterator[Any]:
        inner = self.inner
        if isinstance(inner, global_shuffle.GlobalShuffleSource):
            return inner.inputs[0].run(
                source=lambda: inner.gathered(start, end, with_ids=True),
                ops=tuple(_tag_op(op) for op in inner.elementwise_ops))
        if isinstance(inner, FilesSource):
            return _lines(inner, start, end)
        if isinstance(inner, formats.RowGroupsSource):
            bases = _row_group_ids(inner)[start:end]
            return zip(bases, inner.read(start, end), strict=True)
        return zip(map(np.int64, range(start, end)), inner.read(start, end), strict=True)


def _lines(source: FilesSource, start: int, end: int) -> Iterator[Any]:
    for index in range(start, end):
        base = _file_base(index)
        for record, line in enumerate(source.read(index, index + 1)):
            yield np.int64(base + record), line


def _file_base(index: int) -> int:
    if index >= MAX_FILES:
        raise InvalidArgumentError(
            f"element_ids number at most {MAX_FILES} files of a file source; file {index} "
            "is past that. Read fewer files per dataset, or read without element_ids.")
    return index * FILE_STRIDE


def _row_group_ids(source: formats.RowGroupsSource) -> np.ndarray:
    """The id of the first row of each row group of ``source`` (its units, a file's in a
    row): file index (in order of first appearance) * FILE_STRIDE + the rows of the file's
    row groups before it."""
    names, _, rows = source.tensors
    rows = np.asarray(rows, dtype=np.int64)
    _, first, inverse = np.unique(names, return_index=True, return_inverse=True)
    if len(first) > MAX_FILES:
        _file_base(len(first) - 1)  # its error
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first)] = np.arange(len(first))
    files = rank[inverse.reshape(-1)]
    starts = np.cumsum(rows) - rows
    firsts = np.full(len(first), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(firsts, files, starts)
    within = starts - firsts[files]
    if len(rows) and int((within + rows).max()) > FILE_STRIDE:
        raise InvalidArgumentError(
            f"element_ids number at most {FILE_STRIDE} rows of a Parquet file; one has more.")
    return files * FILE_STRIDE + within


class _NumberedRows:
    """The rows (or ``batch_rows`` batches) of a Parquet read of ``(first row id, row
    group)`` pairs, each with its id (a batch: its rows' ids). An iterator object, as the
    read's: an error fails one ``next`` and ends that row group only."""

    def __init__(self, read: formats.ParquetRead, pairs: Iterator[Any]):
        self._next = 0
        self._batched = read.batch_rows is not None
        self._rows = formats._RowGroups(read, self._groups(pairs))

    def _groups(self, pairs: Iterator[Any]) -> Iterator[Any]:
        for base, group in pairs:
            self._next = int(base)
            yield group

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        element = next(self._rows)
        first = self._next
        if self._batched:
            self._next += len(next(iter(element.values())))
            return np.arange(first, self._next, dtype=np.int64), element
        self._next += 1
        return np.int64(first), element


def _numbered(element: Any, open_file: Callable[[Any], Iterator[Any]]) -> Iterator[Any]:
    """The records of the file named in ``(id, name)``, with their ids."""
    raw, name = element
    base = _file_base(int(raw))
    for record, value in enumerate(open_file(name)):
        if record >= FILE_STRIDE:
            raise InvalidArgumentError(
                f"element_ids number at most {FILE_STRIDE} records of a file; "
                f"{formats.file_name(name)!r} has more.")
        yield np.int64(base + record), value


#: The reads of a dataset of file names whose records have ids (file, record).
_FILE_READS = (formats.TFRecordRead, formats.TarShardRead)
#: What reads the Datasets its function returns for a dataset of file names.
_NESTED = (nested.Interleave, nested.FlatMap)
#: What may come between a dataset of names and their read: ops that reorder or select
#: whole names, so a name keeps its index in the source's list (its file's number).
_NAME_OPS = (Shuffle, Take, Skip, stateful.Shard, Repeat, Prefetch)
#: What may follow the read of one file in the Dataset an interleave's function returns:
#: ops after which an element is still one record of the file, with its id.
_RECORD_OPS = (Map, Filter, stateful.TakeWhile, Shuffle, Take, Skip, stateful.Shard, Prefetch,
               stateful.IgnoreErrors)


def _names_read(pipe: Pipeline) -> int | None:
    """The index in ``pipe.ops`` of the read of the files its source names (a
    ``_FILE_READS`` op, or an interleave / flat_map), if only ``_NAME_OPS`` come before it
    and the source is a list (``range``, ``from_tensor_slices``, ``list_files``)."""
    source = pipe.source
    if not isinstance(source, (RangeSource, SlicesSource)) or \
            isinstance(source, (formats.RowGroupsSource, formats.RecordBlocksSource)):
        return None
    index = next((i for i, op in enumerate(pipe.ops) if not isinstance(op, _NAME_OPS)),
                 len(pipe.ops))
    if index < len(pipe.ops) and isinstance(pipe.ops[index], (*_FILE_READS, *_NESTED)):
        return index
    return None


def _returned(op: nested.Interleave | nested.FlatMap, element: Any) -> Pipeline:
    """The pipeline ``op``'s function returns for ``element`` (on a worker: guarded),
    checked to read one file: InvalidArgumentError naming what it is otherwise."""
    pipe = nested.returned_pipeline(op.fn, call(op.fn, element), op.guard, "map_func")
    odd = _not_one_file(pipe)
    if odd is not None:
        raise _not_defined(_name(op), f"its function returned {odd}, where ids need "
                           + _ONE_FILE)
    return pipe


def _not_one_file(pipe: Pipeline) -> str | None:
    """What ``pipe`` is, if not a read of one file followed by ``_RECORD_OPS`` only."""
    source, ops = pipe.source, pipe.ops
    first = ops[0] if ops else None
    if isinstance(source, FilesSource):
        files, rest = len(source.paths), ops
    elif isinstance(source, formats.FileNamesSource) and isinstance(first, _FILE_READS):
        files, rest = source.units(), ops[1:]
    elif isinstance(source, formats.RowGroupsSource) and \
            isinstance(first, formats.ParquetRead):
        if first.batch_rows is not None:
            return "from_parquet with batch_rows (batches of rows)"
        files, rest = len(np.unique(source.tensors[0])), ops[1:]
    else:
        return f"the source {_name(source)}" + (f" then {_name(first)}" if ops else "")
    if files != 1:
        return f"a read of {files} files"
    odd = next((op for op in rest if not isinstance(op, _RECORD_OPS)), None)
    return None if odd is None else f"a read of one file then {_name(odd)}"


@dataclass(frozen=True)
class _TaggedRead(Op):
    """A file read (``_FILE_READS``) of ``(file id, name)`` pairs: its records with ids."""

    read: formats.TFRecordRead | formats.TarShardRead | formats.ParquetRead

    def wrap(self, upstream: Factory) -> Factory:
        read = self.read

        def numbered(element: Any) -> Iterator[Any]:
            return _numbered(element, read._open)
        if isinstance(read, formats.ParquetRead):
            return lambda: _NumberedRows(read, upstream())
        if isinstance(read, formats.TFRecordRead):
            return read._cycled(numbered, upstream)
        return lambda: nested._Cycle(numbered, upstream(), 1, 1)

    def cardinality(self, upstream: int) -> int:
        return self.read.cardinality(upstream)


@dataclass(frozen=True)
class _Returned:
    """What an interleave's function returns as a Dataset does: its ``pipeline``."""

    pipeline: Pipeline


@dataclass(frozen=True)
class _InFile(Op):
    """The ids of one file's records (numbered as file 0) as those of file ``base``."""

    base: int

    def wrap(self, upstream: Factory) -> Factory:
        base = self.base
        return lambda: ((np.int64(base + int(raw)), element) for raw, element in upstream())


class _FileWithIds:
    """The function of an interleave / flat_map of ``(id, name)`` pairs: the one-file read
    the user's function returns for the name (checked: ``_returned``), its records with
    ids ``id * FILE_STRIDE + record``."""

    def __init__(self, op: nested.Interleave | nested.FlatMap):
        self.op = op

    def __call__(self, raw: Any, element: Any) -> _Returned:
        base = _file_base(int(raw))
        run = tagged(_returned(self.op, element))
        return _Returned(Pipeline(run.source, (*run.ops, _InFile(base))))


def _tag_read(op: Op) -> Op:
    """The read of a dataset of ``(id, name)`` pairs (``_names_read``'s op), with ids."""
    if isinstance(op, _NESTED):
        return replace(op, fn=_FileWithIds(op), guard=None)
    return _TaggedRead(op)  # type: ignore[arg-type]


class _OnValue:
    """A map function applied to the element of an ``(id, element)`` pair."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, raw: Any, element: Any) -> Any:
        return raw, call(self.fn, element)


class _TestValue:
    """A predicate applied to the element of an ``(id, element)`` pair."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, raw: Any, element: Any) -> Any:
        return call(self.fn, element)


@dataclass(frozen=True)
class _TaggedEnumerate(Enumerate):
    def wrap(self, upstream: Factory) -> Factory:
        return lambda: ((raw, (np.int64(i), e))
                        for i, (raw, e) in enumerate(upstream(), self.start))


@dataclass(frozen=True)
class _TaggedUnbatch(Unbatch):
    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            for raw, element in upstream():
                if np.ndim(raw) == 0:
                    raise _not_defined("unbatch of an element that is not a batch",
                                       "its rows would share one id")
                for index in range(len(raw)):
                    yield raw[index], _map_structure(lambda t, i=index: t[i], element)
        return run


@dataclass(frozen=True)
class _TaggedPaddedBatch(Op):
    op: batching.PaddedBatch

    def wrap(self, upstream: Factory) -> Factory:
        op = self.op

        def run() -> Iterator[Any]:
            for chunk in batching._chunks(upstream(), op.batch_size, op.drop_remainder):
                yield (np.stack([np.asarray(raw) for raw, _ in chunk]),
                       batching.padded([e for _, e in chunk], op.padded_shapes,
                                       op.padding_values, op.limits))
        return run

    def cardinality(self, upstream: int) -> int:
        return self.op.cardinality(upstream)


class _PastIgnoreErrors(BaseException):
    """An ``ElementIdsUndefinedError`` carried past ``ignore_errors``, which leaves out
    Exceptions only: a file whose Dataset has no ids fails the read instead of leaving its
    records out."""

    def __init__(self, error: ElementIdsUndefinedError):
        super().__init__(str(error))
        self.error = error


class _Refusals:
    """``elements``, raising an ``ElementIdsUndefinedError`` as ``_PastIgnoreErrors``. An
    iterator object, as ``ignore_errors``' input must be: it goes on after an ordinary
    error."""

    def __init__(self, elements: Iterator[Any]):
        self._elements = elements

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._elements)
        except ElementIdsUndefinedError as err:
            raise _PastIgnoreErrors(err) from None


@dataclass(frozen=True)
class _TaggedIgnoreErrors(Op):
    """``ignore_errors`` of ``(id, element)`` pairs: a refusal of ids is raised, not left out."""

    op: stateful.IgnoreErrors

    def wrap(self, upstream: Factory) -> Factory:
        ignoring = self.op.wrap(lambda: _Refusals(upstream()))

        def run() -> Iterator[Any]:
            try:
                yield from ignoring()
            except _PastIgnoreErrors as carried:
                raise carried.error from None
        return run

    def cardinality(self, upstream: int) -> int:
        return self.op.cardinality(upstream)


_SAME = (Batch, Shuffle, Take, Skip, Repeat, Prefetch, stateful.Shard)


def _check_source(pipe: Pipeline) -> None:
    """InvalidArgumentError unless ``pipe``'s source (and its leading read) has ids."""
    source = pipe.source
    if isinstance(source, global_shuffle.GlobalShuffleSource):
        inner = source.inputs[0]
        if source.reads_files or not isinstance(inner.source, (RangeSource, SlicesSource)) \
                or isinstance(inner.source, formats.FileNamesSource):
            raise _not_defined(
                "global_shuffle of a file read", "its records are numbered across files, "
                "not by file and record")
        return
    index = _names_read(pipe)
    if index is not None:
        op = pipe.ops[index]
        if source.units() > MAX_FILES:
            _file_base(source.units() - 1)  # its error
        if isinstance(op, _NESTED) and source.units():
            _returned(op, next(iter(source.read(0, 1))))  # refused before anything is read
        return
    if isinstance(source, formats.FileNamesSource):
        op = next((op for op in pipe.ops if not isinstance(op, _NAME_OPS)), None)
        what = _name(op) if op is not None else "a dataset"
        raise _not_defined(f"{what} of file names", "ids number the records of "
                           "TFRecordDataset(names), the samples of from_tar_shards and the "
                           "records of an interleave / flat_map reading one file a name")
    if isinstance(source, formats.RowGroupsSource):
        if not pipe.ops or not isinstance(pipe.ops[0], formats.ParquetRead):
            what = _name(pipe.ops[0]) if pipe.ops else "a dataset of Parquet row groups"
            raise _not_defined(f"{what} of row groups", "ids number the rows of from_parquet")
        return
    if isinstance(source, formats.RecordBlocksSource) or not \
            isinstance(source, (RangeSource, SlicesSource, FilesSource)):
        why = ("its elements are not numbered by the source"
               if isinstance(source, (GeneratorSource, sources.CounterSource,
                                      sources.TensorsSource))
               else "its elements are not numbered by file and record")
        raise _not_defined(f"the source {_name(source)}", why)


def _tag_op(op: Op) -> Op:
    if isinstance(op, Map):
        return replace(op, fn=_OnValue(op.fn))
    if isinstance(op, Filter):
        return replace(op, fn=_TestValue(op.fn))
    if isinstance(op, stateful.TakeWhile):
        return replace(op, predicate=_TestValue(op.predicate))
    if isinstance(op, Enumerate):
        return _TaggedEnumerate(op.start)
    if isinstance(op, Unbatch):
        return _TaggedUnbatch()
    if isinstance(op, batching.PaddedBatch):
        return _TaggedPaddedBatch(op)
    if isinstance(op, stateful.IgnoreErrors):
        return _TaggedIgnoreErrors(op)
    if isinstance(op, stateful.Cache) and not op.filename:
        return op
    if isinstance(op, _SAME):
        return op
    why = _UNDEFINED.get(type(op))
    if why is None:
        why = ("its file would hold elements with ids" if isinstance(op, stateful.Cache)
               else "it is not one of the transformations ids pass through")
    raise _not_defined(_name(op), why)


def tagged(pipe: Pipeline) -> Pipeline:
    """``pipe`` yielding ``(id, element)`` pairs (ids as int64 scalars and arrays); the same
    units, splits and element counts. InvalidArgumentError naming a source or
    transformation through which ids are not defined."""
    _check_source(pipe)
    ops = pipe.ops
    index = _names_read(pipe)
    if index is not None:
        return Pipeline(TaggedSource(pipe.source), (*ops[:index], _tag_read(ops[index]),
                                                    *map(_tag_op, ops[index + 1:])))
    if isinstance(pipe.source, formats.RowGroupsSource):
        return Pipeline(TaggedSource(pipe.source), (_TaggedRead(ops[0]),
                                                    *map(_tag_op, ops[1:])))
    return Pipeline(TaggedSource(pipe.source), tuple(_tag_op(op) for op in ops))


def check(pipe: Pipeline) -> None:
    """InvalidArgumentError unless ``element_ids`` are defined for ``pipe`` (see
    ``tagged``), checked where the consumer asks for them."""
    tagged(pipe)


@dataclass(frozen=True)
class _Public(Op):
    """The last op of ``Dataset.with_element_ids()``: ids as the consumer sees them."""

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: ((public(raw), element) for raw, element in upstream())


def with_public_ids(pipe: Pipeline) -> Pipeline:
    """``tagged(pipe)`` yielding ``(id, element)`` with ids as ints and lists (local
    iteration)."""
    run = tagged(pipe)
    return Pipeline(run.source, (*run.ops, _Public()))


# ---- replay ------------------------------------------------------------------

def replay(dataset: Any, ids: Iterable[Any]) -> list[tuple[Any, Any]]:
    """The elements of ``ids`` (as a dataset read with ``element_ids`` yielded them: ints, a
    batch's list of ints), each made again from its id on this machine without the
    service, as ``(id, element)`` in the order given (see the module doc for how).

    ``dataset``: the ``Dataset`` the service read (before ``distribute``), or one built the
    same way. InvalidArgumentError for an id not in the epoch (outside the source, left out
    by a ``filter``), an id where the dataset yields batches (or a list where it does not),
    or a pipeline whose elements cannot be made again from their ids alone."""
    pipe = pipeline_of(dataset)
    if pipe is None:
        raise InvalidArgumentError(
            f"replay takes the clusterwire.data.Dataset the ids came from, got "
            f"{type(dataset).__name__}.")
    if isinstance(pipe.source, TaggedSource):
        raise InvalidArgumentError(
            "replay takes the dataset without with_element_ids(): the ids say which elements.")
    entries = [_entry(item) for item in ids]
    _check_source(pipe)
    origin, ops = _origin(pipe)
    for op in ops:
        if isinstance(op, (Enumerate, Unbatch)):
            raise InvalidArgumentError(
                f"replay cannot make elements through {_name(op)}: their values depend on "
                "the elements before them in the stream, not on their ids alone. Replay "
                f"the dataset without {_name(op)} (and apply it to what replay returns).")
        _tag_op(op)  # the same transformations as with ids
    rows = _rows(origin, [leaf for entry in entries for leaf in flatten(entry)])
    return [(entry, _make(entry, ops, rows)) for entry in entries]


def _entry(item: Any) -> Any:
    flatten(item)  # the error for anything but ids
    if isinstance(item, (list, tuple, np.ndarray)):
        return [_entry(part) for part in item]
    return int(item)


@dataclass(frozen=True)
class _Origin:
    """How replay reads source elements by id: ``fetch(ids)`` for sorted distinct ids."""

    valid: Callable[[int], bool]
    fetch: Callable[[list[int]], Iterator[Any]]
    what: str


def _origin(pipe: Pipeline) -> tuple[_Origin, tuple[Op, ...]]:
    """The source elements by id, and the transformations after them."""
    source = pipe.source
    if isinstance(source, global_shuffle.GlobalShuffleSource):
        inner = source.inputs[0]
        offset, count = source.index_window
        ops = source.elementwise_ops
        return _Origin(lambda i: offset <= i < offset + count,
                       lambda ids: inner.run(source=lambda: inner.source.gather(
                           np.asarray(ids, dtype=np.int64)), ops=ops),
                       f"the {count} elements global_shuffle reads from index {offset}"), \
            pipe.ops
    index = _names_read(pipe)
    if index is not None:
        op = pipe.ops[index]

        def name(file: int) -> Any:
            return next(source.gather(np.asarray([file], dtype=np.int64)))  # type: ignore
        if isinstance(op, _NESTED):
            return _files(source.units(), lambda f: (  # type: ignore[arg-type]
                (int(raw), value) for raw, value in tagged(_returned(op, name(f))).run()),
                by_fn=True), pipe.ops[index + 1:]
        return _files(source.units(), lambda f: enumerate(op._open(name(f)))  # type: ignore
                      ), pipe.ops[index + 1:]
    if isinstance(source, FilesSource):
        return _files(len(source.paths), lambda f: enumerate(source.read(f, f + 1))), pipe.ops
    if isinstance(source, formats.RowGroupsSource):
        return _parquet_rows(source, pipe.ops[0]), pipe.ops[1:]  # type: ignore[arg-type]
    units = source.units()
    return _Origin(lambda i: i < units,  # type: ignore[operator]
                   lambda ids: source.gather(np.asarray(ids, dtype=np.int64)),  # type: ignore
                   f"the {units} elements of the source"), pipe.ops


def _parquet_rows(source: formats.RowGroupsSource, read: formats.ParquetRead) -> _Origin:
    """Parquet rows by id: the row group each falls in, read by row number."""
    if read.batch_rows is not None:
        raise InvalidArgumentError(
            "replay makes rows, and from_parquet(batch_rows=...) yields a row group's rows "
            "in batches: replay the rows of their ids from from_parquet without batch_rows.")
    bases, rows = _row_group_ids(source), np.asarray(source.tensors[2], dtype=np.int64)
    starts = np.cumsum(rows) - rows

    def unit(element_id: int) -> int:
        return int(np.searchsorted(bases, element_id, side="right")) - 1

    def valid(element_id: int) -> bool:
        at = unit(element_id)
        return at >= 0 and bases[at] // FILE_STRIDE == element_id // FILE_STRIDE and \
            element_id - bases[at] < rows[at]

    def fetch(ids: list[int]) -> Iterator[Any]:
        units = np.array([unit(i) for i in ids], dtype=np.int64)
        gather = formats._RowGather(read, source)
        try:
            yield from gather(starts[units] + np.asarray(ids, dtype=np.int64) - bases[units])
        finally:
            gather.close()
    return _Origin(valid, fetch, f"the rows of its {len(np.unique(source.tensors[0]))} files")


def _files(count: int, records: Callable[[int], Iterator[tuple[int, Any]]],
           by_fn: bool = False) -> _Origin:
    """Records by id, ``records(file)`` yielding a file's ``(record, value)`` pairs (the
    Dataset an interleave's function returned: ``by_fn``), read until the ids asked for
    are found."""
    def fetch(ids: list[int]) -> Iterator[Any]:
        for file, group in itertools.groupby(ids, key=lambda i: i // FILE_STRIDE):
            wanted = [i % FILE_STRIDE for i in group]
            keep, found, read = set(wanted), {}, 0
            for record, value in records(file):
                read += 1
                if record in keep:
                    found[record] = value
                    if len(found) == len(keep):
                        break
            for record in wanted:
                if record not in found:
                    raise InvalidArgumentError(
                        f"Element id {file * FILE_STRIDE + record} is not in the epoch: "
                        + (f"the Dataset map_func returned for file {file} gives {read} "
                           f"records, none of them record {record}" if by_fn else
                           f"file {file} has {read} records, not {record + 1}")
                        + ". Pass ids a read of this dataset with element_ids yielded.")
                yield found[record]
    return _Origin(lambda i: i // FILE_STRIDE < count, fetch,
                   f"the records of its {count} files")


def _rows(origin: _Origin, ids: Sequence[int]) -> dict[int, Any]:
    """The source element of each id."""
    wanted = sorted(set(ids))
    for element_id in wanted:
        if not origin.valid(element_id):
            raise InvalidArgumentError(
                f"Element id {element_id} is not in the epoch of this dataset "
                f"({origin.what}): pass ids a read of this dataset with element_ids yielded.")
    return dict(zip(wanted, origin.fetch(wanted), strict=True))


def _make(entry: Any, ops: tuple[Op, ...], rows: dict[int, Any]) -> Any:
    """The element of ``entry`` after ``ops``: a batch's rows made through the ops before
    its batching, stacked (or padded), then the ops after it."""
    last = max((i for i, op in enumerate(ops)
                if isinstance(op, (Batch, batching.PaddedBatch))), default=-1)
    if isinstance(entry, list) != (last >= 0):
        raise InvalidArgumentError(
            f"replay got id {entry!r:.80}, but this dataset yields "
            + ("batches: pass the list of ids of a batch." if last >= 0 else
               "single elements: pass their ids, not lists."))
    if last < 0:
        element = rows[entry]
    else:
        if not entry:
            raise InvalidArgumentError("replay got an empty batch of ids.")
        made = [_make(part, ops[:last], rows) for part in entry]
        op = ops[last]
        element = (_stack(made) if isinstance(op, Batch) else batching.padded(
            made, op.padded_shapes, op.padding_values))  # type: ignore[attr-defined]
    for op in ops[last + 1:]:
        if isinstance(op, Map):
            element = normalize(call(op.fn, element))
        elif isinstance(op, (Filter, stateful.TakeWhile)):
            test = op.fn if isinstance(op, Filter) else op.predicate
            if not bool(call(test, element)):
                raise InvalidArgumentError(
                    f"Element id {entry!r:.80} is not in the epoch: {_name(op)} leaves it "
                    "out. Pass ids a read of this dataset with element_ids yielded.")
    return element
