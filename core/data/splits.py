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
"""

from __future__ import annotations

from dataclasses import dataclass

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


def provider(kind: str) -> SplitProvider:
    """The split provider of source kind ``kind`` (see the module docstring)."""
    return PROVIDERS[kind]


def record_blocks(offsets: np.ndarray, block_bytes: int = RECORD_BLOCK_BYTES) -> np.ndarray:
    """The first record of each block of a file whose records start at byte ``offsets``
    (its index's): a block holds the records starting in one ``block_bytes``-aligned range
    of the file, so at least one record, about ``block_bytes`` (an int64 array)."""
    window = offsets // block_bytes
    return np.flatnonzero(np.diff(window, prepend=-1)).astype(np.int64)
