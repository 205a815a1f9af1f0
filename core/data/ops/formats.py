"""File formats as dataset transformations: file names (or Parquet row groups) in, records out,
and the sources of those names.

``TFRecordDataset``, ``Dataset.from_parquet`` and ``Dataset.from_tar_shards`` are a dataset of
file names (a ``FileNamesSource``, or any Dataset of names) followed by one of these reads;
Parquet's names are ``(file, row group)`` pairs (a ``RowGroupsSource``). The sources name their
split kind, so distributed_epoch hands out one file (TF's FILE sharding), one tar shard or one
row group per split (``clusterwire.data.splits``); a split's element count is not known
(``position.split_limit`` leaves it unbounded, as for ``from_files``).

An error reading a file (``DataLossError`` for damage, ``InvalidArgumentError`` for a missing
column or a tar member without a key) fails one element, naming the file, and ends that file
(Parquet: that row group): the next element comes from the next file, as TF's TFRecordDataset
goes on, so ``ignore_errors()`` leaves out the rest of a damaged file and reads the others.

Every file is opened through ``filesystems.open_readable``: on a worker with its
``readable_dirs`` (``graph.from_def`` sets ``readable``, which a client cannot send), locally
unchecked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from clusterwire.data.limits import PipelineLimits, ThreadBudget, refuse_cycle
from clusterwire.data.ops.base import Node, register
from clusterwire.data.ops.nested import _Cycle, _ParallelCycle, default_cycle_length
from clusterwire.data.pipeline import (
    AUTOTUNE,
    INFINITE,
    UNKNOWN,
    Factory,
    Op,
    SlicesSource,
    parallelism,
)
from clusterwire.data.tfrecord import (
    TFRecordReader,
    _compression,
    open_raw,
    read_index,
    record_data,
)
from clusterwire.errors import DataLossError, InvalidArgumentError, OpError


def file_name(value: Any) -> str:
    """A file name element (str, bytes or a numpy string scalar) as a str."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode()
    if isinstance(value, str):
        return str(value)
    raise InvalidArgumentError(
        f"A dataset of file names holds {value!r:.80} ({type(value).__name__}): give str or "
        "bytes scalars, as list_files makes.")


@register
@dataclass(frozen=True)
class FileNamesSource(Node, SlicesSource):
    """File names (a 1-D bytes array): ``list_files``', or the names given to
    ``TFRecordDataset`` / ``from_tar_shards``. A file is a split of distributed_epoch."""

    kind = "file_names"
    split_kind = "file"


@register
@dataclass(frozen=True)
class RowGroupsSource(Node, SlicesSource):
    """``(file name, row group, its rows)`` of ``from_parquet``: a row group is a split."""

    kind = "parquet_row_groups"
    split_kind = "row_group"


@register
@dataclass(frozen=True)
class RecordBlocksSource(Node, SlicesSource):
    """Blocks of records of indexed TFRecord files: ``(file name, byte offset of the first
    record, records, byte offset after the last, index file name)`` each, a block a split."""

    kind = "tfrecord_blocks"
    split_kind = "record_block"


def _locate(counts: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For element ``indices`` of units holding ``counts`` elements each: (unit, element
    within it) of each."""
    ends = np.cumsum(counts)
    units = np.searchsorted(ends, indices, side="right")
    return units, indices - (ends[units] - counts[units])


def _to_end(records: Iterator[Any]) -> Iterator[Any]:
    """``records``, ending after the first error it raises (the error is raised once)."""
    yield from records


class ReadsFiles(Op, Node):
    """What the format reads share: ``readable`` is the worker's readable_dirs (None locally)."""

    readable: tuple[str, ...] | None

    def on_worker(self, readable_dirs: tuple[str, ...]) -> ReadsFiles:
        """This read as a worker runs it: opening only under ``readable_dirs``."""
        return replace(self, readable=tuple(readable_dirs))  # type: ignore[type-var]

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN


class ParallelReads(ReadsFiles):
    """A read of files one after the other, or ``num_parallel_reads`` at once interleaved a
    record at a time (TF's order), on threads a worker's budget grants."""

    num_parallel_reads: int | None
    budget: ThreadBudget | None

    def _check_reads(self) -> None:
        if self.num_parallel_reads is not None:
            self._count("num_parallel_reads", "Give a positive int, AUTOTUNE or None.",
                        allow=(AUTOTUNE,))

    def _cycled(self, open_file: Callable[[Any], Iterator[Any]], upstream: Factory
                ) -> Factory:
        """The records of each file ``upstream`` names, ``open_file`` reading one."""
        reads = self.num_parallel_reads
        if reads is None:
            return lambda: _Cycle(open_file, upstream(), 1, 1)
        cycle = default_cycle_length() if reads == AUTOTUNE else reads
        budget = self.budget

        def make() -> Iterator[Any]:
            granted = cycle if budget is None else budget.take(cycle)
            if not granted:  # the worker's pipeline threads are spent: read in the reader's
                return _Cycle(open_file, upstream(), cycle, 1)
            return _ParallelCycle(open_file, upstream(), cycle, 1, granted, True, budget)
        return make

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        if self.num_parallel_reads is None:
            return self
        if self.num_parallel_reads == AUTOTUNE:
            reads = min(default_cycle_length(), limits.max_cycle_length)
        else:
            reads = self.num_parallel_reads
            refuse_cycle(reads, limits.max_cycle_length)
        reads = parallelism(reads, "TFRecordDataset", reads, limits)
        return replace(self, num_parallel_reads=reads, budget=budget)  # type: ignore[type-var]


@register
@dataclass(frozen=True)
class TFRecordRead(ParallelReads):
    """The records of each file name, as ``tf.data.TFRecordDataset``: one file after the
    other, or ``num_parallel_reads`` files interleaved a record at a time (TF's order)."""

    kind = "tfrecord"
    compression_type: str | None = None
    buffer_size: int | None = None
    num_parallel_reads: int | None = None
    readable: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    budget: ThreadBudget | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression_type", _compression(self.compression_type))
        if self.buffer_size is not None:
            self._count("buffer_size", "Give a number of bytes >= 0, or None for 256 KiB.",
                        minimum=0)
        self._check_reads()

    def _open(self, name: Any) -> Iterator[bytes]:
        return _to_end(TFRecordReader(file_name(name), self.compression_type,
                                      self.buffer_size, readable_prefixes=self.readable))

    def wrap(self, upstream: Factory) -> Factory:
        return self._cycled(self._open, upstream)


@register
@dataclass(frozen=True)
class TFRecordBlockRead(ParallelReads):
    """The records of each block of a ``RecordBlocksSource``, read from its first record's
    offset; a block that does not end where its index said is DataLossError. With
    ``num_parallel_reads`` the blocks of a file (consecutive in the source) are read as one
    file, that many files at once in TF's order."""

    kind = "tfrecord_block"
    buffer_size: int | None = None
    num_parallel_reads: int | None = None
    readable: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    budget: ThreadBudget | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.buffer_size is not None:
            self._count("buffer_size", "Give a number of bytes >= 0, or None for 256 KiB.",
                        minimum=0)
        self._check_reads()

    def _open(self, block: Any) -> Iterator[bytes]:
        name, start, count, end = file_name(block[0]), int(block[1]), int(block[2]), \
            int(block[3])
        with TFRecordReader(name, None, self.buffer_size, start=start,
                            readable_prefixes=self.readable) as reader:
            for _ in range(count):
                record = next(reader, None)
                if record is None:
                    break
                yield record
            if reader.offset != end:
                raise DataLossError(
                    f"TFRecord file {name!r}: its index puts {count} records between byte "
                    f"{start} and {end}, the file has them up to byte {reader.offset}: the "
                    "index is not this file's (write it again).")

    def _open_file(self, blocks: list[Any]) -> Iterator[bytes]:
        for block in blocks:
            yield from self._open(block)

    def wrap(self, upstream: Factory) -> Factory:
        if self.num_parallel_reads is None:
            return self._cycled(lambda block: _to_end(self._open(block)), upstream)
        return self._cycled(lambda blocks: _to_end(self._open_file(blocks)),
                            lambda: _files_of(upstream()))

    def random_access(self, source: RecordBlocksSource) -> tuple[int, _RecordGather]:
        """``global_shuffle``'s view of ``source``: its record count, and what reads records
        by number (in the order given, see ``_RecordGather``)."""
        return int(np.sum(source.tensors[2])), _RecordGather(source, self.readable)


def _files_of(blocks: Iterator[Any]) -> Iterator[list[Any]]:
    """The consecutive ``blocks`` of each file, a list per file (a file named again, or a
    block starting before the one before it, starts a new file)."""
    group: list[Any] = []
    for block in blocks:
        if group and (file_name(block[0]) != file_name(group[-1][0])
                      or int(block[1]) <= int(group[-1][1])):
            yield group
            group = []
        group.append(block)
    if group:
        yield group


#: The record bytes a ``_RecordGather`` reads before it hands them out (at least a record).
GATHER_BYTES = 16 << 20
#: Records of a file closer than this are read in one read, the bytes between them too.
_GATHER_GAP = 64 << 10


class _RecordGather:
    """Indexed TFRecord records by number: each file's index read once (with its first
    record's), each file opened once, for the view's life (``close()``). A call reads up to
    ``GATHER_BYTES`` of the records asked at a time in file and offset order, nearby ones in
    one read, and hands them out in the order asked; a record that cannot be read is its
    error, raised where it comes in that order."""

    def __init__(self, source: RecordBlocksSource, readable: tuple[str, ...] | None):
        self._names, self._starts, self._counts, _, self._index_names = source.tensors
        self._readable = readable
        self._first_row = np.full(len(self._counts), -1, dtype=np.int64)  # in its index
        self._indexes: dict[bytes, np.ndarray] = {}
        self._files: dict[bytes, Any] = {}

    def __call__(self, indices: np.ndarray) -> Iterator[bytes]:
        blocks, within = _locate(self._counts, indices)
        offsets = np.empty(len(indices), dtype=np.int64)
        sizes = np.empty(len(indices), dtype=np.int64)
        index_names = self._index_names[blocks]
        for index in np.unique(index_names).tolist():
            mask = index_names == index
            rows = self._index(index, blocks[mask])
            taken = rows[self._first_row[blocks[mask]] + within[mask]]
            offsets[mask], sizes[mask] = taken[:, 0], taken[:, 1]
        files = self._names[blocks]
        ends = np.cumsum(sizes)
        start = 0
        while start < len(indices):
            stop = max(start + 1, int(np.searchsorted(
                ends, ends[start] - sizes[start] + GATHER_BYTES, side="right")))
            yield from self._read(files[start:stop], offsets[start:stop], sizes[start:stop])
            start = stop

    def _index(self, index: bytes, blocks: np.ndarray) -> np.ndarray:
        """The rows of index ``index``, the first rows of ``blocks`` (its blocks) set."""
        if index not in self._indexes:
            self._indexes[index] = read_index(file_name(index),
                                              readable_prefixes=self._readable)
        rows = self._indexes[index]
        unset = np.unique(blocks[self._first_row[blocks] < 0])
        first = np.searchsorted(rows[:, 0], self._starts[unset])
        stop = first + self._counts[unset]
        if np.any(stop > len(rows)) or np.any(rows[np.minimum(first, len(rows) - 1), 0]
                                             != self._starts[unset]):
            raise DataLossError(
                f"TFRecord index {file_name(index)!r} does not hold the records it held when "
                "the Dataset was built: it changed since (build the Dataset again).")
        self._first_row[unset] = first
        return rows

    def _read(self, files: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
              ) -> Iterator[bytes]:
        order = np.lexsort((offsets, files))
        files, offsets, sizes = files[order], offsets[order], sizes[order]
        ends = offsets + sizes
        new_run = np.ones(len(order), dtype=bool)
        new_run[1:] = (files[1:] != files[:-1]) | (offsets[1:] > ends[:-1] + _GATHER_GAP)
        bounds = [*np.flatnonzero(new_run).tolist(), len(order)]
        out: list[Any] = [None] * len(order)
        for first, last in zip(bounds[:-1], bounds[1:], strict=True):
            name, base = file_name(files[first]), int(offsets[first])
            try:
                file = self._file(files[first])
                file.seek(base)
                frames = memoryview(file.read(int(ends[last - 1]) - base))
            except OpError as error:
                for k in range(first, last):
                    out[order[k]] = error
                continue
            for k in range(first, last):
                at = int(offsets[k]) - base
                try:
                    out[order[k]] = record_data(name, int(offsets[k]),
                                                frames[at:at + int(sizes[k])])
                except DataLossError as error:
                    out[order[k]] = error
        for record in out:
            if isinstance(record, OpError):
                raise record
            yield record

    def _file(self, name: bytes) -> Any:
        if name not in self._files:
            self._files[name] = open_raw(file_name(name), self._readable)
        return self._files[name]

    def close(self) -> None:
        """Closes the files the view opened."""
        for file in self._files.values():
            file.close()
        self._files.clear()


@register
@dataclass(frozen=True)
class TarShardRead(ReadsFiles):
    """The samples of each tar shard named (``TarShardReader``'s dicts), shard after shard.
    ``sample_counts``: the samples of each shard of its source, in order, when they were
    counted (``from_tar_shards(indexed=True)``): what ``global_shuffle`` needs."""

    kind = "tar_shards"
    sample_counts: tuple[int, ...] | None = None
    readable: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.sample_counts is not None:
            counts = tuple(self.sample_counts)
            if not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 0
                       for c in counts):
                raise InvalidArgumentError(
                    f"Malformed dataset: tar_shards sample_counts {counts!r:.80}.")
            object.__setattr__(self, "sample_counts", tuple(int(c) for c in counts))

    def random_access(self, source: Any) -> tuple[int, _SampleGather] | None:
        """``global_shuffle``'s view of the shards: their sample count, and what reads
        samples by number (in the order given, see ``_SampleGather``); None unless counted."""
        counts = None if self.sample_counts is None else np.array(self.sample_counts)
        names = getattr(source, "tensors", None)
        if counts is None or not isinstance(names, np.ndarray) or len(names) != len(counts):
            return None
        return int(counts.sum()), _SampleGather(names, counts, self.readable)

    def _open(self, name: Any) -> Iterator[Any]:
        from clusterwire.data.tar_shards import TarShardReader

        with TarShardReader(file_name(name), readable_prefixes=self.readable) as reader:
            yield from reader

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: _Cycle(self._open, upstream(), 1, 1)


class _SampleGather:
    """Tar shard samples by number, each from its shard's index (its headers, read once per
    view, when a sample of it is first asked); each shard opened once, for the view's life
    (``close()``)."""

    def __init__(self, names: np.ndarray, counts: np.ndarray,
                 readable: tuple[str, ...] | None):
        self._names, self._counts, self._readable = names, counts, readable
        self._shards: dict[int, tuple[Any, list]] = {}  # shard -> (reader, its index)

    def __call__(self, indices: np.ndarray) -> Iterator[dict[str, Any]]:
        for shard, within in zip(*_locate(self._counts, indices), strict=True):
            reader, index = self._shard(int(shard))
            yield reader.sample(index[within])

    def _shard(self, shard: int) -> tuple[Any, list]:
        if shard not in self._shards:
            from clusterwire.data.tar_shards import TarShardReader

            name = file_name(self._names[shard])
            reader = TarShardReader(name, readable_prefixes=self._readable)
            try:
                index = reader.index()
                if len(index) != self._counts[shard]:
                    raise DataLossError(
                        f"Tar shard {name!r} holds {len(index)} samples, "
                        f"{self._counts[shard]} when the Dataset was built: it changed since.")
            except BaseException:
                reader.close()
                raise
            self._shards[shard] = reader, index
        return self._shards[shard]

    def close(self) -> None:
        """Closes the shards the view opened."""
        for reader, _ in self._shards.values():
            reader.close()
        self._shards.clear()


@register
@dataclass(frozen=True)
class ParquetRead(ReadsFiles):
    """The rows (or ``batch_rows`` batches) of each ``(file, row group)`` element; the file
    stays open while consecutive elements name it."""

    kind = "parquet"
    columns: tuple[str, ...] | None = None
    batch_rows: int | None = None
    readable: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.columns is not None:
            if isinstance(self.columns, str) or not self.columns or not all(
                    isinstance(c, str) for c in self.columns):
                raise InvalidArgumentError(
                    f"columns={self.columns!r}: give a non-empty list of column names, or "
                    "None for all.")
            object.__setattr__(self, "columns", tuple(self.columns))
        if self.batch_rows is not None:
            self._count("batch_rows", "Give a number of rows >= 1, or None for one row per "
                        "element.")

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: _RowGroups(self, upstream())

    def random_access(self, source: RowGroupsSource) -> tuple[int, _RowGather] | None:
        """``global_shuffle``'s view of ``source``: its row count, and what reads rows by
        number (in the order given, see ``_RowGather``); None with ``batch_rows``, whose
        elements are batches."""
        if self.batch_rows is not None:
            return None
        return int(np.sum(source.tensors[2])), _RowGather(self, source)


class _RowGather:
    """Parquet rows by number: each file opened once, for the view's life (``close()``); a
    call reads each row group its rows fall in once (the read's columns only), takes its
    rows and hands them out in the order asked."""

    def __init__(self, read: ParquetRead, source: RowGroupsSource):
        self._read = read
        self._names, self._groups, self._rows = source.tensors
        self._readers: dict[bytes, Any] = {}

    def __call__(self, indices: np.ndarray) -> Iterator[dict[str, Any]]:
        units, within = _locate(self._rows, indices)
        # By row group, its rows taken in the order asked: the rows are then made in the
        # order they are handed out (a sorted take costs more in the reader's memory).
        order = np.argsort(units, kind="stable")
        units, within = units[order], within[order]
        bounds = [*np.flatnonzero(np.diff(units, prepend=-1)).tolist(), len(order)]
        taken: list[Any] = [None] * len(indices)
        places = order.tolist()
        for first, last in zip(bounds[:-1], bounds[1:], strict=True):
            unit = int(units[first])
            rows = self._reader(self._names[unit]).take(int(self._groups[unit]),
                                                        within[first:last])
            for place, row in zip(places[first:last], rows, strict=True):
                taken[place] = row
        return iter(taken)

    def _reader(self, name: bytes) -> Any:
        if name not in self._readers:
            from clusterwire.data.parquet import ParquetReader

            columns = self._read.columns
            self._readers[name] = ParquetReader(
                file_name(name), columns=None if columns is None else list(columns),
                readable_prefixes=self._read.readable)
        return self._readers[name]

    def close(self) -> None:
        """Closes the files the view opened."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


class _RowGroups:
    """The rows of each ``(file, row group)`` of ``pairs``; the file stays open while
    consecutive pairs name it. An iterator object: an error fails one ``next`` and ends that
    row group only (see the module docstring)."""

    def __init__(self, read: ParquetRead, pairs: Iterator[Any]):
        self._read, self._pairs = read, pairs
        self._reader: Any = None
        self._path: str | None = None
        self._rows: Iterator[Any] = iter(())

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                return next(self._rows)
            except StopIteration:
                pass
            try:
                pair = next(self._pairs)
            except StopIteration:
                self.close()
                raise
            self._rows = _to_end(self._open(file_name(pair[0]), int(pair[1])))

    def _open(self, name: str, group: int) -> Iterator[Any]:
        from clusterwire.data.parquet import ParquetReader

        if name != self._path:
            self.close()
            columns = self._read.columns
            self._reader = ParquetReader(
                name, columns=None if columns is None else list(columns),
                batch_rows=self._read.batch_rows, readable_prefixes=self._read.readable)
            self._path = name
        yield from self._reader.read(group, group + 1)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader, self._path = None, None


def names_array(paths: Any, what: str) -> np.ndarray:
    """``paths`` (a str or path, or a sequence of them) as a 1-D bytes array of file names."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    try:
        names = [os.fsdecode(p) for p in paths]
    except TypeError:
        raise InvalidArgumentError(
            f"{what} takes a file name or a list of them, got {paths!r:.80}.") from None
    if not names or not all(names):
        raise InvalidArgumentError(f"{what} needs at least one non-empty file name, got "
                                   f"{paths!r:.80}.")
    return np.array([n.encode() for n in names], dtype=bytes)
