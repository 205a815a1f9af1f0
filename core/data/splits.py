"""Split providers: how processing_mode='distributed_epoch' cuts each kind of source into
splits, in one place (TF's ``SplitProvider``: a provider per source kind).

A source has units (``Source.units()``: range items, tensor slices, files, row groups...)
and names its kind (``Source.split_kind``); the dispatcher hands out splits of
``units_per_split`` consecutive units, and a worker reads a split as ``source.read(start,
end)``. The kinds:

- ``"elements"`` (``range``, ``from_tensor_slices``, ``global_shuffle``):
  about ``SPLITS_PER_WORKER`` splits per live worker, at most ``MAX_SPLIT_UNITS`` units each,
  rounded up to a multiple of a leading ``batch``'s size (so batches do not straddle splits);
- ``"file"`` (``list_files``, ``TFRecordDataset`` of names, ``from_tar_shards``,
  ``from_files``): one file per split, TF's FILE sharding (a tar shard is a file);
- ``"row_group"`` (``from_parquet``): one Parquet row group per split;
- ``"record_block"`` (``TFRecordDataset`` with ``index_filenames``): one block of consecutive
  records of one file per split, cut by ``record_blocks`` (about ``RECORD_BLOCK_BYTES``).

The kinds but ``"elements"`` read files: static ``ShardingPolicy.FILE`` (and ``FILE_OR_DATA``)
gives worker ``k`` of ``n`` the files ``i`` with ``i % n == k`` of its source, as TF's FILE
auto-sharding does at the source of file names (before ``list_files``' shuffle, which then
shuffles each worker's files): ``file_shard``. A file's row groups or record blocks go with it;
a file with none (an empty one) holds no units and is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SPLITS_PER_WORKER = 8
MAX_SPLIT_UNITS = 4096
#: The bytes of records a block of an indexed TFRecord file holds (at least one record).
RECORD_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class SplitProvider:
    """How many source units one split holds, for a source kind."""

    kind: str
    one_unit: bool  # a split is exactly one unit (a file, a row group, a record block)

    def units_per_split(self, units: int, workers: int, align: int) -> int:
        """Units per split of a source of ``units`` units read by ``workers`` live workers,
        a split's size a multiple of ``align`` (a leading batch's size) where units are
        elements."""
        if self.one_unit:
            return 1
        size = min(max(1, -(-units // (max(1, workers) * SPLITS_PER_WORKER))), MAX_SPLIT_UNITS)
        return -(-size // align) * align


PROVIDERS = {kind: SplitProvider(kind, kind != "elements")
             for kind in ("elements", "file", "row_group", "record_block")}
#: The source kinds whose units are files or parts of one (what FILE sharding can shard).
FILE_KINDS = frozenset({"file", "row_group", "record_block"})


def provider(kind: str) -> SplitProvider:
    """The split provider of source kind ``kind`` (see the module docstring)."""
    return PROVIDERS[kind]


def record_blocks(offsets: np.ndarray, block_bytes: int = RECORD_BLOCK_BYTES) -> np.ndarray:
    """The first record of each block of a file whose records start at byte ``offsets``
    (its index's): a block holds the records starting in one ``block_bytes``-aligned range
    of the file, so at least one record, about ``block_bytes`` (an int64 array)."""
    window = offsets // block_bytes
    return np.flatnonzero(np.diff(window, prepend=-1)).astype(np.int64)


def file_numbers(source: Any) -> np.ndarray | None:
    """The file (0, 1, ... in the source's order) each unit of ``source`` reads, or None if
    its units are not files or parts of one (an int64 array)."""
    kind = source.split_kind
    if kind == "file":
        return np.arange(source.units(), dtype=np.int64)
    if kind == "row_group":  # (names, row group, rows): a file's units start at group 0
        return np.cumsum(source.tensors[1] == 0, dtype=np.int64) - 1
    if kind == "record_block":  # (names, first offset, ...): a new name or a new file start
        names, starts = source.tensors[0], source.tensors[1]
        first = np.ones(len(names), dtype=bool)
        first[1:] = (names[1:] != names[:-1]) | (starts[1:] <= starts[:-1])
        return np.cumsum(first, dtype=np.int64) - 1
    return None


def file_shard(source: Any, index: int, count: int) -> Any:
    """``source`` restricted to the units of its files ``i`` with ``i % count == index``
    (static FILE sharding, see the module docstring); None if it does not read files."""
    numbers = file_numbers(source)
    if numbers is None:
        return None
    return source.select(np.flatnonzero(numbers % count == index))
