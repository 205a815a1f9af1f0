"""TFRecord files, byte-compatible with TensorFlow's both ways.

A record is ``uint64 length | uint32 masked_crc32c(length) | data | uint32
masked_crc32c(data)``, little-endian. "GZIP" and "ZLIB" files are the same stream
through zlib with TF's settings (default level, 15-bit window, memLevel 9), so for
the same records a ``TFRecordWriter`` writes the bytes ``tf.io.TFRecordWriter`` writes.

Reading checks both CRCs. Unlike TF, which ends a file quietly when it stops inside
a record's 12-byte header, any damage or truncation raises ``DataLossError`` naming
the file and the record's byte offset (in the decompressed stream for GZIP/ZLIB),
after every record before it was delivered.

An index (``TFRecordWriter(..., index=True)``, or ``write_index`` for a file written
elsewhere) is the text index of DALI's ``tfrecord2idx`` and the ``tfrecord`` package: one line
per record, ``"<byte offset> <record bytes>"`` (decimal; the record's bytes include its 16
bytes of framing), in file order. It lets a reader start at a record (``TFRecordReader(...,
start=offset)``) and ``TFRecordDataset(..., index_filenames=...)`` split a file into blocks
of records. Only uncompressed files have one (offsets in a GZIP/ZLIB stream cannot be sought).
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import numpy as np

from clusterwire.data.crc32c import masked
from clusterwire.data.filesystems import open_readable
from clusterwire.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)

#: TF's default read buffer of TFRecordDataset (buffer_size=None), in bytes.
DEFAULT_BUFFER_SIZE = 256 * 1024
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
# zlib's window bits for each compression type (16 + 15: a gzip wrapper).
_WBITS = {"ZLIB": 15, "GZIP": 16 + 15}
_MEM_LEVEL = 9  # TF's ZlibCompressionOptions; zlib's own default is 8
_FEED = 64 * 1024  # compressed bytes given to zlib per call, and the least asked back


def _compression(compression_type: str | None) -> str | None:
    if compression_type in (None, ""):
        return None
    if compression_type in _WBITS:
        return compression_type
    raise InvalidArgumentError(
        f"compression_type={compression_type!r} is not supported: use None (or ''), "
        "'GZIP' or 'ZLIB'")


def _open(path: str | os.PathLike, mode: str, buffering: int,
          readable_prefixes: Iterable[str] | None = None) -> BinaryIO:
    """``path`` opened for writing, or for reading through ``open_readable``: read
    ``buffering`` bytes at a time (0: unbuffered), from a local file or an fsspec file."""
    if mode == "rb":
        file = open_readable(path, readable_prefixes)
        raw = file.detach() if isinstance(file, io.BufferedReader) else file
        return io.BufferedReader(raw, buffering) if buffering else raw  # type: ignore[arg-type]
    try:
        return open(path, mode, buffering=buffering)
    except FileNotFoundError:
        raise NotFoundError(f"TFRecord file {os.fspath(path)!r} not found") from None
    except PermissionError:
        raise PermissionDeniedError(
            f"TFRecord file {os.fspath(path)!r}: permission denied") from None
    except IsADirectoryError:
        raise FailedPreconditionError(
            f"TFRecord path {os.fspath(path)!r} is a directory, not a file") from None


def open_raw(path: str | os.PathLike, readable_prefixes: Iterable[str] | None = None
             ) -> BinaryIO:
    """``path`` opened unbuffered for reading through ``open_readable`` (exact reads at
    offsets, as random access makes)."""
    return _open(path, "rb", 0, readable_prefixes)


def encode_record(data: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
    """The framing of one record: (12-byte header, 4-byte footer) around ``data``."""
    length = _LENGTH.pack(memoryview(data).nbytes)
    return length + _FOOTER.pack(masked(length)), _FOOTER.pack(masked(data))


class TFRecordWriter:
    """Writes a TFRecord file that ``tf.data.TFRecordDataset`` reads.

    A context manager, as ``tf.io.TFRecordWriter``; the file is created (or
    truncated) at once. ``compression_type`` is None, "GZIP" or "ZLIB". ``index=True``
    also writes the file's index to ``index_path(path)`` (uncompressed files only).
    """

    def __init__(self, path: str | os.PathLike, compression_type: str | None = None, *,
                 index: bool = False):
        self._compression = _compression(compression_type)
        self._path = os.fspath(path)
        if index and self._compression is not None:
            raise InvalidArgumentError(
                f"TFRecordWriter({self._path!r}, {compression_type!r}, index=True): only an "
                "uncompressed file has an index (a compressed stream cannot be sought).")
        self._file: BinaryIO | None = _open(path, "wb", DEFAULT_BUFFER_SIZE)
        self._index: BinaryIO | None = (
            _open(index_path(path), "wb", DEFAULT_BUFFER_SIZE) if index else None)
        self._offset = 0
        self._deflate = (None if self._compression is None else zlib.compressobj(
            zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, _WBITS[self._compression], _MEM_LEVEL))

    def _open_file(self) -> BinaryIO:
        if self._file is None:
            raise FailedPreconditionError(f"TFRecordWriter for {self._path!r} is closed")
        return self._file

    def _emit(self, data: bytes | bytearray | memoryview) -> None:
        file = self._open_file()
        file.write(data if self._deflate is None else self._deflate.compress(data))

    def write(self, record: bytes | bytearray | memoryview) -> None:
        """Appends one record (any bytes-like value)."""
        try:
            header, footer = encode_record(record)
        except TypeError:
            raise InvalidArgumentError(
                f"a TFRecord record is bytes, not {type(record).__name__} (encode a str "
                "first)") from None
        self._emit(header)
        self._emit(record)
        self._emit(footer)
        size = len(header) + len(footer) + memoryview(record).nbytes
        if self._index is not None:
            self._index.write(b"%d %d\n" % (self._offset, size))
        self._offset += size

    def flush(self) -> None:
        """Pushes what was written so far to the file (a partial flush of the compressor, as TF)."""
        file = self._open_file()
        if self._deflate is not None:
            file.write(self._deflate.flush(zlib.Z_PARTIAL_FLUSH))
        file.flush()

    def close(self) -> None:
        """Finishes the compressed stream, if any, and closes the file; idempotent."""
        if self._file is None:
            return
        try:
            if self._deflate is not None:
                self._file.write(self._deflate.flush(zlib.Z_FINISH))
        finally:
            self._file.close()
            self._file = None
            if self._index is not None:
                self._index.close()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def index_path(path: str | os.PathLike) -> str:
    """Where ``TFRecordWriter(path, index=True)`` writes the index: ``path + ".idx"``."""
    return os.fspath(path) + ".idx"


def write_index(path: str | os.PathLike, index: str | os.PathLike | None = None) -> str:
    """Writes the index of the uncompressed TFRecord file ``path`` (reading it whole, CRCs
    checked) to ``index`` (None: ``index_path(path)``), as DALI's ``tfrecord2idx``; returns
    the index's path."""
    target = index_path(path) if index is None else os.fspath(index)
    with TFRecordReader(path, buffer_size=None) as reader, \
            _open(target, "wb", DEFAULT_BUFFER_SIZE) as out:
        offset = 0
        for _ in reader:
            out.write(b"%d %d\n" % (offset, reader.offset - offset))
            offset = reader.offset
    return target


def read_index(index: str | os.PathLike, *, readable_prefixes: Iterable[str] | None = None
               ) -> np.ndarray:
    """The ``(offset, bytes)`` rows (an int64 array of shape (records, 2)) of a TFRecord
    index; InvalidArgumentError naming the index and line if it is not one (a line not two
    numbers, or records that do not follow each other from offset 0)."""
    with open_readable(index, readable_prefixes) as file:
        text = file.read()
    rows = _parse_index(text)
    return _parse_index_lines(os.fspath(index), text) if rows is None else rows


_INDEX_BYTES = b"0123456789 \t\r\n"


def _parse_index(text: bytes) -> np.ndarray | None:
    """The rows of a well-formed index, in numpy passes over its bytes; None if a line is
    not two numbers or the records do not follow each other (``_parse_index_lines`` then
    names the line)."""
    if text.translate(None, _INDEX_BYTES):
        return None
    chars = np.frombuffer(text, np.uint8)
    digit = (chars >= ord("0")) & (chars <= ord("9"))
    starts = np.flatnonzero(digit & ~np.concatenate(([False], digit[:-1])))
    newlines = np.flatnonzero(chars == ord("\n"))
    fields = np.bincount(np.searchsorted(newlines, starts), minlength=len(newlines) + 1)
    if fields[-1] == 0:  # what follows the last line end is blank
        fields = fields[:-1]
    if np.any(fields != 2):
        return None
    rows = np.fromstring(text, dtype=np.int64, sep=" ").reshape(-1, 2) if len(fields) else \
        np.zeros((0, 2), dtype=np.int64)
    if len(rows) != len(fields) or np.any(rows[:, 1] < _HEADER.size + _FOOTER.size) or (
            len(rows) and (rows[0, 0] != 0 or np.any(rows[1:, 0] != rows[:-1].sum(axis=1)))):
        return None
    return rows


def _parse_index_lines(name: str, text: bytes) -> np.ndarray:
    """``_parse_index`` line by line, naming the first line that is not a record's."""
    lines = text.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()
    rows = np.zeros((len(lines), 2), dtype=np.int64)
    expected = 0
    for number, line in enumerate(lines):
        fields = line.split()
        if len(fields) != 2 or not all(f.isdigit() for f in fields) or \
                int(fields[0]) != expected or int(fields[1]) < 16:
            raise InvalidArgumentError(
                f"TFRecord index {name!r}, line {number + 1} ({line[:40]!r}): not "
                f"'<offset> <bytes>' of the record at byte {expected}. Write the index again "
                "(clusterwire.data.tfrecord.write_index).")
        rows[number] = int(fields[0]), int(fields[1])
        expected = int(fields[0]) + int(fields[1])
    return rows


def record_data(path: str, offset: int, frame: bytes | memoryview) -> bytes:
    """The data of the record framed by ``frame`` (header, data and footer: the bytes its
    index gives it) at byte ``offset`` of ``path``, both CRCs checked; DataLossError naming
    the file and offset if it is damaged or is not one record of exactly those bytes."""
    def damaged(what: str) -> DataLossError:
        return DataLossError(f"TFRecord file {path!r}: {what} in the record at byte offset "
                             f"{offset}")
    size = len(frame)
    if size < _HEADER.size + _FOOTER.size:
        raise damaged(f"truncated record ({size} bytes read of at least 16)")
    length, length_crc = _HEADER.unpack_from(frame)
    if masked(frame[:8]) != length_crc:
        raise damaged("corrupt length (CRC-32C mismatch)")
    if length + _HEADER.size + _FOOTER.size != size:
        raise damaged(f"a record of {length} + 16 bytes where its index says {size} bytes (is "
                      "the index this file's?)")
    data = bytes(frame[_HEADER.size:_HEADER.size + length])
    if masked(data) != _FOOTER.unpack_from(frame, _HEADER.size + length)[0]:
        raise damaged("corrupt data (CRC-32C mismatch)")
    return data


def _size(file: BinaryIO) -> int:
    """The bytes in ``file``, at its start: an fsspec file's ``size`` (also under a
    BufferedReader), a local file's, or where seeking to the end puts it."""
    size = getattr(getattr(file, "raw", file), "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(file.fileno()).st_size
    except (OSError, ValueError, io.UnsupportedOperation):
        size = file.seek(0, io.SEEK_END)
        file.seek(0)
        return size


class _PlainSource:
    """Exact reads from an uncompressed file, ``chunk`` bytes read at a time for small reads
    (0: each read as asked). A read of ``chunk`` bytes or more that the buffer does not
    start goes straight from the file into its own bytes, and the read after it fills the
    buffer with just a footer and the next header: large records are read with no copy, as
    many at once as there are threads reading (a copy out of the buffer would hold the GIL)."""

    def __init__(self, file: BinaryIO, chunk: int, start: int = 0):
        self._file = file
        self._chunk = chunk
        self._unread = _size(file) - start  # bytes of the file not yet returned by read
        self._unfetched = self._unread  # bytes of the file not yet read from it
        self._buffer = b""
        self._pos = 0  # bytes of _buffer already returned
        self._after_large = False  # the last read from the file was a large one
        if start:
            file.seek(start)

    def remaining(self) -> int | None:
        """Bytes left in the file."""
        return self._unread

    def _read_file(self, n: int) -> bytes:
        n = min(n, self._unfetched)
        data = self._file.read(n) if n else b""
        while len(data) < n:  # an unbuffered read may come back short
            more = self._file.read(n - len(data))
            if not more:
                break
            data += more
        self._unfetched -= len(data)
        return data

    def read(self, n: int) -> bytes:
        buffered = len(self._buffer) - self._pos
        if n <= buffered:
            data = self._buffer[self._pos:self._pos + n]
            self._pos += n
        elif n - buffered >= self._chunk:
            data = self._read_file(n - buffered)
            if buffered:
                data = self._buffer[self._pos:] + data
            self._buffer, self._pos, self._after_large = b"", 0, True
        else:
            head = self._buffer[self._pos:]
            refill = _HEADER.size + _FOOTER.size if self._after_large else self._chunk
            self._buffer = self._read_file(max(refill, n - buffered))
            self._pos = min(n - buffered, len(self._buffer))
            self._after_large = False
            data = head + self._buffer[:self._pos] if head else self._buffer[:self._pos]
        self._unread -= len(data)
        return data


class _InflatingSource:
    """Exact reads from a zlib or gzip stream, ``buffer_size`` compressed bytes at a time.

    zlib is fed at most _FEED compressed bytes per call and asked for at most what the
    read still needs (or _FEED): the memory one call can take stays bounded whatever the
    compression ratio, and a record comes out of zlib as one bytes object.
    """

    def __init__(self, file: BinaryIO, compression: str, buffer_size: int, path: str):
        self._file = file
        self._wbits = _WBITS[compression]
        self._gzip = compression == "GZIP"
        self._chunk = buffer_size or DEFAULT_BUFFER_SIZE
        self._path = path
        self._inflate = zlib.decompressobj(self._wbits)
        self._input = memoryview(b"")  # compressed bytes read but not yet given to zlib
        self._parts: list[bytes] = []  # decompressed bytes not yet consumed, in order
        self._skip = 0  # bytes of _parts[0] already consumed
        self._buffered = 0  # decompressed bytes in _parts beyond _skip
        self._produced = 0  # decompressed bytes zlib gave so far
        self._ended = False  # the file is exhausted and its last stream complete

    def remaining(self) -> int | None:
        return None  # unknown before inflating

    def _error(self, what: str) -> DataLossError:
        return DataLossError(
            f"TFRecord file {self._path!r}: {what} (at decompressed offset {self._produced})")

    def _add(self, data: bytes) -> None:
        if data:
            self._parts.append(data)
            self._buffered += len(data)
            self._produced += len(data)

    def _fill(self, want: int) -> None:
        while self._buffered < want and not self._ended:
            if not self._input:
                self._input = memoryview(self._file.read(self._chunk))
            if not self._input:
                try:
                    self._add(self._inflate.flush())  # what zlib still holds
                except zlib.error as error:
                    raise self._error(f"the compressed stream is corrupt: {error}") from None
                if not self._inflate.eof:
                    raise self._error("the compressed stream is truncated: the file ends "
                                      "before the stream's end marker")
                self._ended = True
                return
            if self._inflate.eof:  # another gzip member follows, as `cat a.gz b.gz` makes
                if not self._gzip:
                    raise self._error("bytes follow the end of the ZLIB stream")
                self._inflate = zlib.decompressobj(self._wbits)
            feed = self._input[:_FEED]
            try:
                self._add(self._inflate.decompress(feed, max(want - self._buffered, _FEED)))
            except zlib.error as error:
                raise self._error(f"the compressed stream is corrupt: {error}") from None
            # At the stream's end CPython may leave the same leftover in both attributes.
            left = len(self._inflate.unused_data if self._inflate.eof
                       else self._inflate.unconsumed_tail)
            self._input = self._input[len(feed) - left:]

    def read(self, n: int) -> bytes:
        self._fill(n)
        n = min(n, self._buffered)
        if n == 0:
            return b""
        first = self._parts[0]
        if self._skip == 0 and len(first) == n:  # zlib's own bytes object, no copy
            self._parts.pop(0)
            self._buffered -= n
            return first
        pieces = []
        needed = n
        while needed:
            part = self._parts[0]
            take = min(needed, len(part) - self._skip)
            pieces.append(part[self._skip:self._skip + take])
            needed -= take
            self._skip += take
            if self._skip == len(part):
                self._parts.pop(0)
                self._skip = 0
        self._buffered -= n
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class TFRecordReader:
    """Iterates the records (bytes) of one TFRecord file, checking both CRCs of each.

    ``compression_type`` is None, "GZIP" or "ZLIB"; ``buffer_size`` is the bytes read
    from the file at a time (None: TF's 256 KiB; 0: unbuffered reads of exactly what
    each record needs, for plain files). ``start`` is the byte offset of the first record
    read (an uncompressed file's, from its index). ``offset`` is the byte offset of the next
    record. ``path`` is a local path or an fsspec URL, opened through
    ``filesystems.open_readable`` with ``readable_prefixes`` (None: the caller's own reads,
    unchecked; a worker passes its readable_dirs). A context manager; iterating to the end
    closes the file.
    """

    def __init__(self, path: str | os.PathLike, compression_type: str | None = None,
                 buffer_size: int | None = None, *, start: int = 0,
                 readable_prefixes: Iterable[str] | None = None):
        compression = _compression(compression_type)
        if start and compression is not None:
            raise InvalidArgumentError(
                f"TFRecord file {os.fspath(path)!r}: start={start} needs an uncompressed file "
                "(a compressed stream cannot be sought).")
        if buffer_size is None:
            buffer_size = DEFAULT_BUFFER_SIZE
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 0:
            raise InvalidArgumentError(
                f"buffer_size={buffer_size!r}: give a number of bytes >= 0, or None for "
                f"{DEFAULT_BUFFER_SIZE}")
        self._path = os.fspath(path)
        # Both sources read buffer_size bytes at a time themselves.
        self._file = _open(path, "rb", 0, readable_prefixes)
        if compression is None:
            self._source: _PlainSource | _InflatingSource = _PlainSource(
                self._file, buffer_size, start)
        else:
            self._source = _InflatingSource(self._file, compression, buffer_size, self._path)
        self.offset = start
        self._error: DataLossError | None = None

    def _damaged(self, what: str) -> DataLossError:
        hint = "" if self.offset else " (is this a TFRecord file, with the right compression_type?)"
        return DataLossError(
            f"TFRecord file {self._path!r}: {what} in the record at byte offset "
            f"{self.offset}{hint}")

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self._error is not None:  # nothing after damage is read, nor skipped silently
            raise self._error
        if self._file.closed:
            raise StopIteration
        try:
            return self._next_record()
        except DataLossError as error:
            self._error = error
            self.close()
            raise

    def _next_record(self) -> bytes:
        header = self._source.read(_HEADER.size)
        if not header:
            self.close()
            raise StopIteration
        if len(header) < _HEADER.size:
            raise self._damaged(f"truncated header ({len(header)} of {_HEADER.size} bytes)")
        length, length_crc = _HEADER.unpack(header)
        if masked(header[:8]) != length_crc:
            raise self._damaged("corrupt length (CRC-32C mismatch)")
        remaining = self._source.remaining()
        if remaining is not None and length + _FOOTER.size > remaining:
            raise self._damaged(
                f"truncated data ({length} + 4 bytes announced, {remaining} left in the file)")
        data = self._source.read(length)
        footer = self._source.read(_FOOTER.size) if len(data) == length else b""
        if len(footer) < _FOOTER.size:
            raise self._damaged(
                f"truncated data ({length} + 4 bytes announced, {len(data) + len(footer)} read)")
        if masked(data) != _FOOTER.unpack(footer)[0]:
            raise self._damaged("corrupt data (CRC-32C mismatch)")
        self.offset += _HEADER.size + length + _FOOTER.size
        return data

    def close(self) -> None:
        """Closes the file; idempotent."""
        self._file.close()

    def __enter__(self) -> TFRecordReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
