"""A pool of large receive buffers whose pages are already in memory.

A fresh 64 MiB ``np.empty`` costs as much again as the copy into it (the
kernel faults in and zeroes every page), which was the whole gap between
clusterwire's bulk receives and a bare library reusing one buffer. Transports
take receive buffers from this pool: the caller gets an array, and the buffer
comes back to the pool when that array (and everything built on it) is
garbage, so reuse can never alias data still in use.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence
from typing import Any

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
        # Lent through a ctypes array: numpy points arrays derived from an ndarray view (or
        # from a memoryview of one) straight at ``buffer``, so a finalizer on such a view
        # fired while arrays built on it were alive and the next receive overwrote them.
        # Arrays cannot see past the loan; it dies only with the last of them.
        loan = (ctypes.c_uint8 * nbytes).from_buffer(buffer)
        weakref.finalize(loan, self._give_back, buffer)
        return np.frombuffer(loan, np.uint8)

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


def split(whole: Any, lengths: Sequence[int]) -> list[Any]:
    """``whole`` cut into consecutive slices of ``lengths`` (views when ``whole`` is a view)."""
    parts, offset = [], 0
    for length in lengths:
        parts.append(whole[offset:offset + length])
        offset += length
    return parts


#: The process-wide pool the built-in transports receive into.
receive_buffers = BufferPool()
