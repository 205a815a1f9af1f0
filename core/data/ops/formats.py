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
from clusterwire.data.ops import Node, register
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
from clusterwire.data.tfrecord import TFRecordReader, _compression, read_index
from clusterwire.errors import DataLossError, InvalidArgumentError


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


@register
@dataclass(frozen=True)
class TFRecordRead(ReadsFiles):
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
        if self.num_parallel_reads is not None:
            self._count("num_parallel_reads", "Give a positive int, AUTOTUNE or None.",
                        allow=(AUTOTUNE,))

    def _open(self, name: Any) -> Iterator[bytes]:
        return _to_end(TFRecordReader(file_name(name), self.compression_type,
                                      self.buffer_size, readable_prefixes=self.readable))

    def wrap(self, upstream: Factory) -> Factory:
        reads = self.num_parallel_reads
        if reads is None:
            return lambda: _Cycle(self._open, upstream(), 1, 1)
        cycle = default_cycle_length() if reads == AUTOTUNE else reads
        budget = self.budget

        def make() -> Iterator[Any]:
            granted = cycle if budget is None else budget.take(cycle)
            if not granted:  # the worker's pipeline threads are spent: read in the reader's
                return _Cycle(self._open, upstream(), cycle, 1)
            return _ParallelCycle(self._open, upstream(), cycle, 1, granted, True, budget)
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
        return replace(self, num_parallel_reads=reads, budget=budget)


@register
@dataclass(frozen=True)
class TFRecordBlockRead(ReadsFiles):
    """The records of each block of a ``RecordBlocksSource``, read from its first record's
    offset; a block that does not end where its index said is DataLossError."""

    kind = "tfrecord_block"
    buffer_size: int | None = None
    readable: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.buffer_size is not None:
            self._count("buffer_size", "Give a number of bytes >= 0, or None for 256 KiB.",
                        minimum=0)

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

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: _Cycle(lambda block: _to_end(self._open(block)), upstream(), 1, 1)

    def random_access(self, source: RecordBlocksSource
                      ) -> tuple[int, Callable[[np.ndarray], Iterator[bytes]]]:
        """``global_shuffle``'s view of ``source``: its record count, and what reads records
        by number (in the order given), each at its offset from its file's index (an index
        is read once per view, when a record of its file is first asked)."""
        names, starts, counts, _, index_names = source.tensors
        indexes: dict[str, np.ndarray] = {}

        def gather(indices: np.ndarray) -> Iterator[bytes]:
            for block, within in zip(*_locate(counts, indices), strict=True):
                index = file_name(index_names[block])
                if index not in indexes:
                    indexes[index] = read_index(index, readable_prefixes=self.readable)
                rows = indexes[index]
                offset, size = rows[int(np.searchsorted(rows[:, 0], starts[block])) + within]
                with TFRecordReader(file_name(names[block]), None, int(size),
                                    start=int(offset), readable_prefixes=self.readable
                                    ) as reader:
                    yield next(reader)
        return int(np.sum(counts)), gather


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

    def random_access(self, source: Any
                      ) -> tuple[int, Callable[[np.ndarray], Iterator[dict[str, Any]]]] | None:
        """``global_shuffle``'s view of the shards: their sample count, and what reads
        samples by number (in the order given), each from its shard's index (its headers,
        read once per view, when a sample of it is first asked); None unless counted."""
        counts = None if self.sample_counts is None else np.array(self.sample_counts)
        names = getattr(source, "tensors", None)
        if counts is None or not isinstance(names, np.ndarray) or len(names) != len(counts):
            return None
        from clusterwire.data.tar_shards import TarShardReader

        indexes: dict[int, list] = {}

        def gather(indices: np.ndarray) -> Iterator[dict[str, Any]]:
            for shard, within in zip(*_locate(counts, indices), strict=True):
                with TarShardReader(file_name(names[shard]),
                                    readable_prefixes=self.readable) as reader:
                    if shard not in indexes:
                        indexes[shard] = reader.index()
                        if len(indexes[shard]) != counts[shard]:
                            raise DataLossError(
                                f"Tar shard {file_name(names[shard])!r} holds "
                                f"{len(indexes[shard])} samples, {counts[shard]} when the "
                                "Dataset was built: it changed since.")
                    yield reader.sample(indexes[shard][within])
        return int(counts.sum()), gather

    def _open(self, name: Any) -> Iterator[Any]:
        from clusterwire.data.tar_shards import TarShardReader

        with TarShardReader(file_name(name), readable_prefixes=self.readable) as reader:
            yield from reader

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: _Cycle(self._open, upstream(), 1, 1)


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

    def random_access(self, source: RowGroupsSource
                      ) -> tuple[int, Callable[[np.ndarray], Iterator[dict[str, Any]]]] | None:
        """``global_shuffle``'s view of ``source``: its row count, and what reads rows by
        number (in the order given: each row group they fall in read once per call, its rows
        taken); None with ``batch_rows``, whose elements are batches."""
        if self.batch_rows is not None:
            return None
        from clusterwire.data.parquet import ParquetReader

        names, groups, rows = source.tensors
        columns = None if self.columns is None else list(self.columns)

        def gather(indices: np.ndarray) -> Iterator[dict[str, Any]]:
            units, within = _locate(rows, indices)
            taken: list[Any] = [None] * len(indices)
            for unit in np.unique(units).tolist():
                where = np.flatnonzero(units == unit)
                with ParquetReader(file_name(names[unit]), columns=columns,
                                   readable_prefixes=self.readable) as reader:
                    rows_taken = reader.take(int(groups[unit]), within[where])
                    for place, row in zip(where.tolist(), rows_taken, strict=True):
                        taken[place] = row
            return iter(taken)
        return int(np.sum(rows)), gather


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
