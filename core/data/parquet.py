"""Parquet files through pyarrow (the ``parquet`` extra): row groups as the splits.

An element is a dict column -> value: a numpy scalar for numbers, bools and times, ``str``
for strings, ``bytes`` for binary, None for a null string or binary value. With
``batch_rows`` an element is a dict column -> numpy array of up to that many rows of one
row group (strings and binary as object arrays). A numeric column without nulls reaches
numpy without a copy (a read-only view of Arrow's buffer); Arrow copies bools (bit-packed)
and columns with nulls (a number column with nulls comes as float with NaN, as Arrow
converts it).

Paths are local paths or fsspec URLs, opened through ``filesystems.open_readable``.
pyarrow is imported when a file is opened, never by ``import clusterwire.data``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from clusterwire.data.filesystems import open_readable
from clusterwire.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    OutOfRangeError,
)

#: Rows decoded at once when an element is one row.
_ROWS_PER_BATCH = 65536


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise FailedPreconditionError(
            "Reading Parquet needs pyarrow: pip install 'clusterwire[parquet]'.") from None
    return pa, pq


@dataclass(frozen=True)
class ParquetFileInfo:
    """One file's split plan: its row groups and the rows of each."""

    path: str
    row_group_rows: tuple[int, ...]

    @property
    def row_groups(self) -> int:
        return len(self.row_group_rows)

    @property
    def rows(self) -> int:
        return sum(self.row_group_rows)


@dataclass(frozen=True)
class ParquetPlan:
    """The row groups (splits) of a list of files, in order."""

    files: tuple[ParquetFileInfo, ...]

    @property
    def row_groups(self) -> int:
        return sum(f.row_groups for f in self.files)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)


class ParquetReader:
    """The row groups of one Parquet file, read as elements (see the module docstring).

    ``columns`` None reads every column; a list names them (in that order), and a name the
    file lacks is InvalidArgumentError naming the column and the file. ``readable_prefixes``
    as for ``filesystems.open_readable`` (None: the caller's own reads, unchecked). A context
    manager.
    """

    def __init__(self, path: str | os.PathLike, *, columns: Sequence[str] | None = None,
                 batch_rows: int | None = None, readable_prefixes: Iterable[str] | None):
        if batch_rows is not None and (isinstance(batch_rows, bool)
                                       or not isinstance(batch_rows, int) or batch_rows < 1):
            raise InvalidArgumentError(
                f"batch_rows={batch_rows!r}: give a number of rows >= 1, or None for one "
                "row per element.")
        _, pq = _pyarrow()
        self._path = os.fspath(path)
        self._batch_rows = batch_rows
        self._file = _native(open_readable(path, readable_prefixes))
        try:
            # Pre-buffered (ParquetFile's default only since apache/arrow#49924): a row
            # group's column chunks come in a few coalesced reads, held until the next row
            # group's; read chunk by chunk, a worker faulted fresh memory in for each
            # (BENCHMARKS, Data files).
            self._parquet = pq.ParquetFile(self._file, pre_buffer=True)
        except Exception as error:
            self._file.close()
            raise DataLossError(
                f"Parquet file {self._path!r} cannot be read: {error} (is it a Parquet "
                "file?)") from None
        self.columns = self._check_columns(columns)

    def _check_columns(self, columns: Sequence[str] | None) -> list[str]:
        names = self._parquet.schema_arrow.names
        if columns is None:
            return list(names)
        if isinstance(columns, str) or not columns:
            self.close()
            raise InvalidArgumentError(
                f"columns={columns!r}: give a non-empty list of column names, or None for all.")
        for column in columns:
            if column not in names:
                self.close()
                raise InvalidArgumentError(
                    f"Parquet file {self._path!r} has no column {column!r} (its columns: "
                    f"{', '.join(map(repr, names))}).")
        return list(columns)

    @property
    def num_row_groups(self) -> int:
        return int(self._parquet.metadata.num_row_groups)

    @property
    def num_rows(self) -> int:
        return int(self._parquet.metadata.num_rows)

    def read(self, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """The elements of row groups ``start`` up to (not including) ``stop`` (None: the end)."""
        count = self.num_row_groups
        stop = count if stop is None else stop
        if not 0 <= start <= stop <= count:
            raise OutOfRangeError(
                f"Parquet file {self._path!r} has {count} row groups; row groups "
                f"[{start}, {stop}) are out of range.")
        for index in range(start, stop):
            for batch in self._batches(index):
                yield from self._elements(batch)

    def take(self, group: int, rows: np.ndarray) -> Iterator[dict[str, Any]]:
        """The elements (one row each) of rows ``rows`` (an int64 array) of row group
        ``group``, in that order: ``global_shuffle``'s random access."""
        pa, _ = _pyarrow()
        for batch in self._row_group(group).take(pa.array(rows)).to_batches():
            yield from self._elements(batch)

    def _batches(self, index: int) -> Iterator[Any]:
        """Row group ``index`` in record batches of ``batch_rows`` rows (of
        ``_ROWS_PER_BATCH`` for one row per element), each decoded into memory of its own:
        an element keeps its batch alive, not its whole row group (a worker keeps a finished
        split's last elements for a retry a while), and the first one comes after one
        batch's decode. DataLossError as ``_row_group``."""
        pa, _ = _pyarrow()
        batches = self._parquet.iter_batches(batch_size=self._batch_rows or _ROWS_PER_BATCH,
                                             row_groups=[index], columns=self.columns)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (OSError, pa.ArrowException) as error:
                raise DataLossError(
                    f"Parquet file {self._path!r}: row group {index} cannot be read: "
                    f"{error}") from None
            yield batch

    def _row_group(self, index: int) -> Any:
        """Row group ``index`` as a pyarrow Table of ``columns``; DataLossError naming the
        file and the row group if it cannot be read."""
        pa, _ = _pyarrow()
        try:
            return self._parquet.read_row_group(index, columns=self.columns)
        except (OSError, pa.ArrowException) as error:
            raise DataLossError(
                f"Parquet file {self._path!r}: row group {index} cannot be read: "
                f"{error}") from None

    def _elements(self, batch: Any) -> Iterator[dict[str, Any]]:
        per_row = self._batch_rows is None
        values = {name: _values(batch.column(i), per_row)
                  for i, name in enumerate(batch.schema.names)}
        if not per_row:
            yield values
            return
        names = list(values)
        for row in zip(*values.values(), strict=True):
            yield dict(zip(names, row, strict=True))

    def close(self) -> None:
        """Closes the file; idempotent."""
        self._file.close()

    def __enter__(self) -> ParquetReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _native(file: Any) -> Any:
    """A local file (opened and checked by ``open_readable``) as an Arrow ``OSFile`` over the
    same open file: Arrow then reads it itself, into its own memory pool, rather than through
    Python's file object (a new ``bytes`` of fresh memory for every read, each under the
    GIL). Other files (fsspec's, or a subclass that reads its own way) as they are."""
    if type(file) not in (io.BufferedReader, io.FileIO):
        return file
    pa, _ = _pyarrow()
    try:
        duplicate = os.dup(file.fileno())
    finally:
        file.close()
    try:
        return pa.OSFile(duplicate)  # owns (and closes) the duplicate from here on
    except BaseException:
        os.close(duplicate)
        raise


def _values(array: Any, per_row: bool) -> Any:
    """A column of one batch as numpy (a view where Arrow allows), or a list of str/bytes."""
    pa, _ = _pyarrow()
    kind = array.type
    if per_row and (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                    or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        return array.to_pylist()
    try:
        return array.to_numpy(zero_copy_only=True)
    except pa.ArrowInvalid:  # nulls, bools, strings: Arrow must build new memory
        return np.asarray(array.to_numpy(zero_copy_only=False))


def plan_row_groups(paths: Iterable[str | os.PathLike], *,
                    readable_prefixes: Iterable[str] | None) -> ParquetPlan:
    """The row groups and rows of each file (footers only), for split planning."""
    prefixes = None if readable_prefixes is None else tuple(readable_prefixes)
    files = []
    for path in paths:
        with ParquetReader(path, readable_prefixes=prefixes) as reader:
            metadata = reader._parquet.metadata
            files.append(ParquetFileInfo(
                os.fspath(path),
                tuple(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups))))
    return ParquetPlan(tuple(files))
