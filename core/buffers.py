"""A pool of large receive buffers whose pages are already in memory.

A fresh 64 MiB ``np.empty`` costs as much again as the copy into it (the
kernel faults in and zeroes every page), which was the whole gap between
clusterwire's bulk receives and a bare library reusing one buffer. Transports
take receive buffers from this pool: the caller gets a view, and the buffer
comes back to the pool when that view (and everything built on it) is
garbage, so reuse can never alias data still in use.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

#: Buffers smaller than this are not pooled (their pages are cheap).
MIN_POOLED_BYTES = 1 << 20
#: At most this much idle memory is kept for reuse.
MAX_HELD_BYTES = 256 << 20


class BufferPool:
    """Reusable uint8 buffers, by exact size, holding at most ``max_bytes`` idle."""

    def __init__(self, max_bytes: int = MAX_HELD_BYTES, min_bytes: int = MIN_POOLED_BYTES):
        self._max_bytes, self._min_bytes = max_bytes, min_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes``, recycled when it is no longer referenced."""
        if nbytes < self._min_bytes:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            free = self._free.get(nbytes)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._held -= nbytes
        if buffer is None:
            buffer = np.empty(nbytes, np.uint8)
        view = buffer[:]
        weakref.finalize(view, self._give_back, buffer)
        return view

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            if self._held + buffer.nbytes <= self._max_bytes:
                self._free.setdefault(buffer.nbytes, []).append(buffer)
                self._held += buffer.nbytes

    @property
    def held_bytes(self) -> int:
        """Idle bytes kept for reuse."""
        with self._lock:
            return self._held


#: The process-wide pool the built-in transports receive into.
receive_buffers = BufferPool()
