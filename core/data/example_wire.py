"""A batch of ``tf.train.Example`` records decoded in numpy, for ``parse_example``'s common case.

Records in the form protobuf's serializers (TF's among them) write them — each message's
fields once and in order, exact lengths, numeric lists packed in one chunk, ASCII keys,
each key once — are decoded a level at a time for the whole batch (Example, its map
entries, each entry's key and Feature, the requested lists): a handful of numpy passes per
level instead of protobuf objects per record and feature. Packed floats are one gather
and a ``<f4`` view; packed int64 varints are decoded with numpy over all the batch's bytes.

Anything else — unknown fields, a list split in chunks or unpacked, a repeated key, a
required feature missing, a kind or a count not matching the spec, a malformed length —
makes ``decode`` return None, and ``parse_example`` parses that batch with protobuf's
parser record by record, which words every error. A feature the spec does not ask for is
checked down to its Feature (one list of a known kind) but its list is not decoded, as
TF's own parser skips it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_LEN_1 = 0x0A  # field 1, length-delimited: Example.features, Features' entries, a key, a list
_LEN_2 = 0x12  # field 2, length-delimited: an entry's Feature
#: Feature's oneof fields (all length-delimited) by the tag that starts each.
KIND_TAGS = {"bytes_list": 0x0A, "float_list": 0x12, "int64_list": 0x1A}
_LENGTH_BYTES = 5  # a length's varint (lengths here are < 2**35)
_INT64_BYTES = 10  # an int64 value's varint


class _Other(Exception):
    """The batch is not in the common form: parse it record by record."""


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The indices of every ``[start, stop)`` range, one range after the other."""
    counts = stops - starts
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total)


def _concat(blob: bytes, buf: np.ndarray, starts: np.ndarray, stops: np.ndarray
            ) -> np.ndarray:
    """The bytes of every ``[start, stop)`` range, one after the other: rows of a sliding
    window when all have one size (a fixed feature's lists), else joined slices."""
    sizes = stops - starts
    if sizes.size and sizes[0] and (sizes == sizes[0]).all():
        return sliding_window_view(buf, int(sizes[0]))[starts].reshape(-1)
    return np.frombuffer(b"".join([blob[s:t] for s, t in zip(starts.tolist(), stops.tolist(),
                                                            strict=True)]), np.uint8)


def _lengths(buf: np.ndarray, pos: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, positions after them) of the length varints at ``pos``, each within ``end``."""
    if not pos.size:
        return pos, pos
    if (pos >= end).any():
        raise _Other
    first = buf[pos]
    if (first < 0x80).all():  # lengths under 128, one byte each
        if (pos + 1 > end).any():
            raise _Other
        return first.astype(np.int64), pos + 1
    raw = buf[np.minimum(pos[:, None] + np.arange(_LENGTH_BYTES), len(buf) - 1)]
    more = raw >= 0x80
    if more.all(axis=1).any():
        raise _Other
    size = np.argmin(more, axis=1) + 1
    after = pos + size
    if (after > end).any():
        raise _Other
    parts = (raw & 0x7F).astype(np.int64) << (7 * np.arange(_LENGTH_BYTES, dtype=np.int64))
    parts[np.arange(_LENGTH_BYTES) >= size[:, None]] = 0
    return parts.sum(axis=1), after


def _delimited(buf: np.ndarray, pos: np.ndarray, end: np.ndarray, tag: int | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(payload starts, stops) of the length-delimited fields at ``pos`` (``tag`` first,
    unless None: checked by the caller), each ending within ``end``."""
    if (pos >= end).any() or (tag is not None and (buf[pos] != tag).any()):
        raise _Other
    length, start = _lengths(buf, pos + 1, end)
    stop = start + length
    if (stop > end).any():
        raise _Other
    return start, stop


def _sequence(buf: np.ndarray, owners: np.ndarray, starts: np.ndarray, stops: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The field-1 length-delimited fields filling each ``[start, stop)`` region, in order:
    (owner, payload start, payload stop) of each, owners ascending."""
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    while True:
        active = starts < stops
        owners, starts, stops = owners[active], starts[active], stops[active]
        if not starts.size:
            break
        start, stop = _delimited(buf, starts, stops, _LEN_1)
        found.append((owners, start, stop))
        starts = stop
    if not found:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    owner, start, stop = (np.concatenate(parts) for parts in zip(*found, strict=True))
    order = np.argsort(owner, kind="stable")  # each region's fields stay in order
    return owner[order], start[order], stop[order]


def _packed(buf: np.ndarray, starts: np.ndarray, stops: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """(payload starts, stops) of lists that are empty or one packed chunk (field 1) filling
    their ``[start, stop)``; an empty list's payload is empty."""
    out_start, out_stop = starts.copy(), starts.copy()
    full = stops > starts
    start, stop = _delimited(buf, starts[full], stops[full], _LEN_1)
    if (stop != stops[full]).any():
        raise _Other
    out_start[full], out_stop[full] = start, stop
    return out_start, out_stop


def _floats(blob: bytes, buf: np.ndarray, starts: np.ndarray, stops: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """(values per list, all values in order) of packed float lists."""
    start, stop = _packed(buf, starts, stops)
    nbytes = stop - start
    if (nbytes % 4).any():
        raise _Other
    data = _concat(blob, buf, start, stop)
    return nbytes // 4, data.view("<f4").astype(np.float32, copy=False)


def _int64s(blob: bytes, buf: np.ndarray, starts: np.ndarray, stops: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """(values per list, all values in order) of packed int64 lists (varints)."""
    start, stop = _packed(buf, starts, stops)
    data = _concat(blob, buf, start, stop)
    bounds = np.cumsum(stop - start)  # where each list's bytes end in ``data``
    if (data[bounds[stop > start] - 1] >= 0x80).any():
        raise _Other  # a list must end on a varint's last byte: none spans two lists
    ends = np.flatnonzero(data < 0x80)  # each varint's last byte
    firsts = np.concatenate(([0], ends[:-1] + 1)) if ends.size else ends
    sizes = ends - firsts + 1
    if (sizes > _INT64_BYTES).any() or (data[ends[sizes == _INT64_BYTES]] > 1).any():
        raise _Other  # longer than an int64, or beyond 64 bits: protobuf's parser decides
    within = np.arange(data.size) - np.repeat(firsts, sizes)
    parts = (data & 0x7F).astype(np.uint64) << (7 * within).astype(np.uint64)
    values = np.bitwise_or.reduceat(parts, firsts) if ends.size else parts
    # A list's values: the varints whose last byte lies in its bytes.
    counts = np.diff(np.searchsorted(ends, bounds, side="left"), prepend=0)
    return counts, values.view(np.int64)


def _bytes(blob: bytes, buf: np.ndarray, starts: np.ndarray, stops: np.ndarray
           ) -> tuple[np.ndarray, list[bytes]]:
    """(values per list, all values in order) of bytes lists."""
    owner, start, stop = _sequence(buf, np.arange(starts.size), starts, stops)
    counts = np.bincount(owner, minlength=starts.size)
    return counts, [blob[s:t] for s, t in zip(start.tolist(), stop.tolist(), strict=True)]


def _values(kind: str, blob: bytes, buf: np.ndarray, starts: np.ndarray, stops: np.ndarray
            ) -> tuple[np.ndarray, Any]:
    if kind == "float_list":
        return _floats(blob, buf, starts, stops)
    if kind == "int64_list":
        return _int64s(blob, buf, starts, stops)
    return _bytes(blob, buf, starts, stops)


def decode(records: Sequence[Any], specs: Sequence[Any]) -> dict[str, Any] | None:
    """Each spec's values for a batch in the common form, else None (see the module
    docstring). ``specs``: example._Spec; a fixed feature gives an array ``[batch, size]``
    (defaults filled in), a var-length one ``(values per example, values)``."""
    try:
        blob = b"".join(records)
        lengths = np.fromiter(map(len, records), np.int64, len(records))
    except TypeError:
        return None
    if int(lengths.sum()) != len(blob):  # a memoryview of other than bytes
        return None
    buf = np.frombuffer(blob, np.uint8)
    ends = np.cumsum(lengths)
    try:
        return _decode(blob, buf, ends - lengths, ends, specs)
    except _Other:
        return None


def _decode(blob: bytes, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray,
            specs: Sequence[Any]) -> dict[str, Any]:
    batch = starts.size
    # Example: nothing, or its Features (field 1) filling the record.
    some = np.flatnonzero(ends > starts)
    features_start, features_stop = _delimited(buf, starts[some], ends[some], _LEN_1)
    if (features_stop != ends[some]).any():
        raise _Other
    # Features: its map entries; an entry: the key (field 1), then the Feature (field 2).
    record, entry_start, entry_stop = _sequence(buf, some, features_start, features_stop)
    key_start, key_stop = _delimited(buf, entry_start, entry_stop, _LEN_1)
    value_start, value_stop = _delimited(buf, key_stop, entry_stop, _LEN_2)
    if (value_stop != entry_stop).any() or (buf[_ranges(key_start, key_stop)] >= 0x80).any():
        raise _Other  # more fields, or a key protobuf must check as UTF-8
    # A Feature: empty (no kind: missing), or one list of a known kind filling it.
    tags = np.zeros(record.size, np.uint8)
    full = value_stop > value_start
    tags[full] = buf[value_start[full]]
    if not np.isin(tags[full], list(KIND_TAGS.values())).all():
        raise _Other
    list_start, list_stop = value_start.copy(), value_stop.copy()
    start, stop = _delimited(buf, value_start[full], value_stop[full], None)
    if (stop != value_stop[full]).any():
        raise _Other
    list_start[full], list_stop[full] = start, stop

    key_size = key_stop - key_start
    result: dict[str, Any] = {}
    for spec in specs:
        key = np.frombuffer(spec.key.encode(), np.uint8)
        match = np.flatnonzero(key_size == key.size)
        if key.size:
            same = buf[key_start[match][:, None] + np.arange(key.size)] == key
            match = match[same.all(axis=1)]
        if np.unique(record[match]).size != match.size:
            raise _Other  # a key given twice: protobuf's parser keeps the last
        match = match[tags[match] != 0]  # a Feature with no kind is missing
        if (tags[match] != KIND_TAGS[spec.kind]).any():
            raise _Other
        counts, values = _values(spec.kind, blob, buf, list_start[match], list_stop[match])
        result[spec.key] = (_fixed(spec, batch, record[match], counts, values) if spec.fixed
                            else _var(spec, batch, record[match], counts, values))
    return result


def _fixed(spec: Any, batch: int, rows: np.ndarray, counts: np.ndarray, values: Any
           ) -> np.ndarray:
    if (counts != spec.size).any() or (rows.size < batch and spec.default is None):
        raise _Other
    if spec.dtype == object:
        found = np.empty(len(values), dtype=object)
        found[:] = values
        values = found
    values = values.reshape(rows.size, spec.size)
    if rows.size == batch:  # every example has it (rows: ascending, each once)
        return values
    out = np.empty((batch, spec.size), dtype=spec.dtype)
    out[:] = spec.default.reshape(-1)
    out[rows] = values
    return out


def _var(spec: Any, batch: int, rows: np.ndarray, counts: np.ndarray, values: Any
         ) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.zeros(batch, np.int64)
    lengths[rows] = counts
    array = np.empty(len(values), dtype=spec.dtype)
    array[:] = values
    return lengths, array
