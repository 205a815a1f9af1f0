"""A worker's element stream: a producer thread filling a bounded buffer of encoded elements.

Consumers take elements first come, first served, or (round-robin reads)
by position, each position read by exactly one consumer. Each consumer's last
batch is remembered under its request sequence number, so a retried request
(its answer was lost) gets the same elements again rather than losing them;
the consumer's next sequence number releases them.

A resumed stream (``skip``) passes over the elements its reader had, on the producer thread,
only while a reader reads it: one that has not asked (nor waited) for ``READER_GONE_S``
pauses the skip
(its thread waits, costing nothing) until a reader asks again or the stream is closed.

A job read through a cross-trainer cache (``cache_bytes``) serves its consumers from the
stream's ``cache`` instead (``fetch_cached``), which takes the elements one at a time and
keeps a window of them for every trainer (see ``cross_trainer_cache``).
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from clusterwire import errors
from clusterwire.data.cross_trainer_cache import CrossTrainerCache, element_bytes
from clusterwire.data.elements import Encoded
from clusterwire.data.quotas import ServiceLimits
from clusterwire.envelope import MAX_BUFFERS
from clusterwire.thread_pool import parked

# Two 8 MiB batches ahead keep a reader busy; buffering more lets elements go cold before the
# transport copies them (64 MiB cost 5-15 % of 1 MiB-element throughput). Counted with the
# elements' headers (cross_trainer_cache.element_bytes) and with the batches remembered for
# the consumers' retries: a stream holds at most this plus one element (the one that filled
# it), whatever its readers ask; a worker's streams, limits.max_open_streams times that.
# (ServiceLimits stream_buffer_bytes and stream_buffer_elements.)
_DEFAULTS = ServiceLimits()
#: A stream skipping a resumed position's elements pauses when no reader asked for this long
#: (a reader waiting for its first element asks again every read's wait, about a second).
READER_GONE_S = 5.0
_SKIP_CHUNK = 4096  # elements skipped between looks at the stream's reader
_NONE = object()


def pipeline_error(err: BaseException) -> errors.OpError:
    """A clusterwire error for an exception raised inside a dataset pipeline."""
    if isinstance(err, errors.OpError):
        return err
    return errors.RemoteFunctionError(
        f"The input pipeline raised on a tf.data service worker: {err}",
        f"{type(err).__module__}.{type(err).__qualname__}", traceback.format_exc())


class Stream:
    """Elements of one pipeline run, produced ahead on a thread, read by consumers."""

    def __init__(self, elements: Iterator[Any], encode: Callable[[Any], Encoded],
                 max_bytes: int = _DEFAULTS.stream_buffer_bytes,
                 max_elements: int = _DEFAULTS.stream_buffer_elements,
                 cache_bytes: int = 0, skip: int = 0, owner: str = "", peer: str = "",
                 element_ids: bool = False, max_trainers: int = _DEFAULTS.max_cache_trainers):
        """With ``cache_bytes``, trainers read it through a cross-trainer cache of that many
        bytes (``fetch_cached``), which takes its elements one at a time. ``skip``: elements
        to pass over first, while a reader reads (a resumed position's). ``owner``: the
        consumer whose stream it is (a split's, an anonymous job's), counted in its share of
        the worker's streams; empty for a stream its job's consumers share. ``peer``: the peer
        whose read opened it (``Frame.peer``), counted in that peer's fair share of the
        worker's streams (``clusterwire.fair_shares``). ``element_ids``: its elements are
        ``(id, element)`` pairs (``clusterwire.data.provenance``)."""
        self.owner = owner
        self.element_ids = element_ids
        self.peer = peer
        self.skip = skip  # where its first element stands in the pipeline's output
        self.cache = (CrossTrainerCache(self._take, cache_bytes, max_trainers) if cache_bytes
                      else None)
        if self.cache is not None:
            max_elements = 1  # produced one ahead, as TF's; the cache holds what was read
        self._cond = threading.Condition()
        self._ready: deque[Encoded] = deque()
        self._base = 0  # the stream position of _ready[0]
        self._taken: set[int] = set()  # positions read out of order (round-robin)
        self._ready_bytes = 0
        self._max_bytes, self._max_elements = max_bytes, max_elements
        self._done = False
        self._closed = False
        self._error: errors.OpError | None = None
        self._claims: dict[str, tuple[int, list[Encoded], bool]] = {}
        self._claimed_bytes = 0  # of the batches in _claims: they count against max_bytes
        self._released: set[str] = set()  # consumers that stopped reading it
        self._reader_left = False  # one of them had read it
        self.last_used = time.monotonic()
        self._skipping = False  # the producer waits for a reader to skip on
        self._waiting = 0  # readers in a long poll
        self._thread = threading.Thread(target=self._produce, args=(elements, encode, skip),
                                        daemon=True, name="clusterwire-data-stream")
        self._thread.start()

    def _produce(self, elements: Iterator[Any], encode: Callable[[Any], Encoded],
                 skip: int) -> None:
        try:
            if skip and not self._skip(elements, skip):
                return
            while True:
                # Room first, then the next element: a full stream holds no element besides
                # its buffer's (a stream's memory is its buffer plus the element that filled it).
                with self._cond:
                    self._cond.wait_for(lambda: self._closed or (
                        self._ready_bytes + self._claimed_bytes < self._max_bytes
                        and len(self._ready) < self._max_elements))
                    if self._closed:
                        return
                element = next(elements, _NONE)
                if element is _NONE:
                    break
                encoded = encode(element)
                with self._cond:
                    if self._closed:
                        return
                    self._ready.append(encoded)
                    self._ready_bytes += element_bytes(encoded)
                    self._cond.notify_all()
        except BaseException as err:  # handed to the consumer that reaches it
            error = pipeline_error(err)
            with self._cond:
                self._error = error
        finally:
            close = getattr(elements, "close", None)
            if close is not None:
                close()
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _skip(self, elements: Iterator[Any], count: int) -> bool:
        """Pass over ``count`` elements (fewer if the stream ends first) while a reader reads;
        False if the stream was closed meanwhile."""
        while count > 0:
            step = min(count, _SKIP_CHUNK)
            if next(itertools.islice(elements, step - 1, step), _NONE) is _NONE:
                return True
            count -= step
            with self._cond:
                self._skipping = True
                self._cond.wait_for(lambda: self._closed or self._waiting or (
                    time.monotonic() - self.last_used < READER_GONE_S))
                self._skipping = False
                if self._closed:
                    return False
        return True

    def _claim(self, consumer: str, claim: tuple[int, list[Encoded], bool]) -> None:
        """Remember ``consumer``'s batch for its retry (lock held)."""
        self._claims[consumer] = claim
        self._claimed_bytes += sum(element_bytes(e) for e in claim[1])

    def _unclaim(self, consumer: str, reading: bool = False) -> bool:
        """Forget ``consumer``'s remembered batch, if any (lock held): its room is the
        producer's again. ``reading``: the consumer asks for its next batch, and is still
        one of the stream's readers meanwhile (``abandoned``)."""
        claim = self._claims.pop(consumer, None)
        if claim is None:
            return False
        if reading:
            self._claims[consumer] = (-1, [], False)
        self._claimed_bytes -= sum(element_bytes(e) for e in claim[1])
        self._cond.notify_all()
        return True

    def _wait(self, predicate: Callable[[], Any], wait: float) -> None:
        """A reader's long poll (lock held): it counts as the stream's reader while it waits
        (a skip goes on for it), and takes no thread from producers."""
        self._waiting += 1
        try:
            with parked():
                self._cond.wait_for(predicate, wait)
        finally:
            self._waiting -= 1

    def _touch(self) -> None:
        """A reader asked: note when, and wake a skip waiting for one (lock held)."""
        self.last_used = time.monotonic()
        if self._skipping:
            self._cond.notify_all()

    def fetch(self, consumer: str, seq: int, max_elements: int, max_bytes: int,
              wait: float) -> tuple[list[Encoded], bool]:
        """Up to ``max_elements``/``max_bytes`` elements and as many buffers as one frame
        carries (at least one element if any come within ``wait`` s), and whether the stream
        has ended after them."""
        with self._cond:
            self._touch()
            last = self._claims.get(consumer)
            if last is not None and last[0] == seq:
                return last[1], last[2]
            self._unclaim(consumer, reading=True)
            self._check_open(consumer)
            self._wait(lambda: self._ready or self._done or self._closed
                       or consumer in self._released, wait)
            self._check_open(consumer)
            taken: list[Encoded] = []
            size = buffers = 0
            while self._ready and len(taken) < max_elements and (not taken or (
                    size + self._ready[0].nbytes <= max_bytes
                    and buffers + len(self._ready[0].buffers) <= MAX_BUFFERS)):
                element = self._ready.popleft()
                taken.append(element)
                size += element.nbytes
                buffers += len(element.buffers)
            self._ready_bytes -= sum(element_bytes(e) for e in taken)
            self._base += len(taken)
            if not self._ready and self._done and self._error is not None and not taken:
                raise self._error
            end = self._done and not self._ready and self._error is None
            self._claim(consumer, (seq, taken, end))
            self._cond.notify_all()
            return taken, end

    def fetch_at(self, consumer: str, seq: int, position: int, wait: float
                 ) -> tuple[list[Encoded], bool]:
        """The element at ``position`` (empty if not produced within ``wait`` s) and
        whether the stream ended before it."""
        with self._cond:
            self._touch()
            last = self._claims.get(consumer)
            if last is not None and last[0] == seq:
                return last[1], last[2]
            self._unclaim(consumer, reading=True)
            self._check_open(consumer)
            self._wait(lambda: self._closed or self._done or consumer in self._released
                       or self._base + len(self._ready) > position, wait)
            self._check_open(consumer)
            if position < self._base or position in self._taken:
                raise errors.FailedPreconditionError(
                    f"Element {position} of this round-robin stream was read already: two "
                    "consumers use the same consumer_index.")
            if position >= self._base + len(self._ready):
                if self._done and self._error is not None:
                    raise self._error
                return [], self._done
            element = self._ready[position - self._base]
            self._taken.add(position)
            while self._ready and self._base in self._taken:
                self._taken.discard(self._base)
                self._ready_bytes -= element_bytes(self._ready.popleft())
                self._base += 1
            self._claim(consumer, (seq, [element], False))
            self._cond.notify_all()
            return [element], False

    def fetch_cached(self, trainer_id: str, consumer: str, seq: int, max_elements: int,
                     max_bytes: int, wait: float) -> list[Encoded]:
        """``CrossTrainerCache.get`` of the stream's cache, for a consumer still reading."""
        assert self.cache is not None
        with self._cond:
            self._touch()
            self._check_open(consumer)
            # One of the stream's readers (``abandoned``); the cache answers its retries.
            self._claims.setdefault(consumer, (-1, [], False))
        return self.cache.get(trainer_id, consumer, seq, max_elements, max_bytes, wait)

    def _take(self, wait: float) -> tuple[Encoded | None, bool]:
        """The next element for the cache (``cross_trainer_cache.Pull``)."""
        with self._cond:
            self._wait(lambda: self._ready or self._done or self._closed, wait)
            if self._closed:
                raise errors.CancelledError("The stream was closed (job removed or worker "
                                            "stopping).")
            if not self._ready:
                if self._done and self._error is not None:
                    raise self._error
                return None, self._done
            element = self._ready.popleft()
            self._ready_bytes -= element_bytes(element)
            self._base += 1
            self._cond.notify_all()
            return element, False

    def forget(self, consumer: str) -> None:
        """``consumer`` stopped reading: drop the batch remembered for its retry, and take
        no more elements for it (a read of it racing the release would lose them)."""
        with self._cond:
            if self._unclaim(consumer):
                self._reader_left = True
            self._released.add(consumer)
            self._cond.notify_all()

    @property
    def abandoned(self) -> bool:
        """Every consumer that read this stream released it (none read it since)."""
        with self._cond:
            return self._reader_left and not self._claims

    def _check_open(self, consumer: str) -> None:
        if self._closed:
            raise errors.CancelledError("The stream was closed (job removed or worker "
                                        "stopping).")
        if consumer in self._released:
            raise errors.CancelledError(f"Consumer {consumer!r} released this stream.")

    @property
    def buffered(self) -> int:
        """Elements produced and not yet taken."""
        with self._cond:
            return len(self._ready)

    @property
    def closed(self) -> bool:
        """Closed: its pipeline need not produce any more (read without the lock: a flag
        that only turns true)."""
        return self._closed

    @property
    def finished(self) -> bool:
        """Produced and handed out completely."""
        with self._cond:
            return self._done and not self._ready

    def close(self) -> None:
        """Stop producing and drop buffered elements."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._claims.clear()
            self._claimed_bytes = 0
            self._cond.notify_all()
        if self.cache is not None:
            self.cache.close()
