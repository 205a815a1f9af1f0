"""Reply segments a call connection reuses: the listener's side of grpc+local's segment pool.

A fresh sealed segment per reply costs its pages twice: the kernel allocates (and later
frees) them for the copy into it, and the receiver faults them into a new mapping. A call
connection instead keeps up to ``limit`` bytes of reusable segments (``sealed.create_reusable``:
only this process's mapping, made before sealing, can write them) and packs each reply's
bulk buffers into a free one: one copy into pages already there. The client maps it read-only
and, once nothing of it maps the segment any more, names it (by inode) in a RELEASE message
before its next call on the connection (``wire``); only then is it filled again.

Bounds: a connection's segments, in use or free, total at most ``limit`` bytes; a client that
never releases pins at most that much here, after which its replies travel in fresh sealed
segments as without a pool. A segment only ever carries replies to its one connection (one
client process), so what an earlier reply left in it is that client's own. Everything is
closed with the connection (its client gone, or the listener stopping); the kernel frees a
segment once the client's mappings of it are gone too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from clusterwire.transports.local import sealed

#: Segments are made in multiples of this, so that replies of similar sizes share them.
_GRANULE = 1 << 20


class _Segment:
    __slots__ = ("fd", "mapping", "array", "size")

    def __init__(self, size: int, views: list[memoryview], offsets: list[int]):
        self.fd, self.mapping = sealed.create_reusable(size, views, offsets)
        self.array = np.frombuffer(self.mapping, np.uint8)
        self.size = size

    def close(self) -> None:
        del self.array  # the mapping cannot close while a view exports it
        self.mapping.close()
        os.close(self.fd)


class ReplyPool:
    """One call connection's reusable reply segments (see the module docstring)."""

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()  # the connection's thread, and close() from others
        self._free: dict[int, _Segment] = {}  # by inode
        self._used: dict[int, _Segment] = {}
        self._bytes = 0
        self._closed = False
        #: Replies packed into a pooled segment, and those that had to take a fresh one.
        self.reused = self.fresh = 0

    def pack(self, views: Sequence[memoryview]) -> tuple[int, list[int]]:
        """``views`` copied into one segment: (a descriptor of it for the caller to send and
        close, each view's offset), like ``sealed.create_packed``."""
        views = list(views)
        offsets, total = sealed.packed_layout([view.nbytes for view in views])
        with self._lock:  # close() from another thread waits for the copy
            segment = self._reuse(total, views, offsets) or self._new(total, views, offsets)
            if segment is not None:
                self.reused += 1
                return os.dup(segment.fd), offsets
        self.fresh += 1
        return sealed.create_packed(views)

    def _reuse(self, total: int, views: list[memoryview], offsets: list[int]
               ) -> _Segment | None:
        """The smallest free segment of at least ``total`` bytes, filled with ``views`` and
        marked in use; None if none."""
        fitting = [(s.size, inode) for inode, s in self._free.items() if s.size >= total]
        if self._closed or not fitting:
            return None
        inode = min(fitting)[1]
        segment = self._free.pop(inode)
        self._used[inode] = segment
        try:
            for view, start in zip(views, offsets, strict=True):
                segment.array[start:start + view.nbytes] = np.frombuffer(view, np.uint8)
        except BaseException:
            self._free[inode] = self._used.pop(inode)
            raise
        return segment

    def _new(self, total: int, views: list[memoryview], offsets: list[int]
             ) -> _Segment | None:
        """A new segment holding ``views``, marked in use, if the limit allows (closing free
        ones to make room); None if not."""
        size = -(-total // _GRANULE) * _GRANULE
        while self._bytes + size > self._limit and self._free:
            largest = max(self._free, key=lambda i: self._free[i].size)
            self._bytes -= self._free[largest].size
            self._free.pop(largest).close()
        if self._closed or self._bytes + size > self._limit:
            return None
        segment = _Segment(size, views, offsets)
        self._used[os.fstat(segment.fd).st_ino] = segment
        self._bytes += size
        return segment

    def release(self, inodes: Sequence[int]) -> None:
        """The client no longer maps these segments: they may be filled again (inodes not in
        use are ignored)."""
        with self._lock:
            for inode in inodes:
                segment = self._used.pop(inode, None)
                if segment is not None:
                    self._free[inode] = segment

    @property
    def nbytes(self) -> int:
        """Bytes of the segments held now (in use and free)."""
        return self._bytes

    def close(self) -> None:
        """Close every segment (idempotent); later replies take fresh sealed segments."""
        with self._lock:
            self._closed = True
            segments = list(self._free.values()) + list(self._used.values())
            self._free.clear()
            self._used.clear()
            self._bytes = 0
        for segment in segments:
            segment.close()

