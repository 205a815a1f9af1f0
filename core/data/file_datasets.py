"""Datasets read from files: ``TFRecordDataset``, ``Dataset.list_files``,
``Dataset.from_parquet`` and ``Dataset.from_tar_shards``.

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

from clusterwire.data.dataset import Dataset
from clusterwire.data.filesystems import is_url
from clusterwire.data.ops.formats import (
    FileNamesSource,
    ParquetRead,
    RowGroupsSource,
    TarShardRead,
    TFRecordRead,
    names_array,
)
from clusterwire.errors import FailedPreconditionError, InvalidArgumentError


def TFRecordDataset(filenames: Any, compression_type: str | None = None,  # noqa: N802 - TF's name
                    buffer_size: int | None = None,
                    num_parallel_reads: int | None = None) -> Dataset:
    """The records (bytes) of TFRecord files, as ``tf.data.TFRecordDataset``.

    ``filenames``: a file name, a list of them, or a Dataset of names (``list_files``'s).
    ``compression_type``: None (or ""), "GZIP" or "ZLIB". ``buffer_size``: bytes read at a
    time (None: 256 KiB). ``num_parallel_reads``: None reads the files one after the other;
    N (or AUTOTUNE) reads N at once, interleaving their records one at a time in TF's order.
    A damaged record is DataLossError naming the file and offset, where the consumer reads.
    """
    read = TFRecordRead(compression_type, buffer_size, num_parallel_reads)
    if isinstance(filenames, Dataset):
        return filenames._with(read)
    return Dataset(FileNamesSource(names_array(filenames, "TFRecordDataset")), (read,))


def list_files(file_pattern: str | os.PathLike | list, shuffle: bool | None = None,
               seed: int | None = None) -> Dataset:
    """The file names (bytes) matching ``file_pattern`` (a glob, or a list of globs; local
    or an fsspec URL), sorted, then shuffled unless ``shuffle=False`` (a new order each
    epoch, fixed by ``seed``), as ``tf.data.Dataset.list_files``. No match is
    InvalidArgumentError naming the pattern."""
    patterns = [file_pattern] if isinstance(file_pattern, (str, bytes, os.PathLike)) \
        else list(file_pattern)
    names = sorted({name for pattern in patterns for name in _glob(os.fsdecode(pattern))})
    if not names:
        raise InvalidArgumentError(
            f"No files matched pattern: {', '.join(os.fsdecode(p) for p in patterns)}")
    dataset = Dataset(FileNamesSource(names_array(names, "list_files")))
    return dataset if shuffle is False else dataset.shuffle(len(names), seed=seed)


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
                 batch_rows: int | None = None) -> Dataset:
    """The rows of Parquet files (see ``clusterwire.data.parquet``): dicts column -> value,
    or with ``batch_rows`` column -> array of up to that many rows of one row group. The
    files' footers are read here to list their row groups, the splits of distributed_epoch."""
    from clusterwire.data.parquet import plan_row_groups

    names = [name.decode() for name in names_array(paths, "from_parquet")]
    read = ParquetRead(columns, batch_rows)
    plan = plan_row_groups(names, readable_prefixes=None)
    files = [np.full(info.row_groups, info.path.encode(), dtype=object) for info in plan.files]
    groups = [np.arange(info.row_groups, dtype=np.int64) for info in plan.files]
    pairs = (np.concatenate(files).astype(bytes), np.concatenate(groups))
    return Dataset(RowGroupsSource(pairs), (read,))


def from_tar_shards(paths: Any) -> Dataset:
    """The samples of WebDataset tar shards (``TarShardReader``'s dicts ``{ext: bytes,
    "__key__": key}``), shard after shard; a shard is a split of distributed_epoch."""
    return Dataset(FileNamesSource(names_array(paths, "from_tar_shards")), (TarShardRead(),))
