"""Tar shards in WebDataset's layout: members ``KEY.EXT``, a sample's members consecutive.

A shard (plain, or gzip/bz2/xz-compressed, its checksum checked) is read as a stream, so an
object store is read front to back. Each sample is a dict ``{ext: bytes, "__key__": key}``,
where, as WebDataset's ``base_plus_ext``, the key is the member's name up to the first dot of its
last path component and ``ext`` the rest, lower-cased (WebDataset's default ``lcase``);
``a/b/x.seg.PNG`` is key ``a/b/x``, ext ``seg.png``. Consecutive members with the same key
make one sample.

Where WebDataset skips a member silently, this reader raises, naming the shard and member,
so no data goes missing unnoticed; like WebDataset it skips directory entries (they hold no
bytes, and ``tar cf shard.tar folder/`` writes them) and top-level ``__name__`` metadata:

* a regular member without a key (no dot in its last component, or a name ending in a
  dot): InvalidArgumentError, the layout is wrong, not the bytes (after the sample before it,
  which it ends);
* the same ext twice in one sample: InvalidArgumentError (WebDataset's ValueError);
* a symlink, hard link, device or fifo: InvalidArgumentError, never followed;
* a member larger than ``MAX_MEMBER_BYTES``: ResourceExhaustedError, before it is read;
  so is a long-name or pax metadata member, which tarfile would read whole into memory;
* a truncated or corrupt shard, or one missing tar's end-of-archive block (tarfile itself
  would end quietly there): DataLossError, after every sample before the damaged one (the
  sample cut short is not delivered).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import os
import re
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from clusterwire.data.filesystems import open_readable
from clusterwire.errors import DataLossError, InvalidArgumentError, ResourceExhaustedError

#: A sample of an uncompressed shard: its key, and each member's (ext, byte offset, bytes).
SampleEntry = tuple[str, tuple[tuple[str, int, int], ...]]

#: The largest member a reader reads into memory, in bytes.
MAX_MEMBER_BYTES = 256 * 1024 * 1024

# Compressed shards by their first bytes. Python's own readers check the stream's checksum at
# its end (tarfile's stream mode inflates gzip without checking its CRC-32).
_COMPRESSED = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))
_DRAIN = 64 * 1024

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$", re.DOTALL)  # WebDataset's base_plus_ext


# Members whose data tarfile reads into memory as metadata (long names, pax records).
_METADATA_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                   tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


class _TooLarge(Exception):
    """A metadata member over MAX_MEMBER_BYTES, seen inside tarfile (which knows no shard)."""


class _Header(tarfile.TarInfo):
    """Remembers why tarfile stopped (it ends quietly on a truncated or invalid header) and
    bounds the metadata members tarfile reads whole before a member is handed out."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _METADATA_TYPES and self.size > MAX_MEMBER_BYTES:
            raise _TooLarge(f"a {self.size}-byte metadata member (tar type {self.type!r})")
        return super()._proc_member(tar)  # type: ignore[misc]

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.EOFHeaderError:
            tar.stop_reason = None  # type: ignore[attr-defined]  # the end-of-archive block
            raise
        except tarfile.HeaderError as error:
            tar.stop_reason = str(error) or type(error).__name__  # type: ignore[attr-defined]
            raise


def _decompressed(file: BinaryIO) -> BinaryIO:
    """``file``, or a reader of the compressed stream it holds (gzip, bz2, xz)."""
    head = file.read(6)
    file.seek(0)
    for magic, reader in _COMPRESSED:
        if head.startswith(magic):
            return reader(file, "rb")
    return file


def _split(name: str) -> tuple[str, str] | None:
    match = _KEY.match(name)
    if match is None or not match.group(2):
        return None
    return match.group(1), match.group(2).lower()


class TarShardReader:
    """The samples of one tar shard (see the module docstring); a context manager.

    ``readable_prefixes`` as for ``filesystems.open_readable`` (None: the caller's own
    reads, unchecked).
    """

    def __init__(self, path: str | os.PathLike, *, readable_prefixes: Iterable[str] | None):
        self._path = os.fspath(path)
        self._file = open_readable(path, readable_prefixes)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            with self._reading():
                yield from self._samples()
        finally:
            self.close()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """tarfile's and the decompressors' errors as clusterwire's, naming the shard."""
        try:
            yield
        except _TooLarge as error:
            raise ResourceExhaustedError(
                f"Tar shard {self._path!r}: {error} is over the {MAX_MEMBER_BYTES}-byte limit "
                "of one member (tar_shards.MAX_MEMBER_BYTES).") from None
        except (tarfile.ReadError, tarfile.CompressionError, EOFError, zlib.error,
                lzma.LZMAError, OSError) as error:
            raise DataLossError(
                f"Tar shard {self._path!r}: truncated, corrupt or unreadable ({error}); "
                "nothing after it was read.") from None

    def index(self) -> list[SampleEntry]:
        """Where each sample's members are in this uncompressed shard, from its headers only
        (the checks of iterating it apply); InvalidArgumentError for a compressed shard,
        which cannot be read by sample."""
        if _decompressed(self._file) is not self._file:
            raise InvalidArgumentError(
                f"Tar shard {self._path!r} is compressed: its samples cannot be read by "
                "number (global_shuffle). Give uncompressed shards.")
        entries: list[SampleEntry] = []
        key, members = None, []
        with self._reading(), tarfile.open(fileobj=self._file, mode="r:",
                                           tarinfo=_Header) as tar:
            while (member := tar.next()) is not None:
                split = self._check(member)
                if split is None:
                    continue
                if split[0] != key:
                    if key is not None:
                        entries.append((key, tuple(members)))
                    key, members = split[0], []
                self._check_size(member)
                if any(ext == split[1] for ext, _, _ in members):
                    raise InvalidArgumentError(
                        f"Tar shard {self._path!r}: member {member.name!r} repeats ext "
                        f"{split[1]!r} of sample {key!r}.")
                members.append((split[1], member.offset_data, member.size))
                tar.members.clear()  # headers are not kept: the entries are
            reason = getattr(tar, "stop_reason",
                             "the shard ends without tar's end-of-archive block")
            if reason is not None:
                raise tarfile.ReadError(f"{reason} at byte {tar.offset}")
        if key is not None:
            entries.append((key, tuple(members)))
        return entries

    def sample(self, entry: SampleEntry) -> dict[str, Any]:
        """The sample of an ``index()`` entry, its members read at their offsets."""
        key, members = entry
        sample: dict[str, Any] = {"__key__": key}
        for ext, offset, size in members:
            self._file.seek(offset)
            data = self._file.read(size)
            if len(data) != size:
                raise DataLossError(
                    f"Tar shard {self._path!r}: sample {key!r} is cut short at byte "
                    f"{offset + len(data)} (the shard changed since it was indexed?).")
            sample[ext] = data
        return sample

    def _check_size(self, member: tarfile.TarInfo) -> None:
        if member.size > MAX_MEMBER_BYTES:
            raise ResourceExhaustedError(
                f"Tar shard {self._path!r}: member {member.name!r} is {member.size} "
                f"bytes, over the {MAX_MEMBER_BYTES}-byte limit of one member "
                "(tar_shards.MAX_MEMBER_BYTES).")

    def _samples(self) -> Iterator[dict[str, Any]]:
        sample: dict[str, Any] | None = None
        stream = _decompressed(self._file)
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_Header) as tar:
            for member in tar:
                try:
                    split = self._check(member)
                except InvalidArgumentError:
                    if sample is not None and _split(member.name) is None:
                        yield sample  # complete: a member without a key is of no sample
                    raise
                if split is None:
                    continue
                key, ext = split
                if sample is not None and sample["__key__"] != key:
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": key}
                self._check_size(member)
                if ext in sample:
                    raise InvalidArgumentError(
                        f"Tar shard {self._path!r}: member {member.name!r} repeats ext {ext!r} "
                        f"of sample {key!r}.")
                data = tar.extractfile(member)
                assert data is not None  # a regular member
                sample[ext] = data.read()
            reason = getattr(tar, "stop_reason",
                             "the shard ends without tar's end-of-archive block")
            if reason is not None:  # the last sample may miss members: not delivered
                raise tarfile.ReadError(f"{reason} at byte {tar.offset}")
        if stream is not self._file:  # to the compressed stream's end: its checksum
            while stream.read(_DRAIN):
                pass
        if sample is not None:
            yield sample

    def _check(self, member: tarfile.TarInfo) -> tuple[str, str] | None:
        """(key, ext) of a regular member; None for one WebDataset skips; raises else."""
        name = member.name
        if member.isdir() or ("/" not in name and name.startswith("__")
                              and name.endswith("__")):
            return None
        if not member.isreg():
            raise InvalidArgumentError(
                f"Tar shard {self._path!r}: member {name!r} is not a regular file "
                f"(tar type {member.type!r}: a link, device or fifo); shards hold regular "
                "files only and links are never followed.")
        split = _split(name)
        if split is None:
            raise InvalidArgumentError(
                f"Tar shard {self._path!r}: member {name!r} has no key: WebDataset's layout "
                "names every member KEY.EXT (sample0001.jpg, sample0001.cls).")
        return split

    def close(self) -> None:
        """Closes the shard; idempotent."""
        self._file.close()

    def __enter__(self) -> TarShardReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_tar_shard(path: str | os.PathLike, *,
                   readable_prefixes: Iterable[str] | None) -> Iterator[dict[str, Any]]:
    """The samples of one shard, the shard closed at the end (a split of a tar dataset)."""
    with TarShardReader(path, readable_prefixes=readable_prefixes) as reader:
        yield from reader
