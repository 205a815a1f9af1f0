"""The cross-trainer cache: a sliding window over a worker's stream that several trainers read,
each at its own position (tf.data service's ``CrossTrainerCache``).

Trainer jobs reading one infinite dataset with ``CrossTrainerCache(trainer_id=...)`` share
what a worker produced. A trainer reads the elements from its cursor on; an element stays in
the window after it was read, so the other trainers read it too. A trainer that has read the
whole window extends it with the stream's next element (one trainer at a time: the others
wait for that element). The window holds at most ``max_bytes``: its oldest elements are
evicted to make room before an element is added, so a trainer that fell behind the window
skips ahead to the oldest element still cached (as in TF, trainers read a sliding window of
the dataset, not necessarily all of it). Consumers sharing a trainer id share its cursor.

Bounds: the window's bytes (an element larger than the whole window is an
InvalidArgumentError, as in TF), the number of cursors (``max_trainers``: a cursor at or
behind the window's start reads as a new trainer would, so it is dropped to make room;
beyond that a new trainer id is refused with ResourceExhaustedError), and the length of a
trainer id. A failure (the stream's error, its end, an oversized element) fails every later
read: no trainer silently misses an element the others got.

A worker's caches together hold at most ``CACHE_MEMORY_SHARE`` of its memory by default
(``cache_plan``): the physical memory, or the cgroup's limit if lower. Each job's cache
defaults to a quarter of that (at most TF's 10 GiB), and the worker keeps as many cached jobs
as that share holds caches of the configured size (1 to ServiceLimits ``max_cached_jobs``).

A retried read (same consumer and request sequence number: its answer was lost) gets the same
elements again, those still cached; each cursor remembers positions of its last read only,
never elements.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from clusterwire import errors
from clusterwire.data.elements import Encoded
from clusterwire.data.quotas import ServiceLimits
from clusterwire.envelope import MAX_BUFFERS
from clusterwire.thread_pool import parked

#: The longest trainer id a cache accepts (the trainers it serves: ServiceLimits
#: max_cache_trainers).
MAX_TRAINER_ID_CHARS = 1024
#: The share of a worker's memory its cross-trainer caches hold together (by default), and
#: how many share it when their size is the default (at most: ServiceLimits max_cached_jobs).
CACHE_MEMORY_SHARE = 1 / 8
DEFAULT_CACHED_JOBS = 4
_DEFAULTS = ServiceLimits()
_CGROUP_LIMIT = "/sys/fs/cgroup/memory.max"

#: ``pull(wait)``: the stream's next element (None if none came within ``wait`` s) and
#: whether the stream has ended; raises the stream's error.
Pull = Callable[[float], tuple[Encoded | None, bool]]


def element_bytes(element: Encoded) -> int:
    """The memory a cached element is counted for: its buffers and its header."""
    return element.nbytes + element.header.ByteSize()


@dataclass
class _Cursor:
    position: int = 0  # the stream position of the trainer's next element
    # Its last read: the consumer, its request sequence number and where it started.
    consumer: str = ""
    seq: int = -1
    start: int = 0


class CrossTrainerCache:
    """Elements of one stream, kept in a window of ``max_bytes`` for trainers reading it at
    their own pace; ``pull`` gives the stream's next element (see ``Pull``)."""

    def __init__(self, pull: Pull, max_bytes: int,
                 max_trainers: int = _DEFAULTS.max_cache_trainers):
        self._pull = pull
        self._max_bytes = max_bytes
        self._max_trainers = max_trainers
        self._cond = threading.Condition()
        self._window: deque[tuple[Encoded, int]] = deque()  # (element, its element_bytes)
        self._start = 0  # the stream position of _window[0]
        self._bytes = 0
        self._cursors: dict[str, _Cursor] = {}
        self._extending = False
        self._error: errors.OpError | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the cached elements (never more than ``max_bytes``)."""
        with self._cond:
            return self._bytes

    @property
    def window(self) -> tuple[int, int]:
        """The stream positions ``[start, end)`` of the cached elements."""
        with self._cond:
            return self._start, self._start + len(self._window)

    def get(self, trainer_id: str, consumer: str, seq: int, max_elements: int, max_bytes: int,
            wait: float) -> list[Encoded]:
        """The elements from ``trainer_id``'s cursor on: up to ``max_elements`` and
        ``max_bytes`` (at least one) and as many buffers as one frame carries; empty if none
        came within ``wait`` s. ``consumer`` and ``seq`` name the request (a retry repeats
        them)."""
        _check_trainer_id(trainer_id)
        deadline = time.monotonic() + wait
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                cursor = self._cursor(trainer_id)
                if (cursor.consumer, cursor.seq) == (consumer, seq):
                    return self._slice(max(cursor.start, self._start), cursor.position)
                position = max(cursor.position, self._start)  # skips what was evicted
                if position < self._start + len(self._window):
                    return self._take(cursor, position, consumer, seq, max_elements,
                                      max_bytes)
                if self._extending:  # another trainer brings the next element
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return []
                    with parked():
                        self._cond.wait(remaining)
                    continue
                self._extending = True
            if not self._extend(max(deadline - time.monotonic(), 0.0)):
                return []

    def close(self) -> None:
        """Drop the cached elements; later reads get a CancelledError."""
        with self._cond:
            self._error = errors.CancelledError(
                "The cross-trainer cache was closed (job removed or worker stopping).")
            self._window.clear()
            self._bytes = 0
            self._cond.notify_all()

    def _cursor(self, trainer_id: str) -> _Cursor:
        """``trainer_id``'s cursor, made if new (lock held)."""
        cursor = self._cursors.get(trainer_id)
        if cursor is not None:
            return cursor
        if len(self._cursors) >= self._max_trainers:
            for behind in [t for t, c in self._cursors.items() if c.position <= self._start]:
                del self._cursors[behind]
            if len(self._cursors) >= self._max_trainers:
                raise errors.ResourceExhaustedError(
                    f"This tf.data service worker's cross-trainer cache serves "
                    f"{len(self._cursors)} trainers, its limit: trainer {trainer_id[:64]!r} "
                    "cannot join until another trainer falls behind the cached window. Use "
                    "fewer trainer ids (consumers of one trainer share its id).")
        cursor = self._cursors[trainer_id] = _Cursor()
        return cursor

    def _take(self, cursor: _Cursor, position: int, consumer: str, seq: int,
              max_elements: int, max_bytes: int) -> list[Encoded]:
        """The batch from ``position``, moving ``cursor`` past it (lock held)."""
        taken: list[Encoded] = []
        size = buffers = 0
        for element, _ in itertools.islice(self._window, position - self._start, None):
            if len(taken) >= max(max_elements, 1) or taken and (
                    size + element.nbytes > max_bytes
                    or buffers + len(element.buffers) > MAX_BUFFERS):
                break
            taken.append(element)
            size += element.nbytes
            buffers += len(element.buffers)
        cursor.consumer, cursor.seq = consumer, seq
        cursor.start, cursor.position = position, position + len(taken)
        return taken

    def _slice(self, start: int, end: int) -> list[Encoded]:
        """The cached elements at positions ``[start, end)``, ``start`` cached (lock held)."""
        first = start - self._start
        return [element for element, _ in
                itertools.islice(self._window, first, max(end - self._start, first))]

    def _extend(self, wait: float) -> bool:
        """Add the stream's next element (this trainer is the one extending); False if none
        came within ``wait`` s."""
        element, failure = None, None
        try:
            element, ended = self._pull(wait)
            if ended:
                raise errors.InvalidArgumentError(
                    "Cross-trainer caching requires the input dataset to be infinite. "
                    "However, it reached the end of sequence. Add a .repeat() to the dataset.")
            if element is not None and element_bytes(element) > self._max_bytes:
                raise errors.InvalidArgumentError(
                    "tf.data service element size is larger than cache size in bytes. Got "
                    f"element size: {element_bytes(element)} and cache size: "
                    f"{self._max_bytes}. Raise the workers' cross_trainer_cache_size_bytes.")
        except errors.OpError as err:
            failure = err
            raise
        finally:
            with self._cond:
                self._extending = False
                if failure is not None and self._error is None:
                    self._error = failure
                elif element is not None and self._error is None:
                    self._append(element)
                self._cond.notify_all()
        return element is not None

    def _append(self, element: Encoded) -> None:
        """Evict the oldest elements until ``element`` fits, then add it (lock held)."""
        size = element_bytes(element)
        while self._window and self._bytes + size > self._max_bytes:
            self._bytes -= self._window.popleft()[1]
            self._start += 1
        self._window.append((element, size))
        self._bytes += size


def machine_memory() -> int:
    """This process's memory: the physical memory, or its cgroup's limit if lower."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open(_CGROUP_LIMIT) as limit:
            text = limit.read().strip()
    except OSError:
        return memory
    return min(memory, int(text)) if text.isdigit() else memory


def cache_plan(configured: int, memory: int, tf_default: int,
               most: int = _DEFAULTS.max_cached_jobs) -> tuple[int, int]:
    """``(bytes of each job's cache, jobs cached at once)`` on a worker of ``memory`` bytes:
    ``configured`` bytes (0: a ``DEFAULT_CACHED_JOBS``-th of the caches' share, at most
    ``tf_default``), and as many jobs as the share holds caches of that size (1 to
    ``most``, ServiceLimits max_cached_jobs)."""
    share = int(memory * CACHE_MEMORY_SHARE)
    size = configured or max(1, min(tf_default, share // DEFAULT_CACHED_JOBS))
    return size, min(max(1, share // size), most)


def _check_trainer_id(trainer_id: str) -> None:
    if not trainer_id:
        raise errors.InvalidArgumentError(
            "tf.data service cross-trainer cache requires a non-empty trainer ID.")
    if len(trainer_id) > MAX_TRAINER_ID_CHARS:
        raise errors.InvalidArgumentError(
            f"A cross-trainer cache's trainer ID has at most {MAX_TRAINER_ID_CHARS} "
            f"characters; got one of {len(trainer_id)} ({trainer_id[:64]!r}...). Use a "
            "shorter trainer_id.")
