"""Reply segments a listener reuses: the listener's side of grpc+local's segment pool.

A fresh sealed segment per reply costs its pages twice: the kernel allocates (and later
frees) them for the copy into it, and the receiver faults them into a new mapping. A listener
instead keeps, for each client process, up to ``limit`` bytes of reusable segments
(``sealed.create_reusable``: only this process's mapping, made before sealing, can write them)
and packs each reply's bulk buffers into a free one: one copy into pages already there. The
client maps it read-only and, once nothing of it maps the segment any more, names it (by
inode) in a RELEASE message before its next call on that connection (``wire``); only then is
it filled again.

A client process is its pid and start time (``unix.peer_process``; a connection whose peer
cannot be told gets a pool of its own): its connections share one pool, which outlives them
by ``LINGER_S``, so the connections of its next epoch find their segments mapped already.

Bounds: a client process's segments, in use or free, total at most ``limit`` bytes; a client
that never releases pins at most that much here, after which its replies travel in fresh
sealed segments as without a pool. A segment only ever carries replies to one client process,
so what an earlier reply left in it is that process's own. A pool without connections is
closed ``LINGER_S`` to twice that after its last connection, and at most ``MAX_IDLE`` of them
wait (a new one closes the
oldest); all close with the listener. The kernel frees a segment once the client's mappings
of it are gone too.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

from clusterwire.transports.local import sealed

#: Segments are made in multiples of this, so that replies of similar sizes share them.
_GRANULE = 1 << 20
#: How long a client process's pool outlives its last connection.
LINGER_S = 10.0
#: Pools without connections kept at most (each at most ``limit`` bytes).
MAX_IDLE = 8


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
        self._used: dict[int, tuple[_Segment, object]] = {}  # with the connection it went on
        self._bytes = 0
        self._closed = False
        #: Replies packed into a pooled segment, and those that had to take a fresh one.
        self.reused = self.fresh = 0

    def pack(self, views: Sequence[memoryview], connection: object) -> tuple[int, list[int]]:
        """``views`` copied into one segment for a reply on ``connection``: (a descriptor of
        it for the caller to send and close, each view's offset), as
        ``sealed.create_packed``."""
        views = list(views)
        offsets, total = sealed.packed_layout([view.nbytes for view in views])
        with self._lock:  # close() from another thread waits for the copy
            segment = (self._reuse(total, views, offsets, connection)
                       or self._new(total, views, offsets, connection))
            if segment is not None:
                self.reused += 1
                return os.dup(segment.fd), offsets
        self.fresh += 1
        return sealed.create_packed(views)

    def _reuse(self, total: int, views: list[memoryview], offsets: list[int],
               connection: object) -> _Segment | None:
        """The smallest free segment of at least ``total`` bytes, filled with ``views`` and
        marked in use; None if none."""
        fitting = [(s.size, inode) for inode, s in self._free.items() if s.size >= total]
        if self._closed or not fitting:
            return None
        inode = min(fitting)[1]
        segment = self._free.pop(inode)
        self._used[inode] = segment, connection
        try:
            for view, start in zip(views, offsets, strict=True):
                segment.array[start:start + view.nbytes] = np.frombuffer(view, np.uint8)
        except BaseException:
            self._free[inode] = self._used.pop(inode)[0]
            raise
        return segment

    def _new(self, total: int, views: list[memoryview], offsets: list[int],
             connection: object) -> _Segment | None:
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
        self._used[os.fstat(segment.fd).st_ino] = segment, connection
        self._bytes += size
        return segment

    def release(self, inodes: Sequence[int]) -> None:
        """The client no longer maps these segments: they may be filled again (inodes not in
        use are ignored)."""
        with self._lock:
            for inode in inodes:
                used = self._used.pop(inode, None)
                if used is not None:
                    self._free[inode] = used[0]

    def forget(self, connection: object) -> None:
        """``connection`` closed: the segments it carried that were not released are closed
        here, never filled again (their client may map them still; its release, which would
        have come on that connection, may never come)."""
        with self._lock:
            stranded = [inode for inode, (_, owner) in self._used.items()
                        if owner is connection]
            segments = [self._used.pop(inode)[0] for inode in stranded]
            self._bytes -= sum(segment.size for segment in segments)
        for segment in segments:
            segment.close()

    @property
    def nbytes(self) -> int:
        """Bytes of the segments held now (in use and free)."""
        return self._bytes

    def close(self) -> None:
        """Close every segment (idempotent); later replies take fresh sealed segments."""
        with self._lock:
            self._closed = True
            segments = list(self._free.values()) + [used[0] for used in self._used.values()]
            self._free.clear()
            self._used.clear()
            self._bytes = 0
        for segment in segments:
            segment.close()



class PoolRegistry:
    """A listener's reply pools, one per client process (see the module docstring)."""

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()
        self._active: dict[Hashable, tuple[ReplyPool, int]] = {}  # pool, connections
        self._idle: OrderedDict[Hashable, tuple[ReplyPool, float]] = OrderedDict()
        self._closed = False

    def acquire(self, process: Hashable | None) -> ReplyPool:
        """The pool of client process ``process`` for one more of its connections (None: a
        peer that cannot be told apart, a pool of its own); ``release`` it with the
        connection."""
        if process is None:
            return ReplyPool(self._limit)
        with self._lock:
            if process in self._active:
                pool, users = self._active[process]
            else:
                idle = self._idle.pop(process, None)
                pool, users = (idle[0] if idle else ReplyPool(self._limit)), 0
                if self._closed:
                    pool.close()
            self._active[process] = (pool, users + 1)
        return pool

    def release(self, process: Hashable | None, pool: ReplyPool) -> None:
        """One connection of ``process`` using ``pool`` closed."""
        closing = []
        with self._lock:
            if process is None or self._closed:
                closing.append(pool)
            else:
                _, users = self._active.pop(process)
                if users > 1:
                    self._active[process] = (pool, users - 1)
                else:
                    self._idle[process] = (pool, time.monotonic())
                    while len(self._idle) > MAX_IDLE:
                        closing.append(self._idle.popitem(last=False)[1][0])
        for old in closing:
            old.close()

    def expire(self, now: float) -> float | None:
        """Close the pools idle for ``LINGER_S``; when the next one expires (None: none)."""
        closing = []
        with self._lock:
            while self._idle:
                process, (pool, since) = next(iter(self._idle.items()))
                if now - since < LINGER_S:
                    break
                del self._idle[process]
                closing.append(pool)
            deadline = next(iter(self._idle.values()))[1] + LINGER_S if self._idle else None
        for pool in closing:
            pool.close()
        return deadline

    def close(self) -> None:
        """Close every pool; pools acquired later are closed at once."""
        with self._lock:
            self._closed = True
            pools = [pool for pool, _ in self._active.values()]
            pools += [pool for pool, _ in self._idle.values()]
            self._idle.clear()
        for pool in pools:
            pool.close()
