"""Sealed memfd segments: tensor bytes shared between processes without /dev/shm names.

A segment is an anonymous ``memfd`` (nothing ever appears in /dev/shm), filled
once and then sealed against writes, shrinking and growing, so a receiver may
map it and use it in place, and no side can change the other's data. The
kernel frees it when the last descriptor and mapping are gone, including when
a process is SIGKILLed.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import resource
import weakref
from typing import Any

import numpy as np

from clusterwire.errors import InvalidArgumentError

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def raise_fd_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit: every stored segment keeps one fd."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class SealedMapping(mmap.mmap):
    """A read-only mapping of a sealed segment that remembers its descriptor (for re-sending)."""

    #: Nobody can write a sealed segment: the core shares it instead of copying
    #: (``clusterwire.in_process.is_immutable``).
    clusterwire_immutable = True

    fd: int
    address: int  # where the mapping starts in this process's memory

    private: mmap.mmap | None = None  # the segment mapped again, copy-on-write

    def clusterwire_private_map(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of the segment in a private, writable
        (copy-on-write) mapping of it: writes stay in this process (see core's
        private_views). One mapping serves every buffer of the segment: they do not
        overlap, so a write to one never shows in another."""
        if self.private is None:
            self.private = mmap.mmap(self.fd, len(self), mmap.MAP_PRIVATE,
                                     mmap.PROT_READ | mmap.PROT_WRITE)
        return memoryview(self.private)[offset:offset + nbytes]


ALIGNMENT = 64


def packed_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of buffers packed one after another (64-byte aligned) and the total size."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGNMENT) * ALIGNMENT
    return offsets, end


def create_packed(views: list[memoryview]) -> tuple[int, list[int]]:
    """One new sealed segment holding copies of ``views``; (descriptor, offsets)."""
    offsets, total = packed_layout([view.nbytes for view in views])
    fd = os.memfd_create("clusterwire", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        for view, start in zip(views, offsets, strict=True):
            written = 0
            while written < view.nbytes:
                written += os.pwrite(fd, view[written:], start + written)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, offsets


def open_segment(fd: int) -> np.ndarray:
    """Map a received segment read-only as a uint8 array; takes ownership of ``fd``.

    Refuses a descriptor that is not a fully sealed memfd segment: a sender
    could otherwise change the data after handing it over.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as err:
        os.close(fd)
        raise InvalidArgumentError(f"Received descriptor is not a memfd segment: {err}") from None
    if seals & _SEALS != _SEALS:
        os.close(fd)
        raise InvalidArgumentError("Received segment is not sealed against writes.")
    if size == 0:
        os.close(fd)
        return np.empty(0, np.uint8)
    mapping = SealedMapping(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    mapping.fd = fd
    array = np.frombuffer(mapping, np.uint8)
    mapping.address = array.__array_interface__["data"][0]
    weakref.finalize(mapping, os.close, fd)
    return array


def locate(buffer: Any) -> tuple[SealedMapping, int] | None:
    """The sealed mapping ``buffer`` lies in and its offset there, else None."""
    base = buffer
    while base is not None:
        if isinstance(base, SealedMapping):
            start = np.frombuffer(memoryview(buffer).cast("B"), np.uint8)
            return base, start.__array_interface__["data"][0] - base.address
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return None
