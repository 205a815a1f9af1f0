"""The dispatcher's journal: an append-only file of fsync'd, checksummed records.

Record layout: ``length u32 | crc32(length) u32 | crc32(body) u32 | body``
(little endian; the body is a JournalEntry). The length has its own checksum
so a damaged length is told apart from a record cut short. ``append``
returns only after the record is on disk, and the dispatcher answers a
request only after journaling what it decided, so whatever a client or
worker was told survives a crash.

Reading back: a last record cut short (the dispatcher died while writing
it, so nobody was told about it) is reported and cut off; a record whose
checksum does not match is corruption: ``DataLossError`` naming the file and
offset, never a silent replay of whatever is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from clusterwire.buffers import split
from clusterwire.errors import DataLossError
from clusterwire.protos.data_service_pb2 import JournalEntry

_HEAD = struct.Struct("<III")
_LENGTH = struct.Struct("<I")
_MAX_RECORD = 256 << 20
JOURNAL_DIR = "tf_data_dispatcher_journal"
JOURNAL_FILE = "journal.log"

log = logging.getLogger(__name__)


@dataclass
class ReadReport:
    """What reading the journal found: the entries and any cut-off tail."""

    entries: list[JournalEntry]
    truncated_bytes: int = 0
    message: str = ""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _records(data: bytes, path: str) -> Iterator[tuple[int, JournalEntry | None]]:
    """(offset, entry) per record; entry None for a cut-short tail at that offset."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < _HEAD.size:
            yield offset, None
            return
        length, length_crc, crc = _HEAD.unpack_from(data, offset)
        body = data[offset + _HEAD.size:offset + _HEAD.size + length]
        if length > _MAX_RECORD or zlib.crc32(_LENGTH.pack(length)) != length_crc:
            raise DataLossError(
                f"Journal {path} is corrupt at byte {offset}: record length {length} is "
                "damaged. Refusing to replay it; move the work_dir aside to start afresh.")
        if len(body) < length:
            yield offset, None
            return
        if zlib.crc32(body) != crc:
            raise DataLossError(
                f"Journal {path} is corrupt at byte {offset}: checksum mismatch. Refusing to "
                "replay it; move the work_dir aside to start afresh.")
        try:
            yield offset, JournalEntry.FromString(body)
        except DecodeError as err:
            raise DataLossError(
                f"Journal {path} is corrupt at byte {offset}: {err}.") from None
        offset += _HEAD.size + length


def _encode(entries) -> bytes:
    return b"".join(
        _HEAD.pack(len(body), zlib.crc32(_LENGTH.pack(len(body))), zlib.crc32(body)) + body
        for body in (e.SerializeToString() for e in entries))


class Journal:
    """The journal of one work_dir; ``read()`` once, then ``append`` entries."""

    def __init__(self, work_dir: str):
        self.directory = os.path.join(work_dir, JOURNAL_DIR)
        self.path = os.path.join(self.directory, JOURNAL_FILE)
        self._lock = threading.Lock()
        self._file = None

    def read(self) -> ReadReport:
        """Every complete entry; a cut-short tail is reported, logged and removed."""
        os.makedirs(self.directory, exist_ok=True)
        try:
            with open(self.path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            data = b""
        report = ReadReport([])
        for offset, entry in _records(data, self.path):
            if entry is None:
                report.truncated_bytes = len(data) - offset
                report.message = (
                    f"Journal {self.path}: the last record (byte {offset}, "
                    f"{report.truncated_bytes} bytes) was cut short, a write interrupted by a "
                    "crash; it was never acknowledged and is dropped.")
                log.warning(report.message)
                with open(self.path, "r+b") as handle:
                    handle.truncate(offset)
                    os.fsync(handle.fileno())
                break
            report.entries.append(entry)
        return report

    def append(self, *entries: JournalEntry) -> None:
        """Write ``entries`` and fsync before returning."""
        data = _encode(entries)
        with self._lock:
            if self._file is None:
                created = not os.path.exists(self.path)
                self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for appends
                if created:
                    _fsync_dir(self.directory)
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())

    def rewrite(self, entries: list[JournalEntry]) -> None:
        """Replace the journal by ``entries`` (a snapshot of the state), atomically: a crash
        leaves either the old journal or the new one."""
        temporary = self.path + ".tmp"
        with self._lock:
            with open(temporary, "wb") as handle:
                handle.write(_encode(entries))
                handle.flush()
                os.fsync(handle.fileno())
            if self._file is not None:
                self._file.close()
            os.replace(temporary, self.path)
            _fsync_dir(self.directory)
            self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for appends

    def nbytes(self) -> int:
        """The journal's size on disk."""
        try:
            return os.path.getsize(self.path)
        except FileNotFoundError:
            return 0

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _payload_path(work_dir: str, dataset_id: str) -> str:
    # Dataset ids are arbitrary strings; a digest makes a safe file name.
    name = hashlib.sha256(dataset_id.encode()).hexdigest()[:32]
    return os.path.join(work_dir, "datasets", f"{name}.bin")


def write_payload(work_dir: str, dataset_id: str, buffers: list) -> list[int]:
    """Store a dataset's payload buffers durably in ``work_dir/datasets``; their lengths."""
    directory = os.path.join(work_dir, "datasets")
    os.makedirs(directory, exist_ok=True)
    path = _payload_path(work_dir, dataset_id)
    temporary = path + ".tmp"
    with open(temporary, "wb") as handle:
        for buffer in buffers:
            handle.write(memoryview(buffer).cast("B"))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_dir(directory)
    return [memoryview(b).nbytes for b in buffers]


def remove_payload(work_dir: str, dataset_id: str) -> None:
    """Delete a collected dataset's payload file (once no journal record names it)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(_payload_path(work_dir, dataset_id))


def read_payload(work_dir: str, dataset_id: str, lengths: list[int]) -> list[bytes]:
    """The payload buffers ``write_payload`` stored; DataLossError if missing or short."""
    path = _payload_path(work_dir, dataset_id)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise DataLossError(f"Dataset payload {path} named by the journal is missing.") from None
    if len(data) != sum(lengths):
        raise DataLossError(f"Dataset payload {path} has {len(data)} bytes; the journal says "
                            f"{sum(lengths)}.")
    return split(data, lengths)
