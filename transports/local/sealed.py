"""Sealed memfd segments: tensor bytes shared between processes without /dev/shm names.

A segment is an anonymous ``memfd`` (nothing ever appears in /dev/shm), filled
once and then sealed against writes, shrinking and growing, so a receiver may
map it and use it in place, and no side can change the other's data. The
kernel frees it when the last descriptor and mapping are gone, including when
a process is SIGKILLed.

A *reusable* segment (``create_reusable``, a listener's reply pool: ``pool``) is sealed
against future writes instead: only the mapping its creator made before sealing can
write it, so its receiver can neither write it nor change its size, and the creator
refills it once the receiver released its views (``open_segment``'s ``release``).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import resource
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from clusterwire.errors import InvalidArgumentError

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Linux's F_SEAL_FUTURE_WRITE (5.1; not in Python 3.11's fcntl): no new writable shared
#: mapping nor write(), while the writable mappings made before it stay.
F_SEAL_FUTURE_WRITE = 0x0010
_REUSABLE_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


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


class LeasedMapping(mmap.mmap):
    """A read-only mapping of a reusable segment its sender refills once this process no
    longer maps it. ``lease`` is alive while this mapping or its private mapping is; its
    end tells the sender (``open_segment``'s ``release``). Never re-sent by descriptor
    (``locate`` ignores it): another process's mapping would outlive the lease."""

    #: Nobody writes it while a view of it lives here (the sender waits for the release),
    #: so the core may share it within this process.
    clusterwire_immutable = True

    fd: int
    address: int  # where the mapping starts in this process's memory
    lease: object
    private: mmap.mmap | None = None

    def clusterwire_private_map(self, offset: int, nbytes: int) -> memoryview:
        """As ``SealedMapping.clusterwire_private_map``; the private mapping keeps the lease
        (the segment is not refilled while a view of it lives)."""
        if self.private is None:
            private = _PrivateMapping(self.fd, len(self), mmap.MAP_PRIVATE,
                                      mmap.PROT_READ | mmap.PROT_WRITE)
            private.lease = self.lease
            self.private = private
        return memoryview(self.private)[offset:offset + nbytes]


class _PrivateMapping(mmap.mmap):
    lease: object


class _Lease:
    """What a leased segment's views keep alive (see ``LeasedMapping``)."""

    __slots__ = ("__weakref__",)


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
        _fill(fd, total, views, offsets)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, offsets


def _fill(fd: int, size: int, views: list[memoryview], offsets: list[int]) -> None:
    """Size a new memfd and write ``views`` at ``offsets`` (write() allocates its pages
    without first zeroing them, as a fault of a mapping would)."""
    os.ftruncate(fd, size)
    for view, start in zip(views, offsets, strict=True):
        written = 0
        while written < view.nbytes:
            written += os.pwrite(fd, view[written:], start + written)


def create_reusable(size: int, views: list[memoryview], offsets: list[int]
                    ) -> tuple[int, mmap.mmap]:
    """A new reusable segment of ``size`` bytes holding ``views`` at ``offsets``: (descriptor,
    the creator's writable mapping, its pages mapped already), sealed against later writes by
    anyone else (see the module docstring)."""
    fd = os.memfd_create("clusterwire-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        _fill(fd, size, views, offsets)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                            mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REUSABLE_SEALS)
        except BaseException:
            mapping.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


def open_segment(fd: int, release: Callable[[int], None] | None = None) -> np.ndarray:
    """Map a received segment read-only as a uint8 array; takes ownership of ``fd``.

    Refuses a descriptor that is not a fully sealed memfd segment: a sender
    could otherwise change the data after handing it over. With ``release``, a reusable
    segment (sealed against future writes, ``create_reusable``) is accepted too, in a
    ``LeasedMapping``: ``release(inode)`` is called once nothing maps it here any more.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        status = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        raise InvalidArgumentError(f"Received descriptor is not a memfd segment: {err}") from None
    size, leased = status.st_size, seals & _SEALS != _SEALS
    if leased and (release is None or seals & _REUSABLE_SEALS != _REUSABLE_SEALS):
        os.close(fd)
        raise InvalidArgumentError("Received segment is not sealed against writes.")
    if size == 0:
        os.close(fd)
        return np.empty(0, np.uint8)
    if leased:
        leased_mapping = LeasedMapping(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        leased_mapping.fd = fd
        leased_mapping.lease = _Lease()
        weakref.finalize(leased_mapping.lease, release, status.st_ino)
        weakref.finalize(leased_mapping, os.close, fd)
        array = np.frombuffer(leased_mapping, np.uint8)
        leased_mapping.address = array.__array_interface__["data"][0]
        return array
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
