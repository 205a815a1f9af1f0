"""The pipelines of the Datasets read from files: ``TFRecordDataset``, ``Dataset.list_files``,
``Dataset.from_parquet`` and ``Dataset.from_tar_shards`` (``clusterwire.data.dataset`` makes
them Datasets; this module is below it, and takes a Dataset of names by its ``pipeline``).

Each is a dataset of file names (a ``FileNamesSource``, or Parquet ``(file, row group)`` pairs
in a ``RowGroupsSource``) followed by the format's read (``clusterwire.data.ops.formats``), so
distributed_epoch hands out a file, a tar shard or a row group per split
(``clusterwire.data.splits``). Paths are local paths or fsspec URLs.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from clusterwire.data.filesystems import is_url
from clusterwire.data.ops.formats import (
    FileNamesSource,
    ParquetRead,
    RecordBlocksSource,
    RowGroupsSource,
    TarShardRead,
    TFRecordBlockRead,
    TFRecordRead,
    names_array,
)
from clusterwire.data.pipeline import Pipeline, pipeline_of
from clusterwire.data.splits import record_blocks
from clusterwire.data.tfrecord import index_path, read_index
from clusterwire.errors import FailedPreconditionError, InvalidArgumentError


def tfrecords(filenames: Any, compression_type: str | None, buffer_size: int | None,
              num_parallel_reads: int | None, index_filenames: Any, block_bytes: int
              ) -> Pipeline:
    """``TFRecordDataset``'s pipeline (see its arguments there)."""
    if index_filenames is not None:
        return _indexed(filenames, compression_type, buffer_size, num_parallel_reads,
                        index_filenames, block_bytes)
    read = TFRecordRead(compression_type, buffer_size, num_parallel_reads)
    names = pipeline_of(filenames)
    if names is not None:
        return Pipeline(names.source, (*names.ops, read))
    return Pipeline(FileNamesSource(names_array(filenames, "TFRecordDataset")), (read,))


def _indexed(filenames: Any, compression_type: str | None, buffer_size: int | None,
             num_parallel_reads: int | None, index_filenames: Any, block_bytes: int
             ) -> Pipeline:
    if pipeline_of(filenames) is not None or compression_type:
        raise InvalidArgumentError(
            "TFRecordDataset(index_filenames=...) reads uncompressed files named in a list: "
            "give a list of names and compression_type=None (got "
            f"{type(filenames).__name__}, {compression_type!r}).")
    names = [n.decode() for n in names_array(filenames, "TFRecordDataset")]
    indexes = [index_path(n) for n in names] if index_filenames is True else \
        [n.decode() for n in names_array(index_filenames, "index_filenames")]
    if len(indexes) != len(names):
        raise InvalidArgumentError(
            f"index_filenames names {len(indexes)} indexes for {len(names)} files: give one "
            "per file, in the same order (or True for <file>.idx).")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise InvalidArgumentError(f"block_bytes={block_bytes!r}: give a number of bytes "
                                   ">= 1.")
    blocks: list[tuple[bytes, int, int, int]] = []
    for name, index in zip(names, indexes, strict=True):
        rows = read_index(index)
        starts = record_blocks(rows[:, 0], block_bytes)
        stops = [*starts[1:].tolist(), len(rows)]
        for first, stop in zip(starts.tolist(), stops, strict=True):
            end = int(rows[stop - 1, 0] + rows[stop - 1, 1])
            blocks.append((name.encode(), int(rows[first, 0]), stop - first, end,
                           index.encode()))
    columns = list(zip(*blocks, strict=True)) or [()] * 5
    source = RecordBlocksSource((np.array(columns[0], dtype=bytes),
                                 *(np.array(c, dtype=np.int64) for c in columns[1:4]),
                                 np.array(columns[4], dtype=bytes)))
    return Pipeline(source, (TFRecordBlockRead(buffer_size, num_parallel_reads),))


def list_files(file_pattern: str | os.PathLike | list) -> Pipeline:
    """The file names (bytes) matching ``file_pattern`` (a glob, or a list of globs; local
    or an fsspec URL), sorted, as ``tf.data.Dataset.list_files`` lists them before its
    shuffle. No match is InvalidArgumentError naming the pattern."""
    patterns = [file_pattern] if isinstance(file_pattern, (str, bytes, os.PathLike)) \
        else list(file_pattern)
    names = sorted({name for pattern in patterns for name in _glob(os.fsdecode(pattern))})
    if not names:
        raise InvalidArgumentError(
            f"No files matched pattern: {', '.join(os.fsdecode(p) for p in patterns)}")
    return Pipeline(FileNamesSource(names_array(names, "list_files")))


def _glob(pattern: str) -> list[str]:
    if not is_url(pattern):
        return [name for name in glob.glob(pattern) if os.path.isfile(name)]
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise FailedPreconditionError(
            f"Listing {pattern!r} needs fsspec: pip install 'clusterwire[fsspec]'.") from None
    fs, path = url_to_fs(pattern)
    return [fs.unstrip_protocol(name) for name in fs.glob(path) if fs.isfile(name)]


def from_parquet(paths: Any, columns: list[str] | None = None,
                 batch_rows: int | None = None) -> Pipeline:
    """The rows of Parquet files (see ``clusterwire.data.parquet``): dicts column -> value,
    or with ``batch_rows`` column -> array of up to that many rows of one row group. The
    files' footers are read here to list their row groups, the splits of distributed_epoch."""
    from clusterwire.data.parquet import plan_row_groups

    names = [name.decode() for name in names_array(paths, "from_parquet")]
    read = ParquetRead(columns, batch_rows)
    plan = plan_row_groups(names, readable_prefixes=None)
    files = [np.full(info.row_groups, info.path.encode(), dtype=object) for info in plan.files]
    groups = [np.arange(info.row_groups, dtype=np.int64) for info in plan.files]
    rows = [np.array(info.row_group_rows, dtype=np.int64) for info in plan.files]
    return Pipeline(RowGroupsSource((np.concatenate(files).astype(bytes),
                                     np.concatenate(groups), np.concatenate(rows))), (read,))


def from_tar_shards(paths: Any, indexed: bool = False) -> Pipeline:
    """The samples of WebDataset tar shards (``TarShardReader``'s dicts ``{ext: bytes,
    "__key__": key}``), shard after shard; a shard is a split of distributed_epoch.
    ``indexed=True`` reads the (uncompressed) shards' headers here to count their samples,
    so ``global_shuffle`` can read samples by number."""
    names = names_array(paths, "from_tar_shards")
    counts = None
    if indexed:
        from clusterwire.data.tar_shards import TarShardReader

        counts = []
        for name in names:
            with TarShardReader(name.decode(), readable_prefixes=None) as reader:
                counts.append(len(reader.index()))
    elif indexed is not False:
        raise InvalidArgumentError(f"from_tar_shards `indexed` must be a bool, got "
                                   f"{indexed!r:.80}.")
    return Pipeline(FileNamesSource(names), (TarShardRead(counts),))
