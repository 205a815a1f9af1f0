"""Transformations over datasets: ``concatenate``, and ``flat_map``/``interleave``, whose
function returns a Dataset per input element."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from clusterwire.data.limits import PipelineLimits, ThreadBudget, refuse_cycle
from clusterwire.data.ops.base import Guard, Node, fn_field, guard_field, no_guard, register
from clusterwire.data.pipeline import (
    AUTOTUNE,
    INFINITE,
    UNKNOWN,
    Factory,
    Op,
    Pipeline,
    _map_structure,
    call,
    parallelism,
    pipeline_of,
)
from clusterwire.errors import InvalidArgumentError

#: Elements read ahead of the consumer per open Dataset of a parallel interleave, whatever
#: the ``block_length``, so memory stays bounded.
_READ_AHEAD = 8
#: Bytes of elements a parallel interleave's lanes (its threads reading for the CPU, one
#: per core at most) hold ahead of the consumer, shared evenly among them (a read starts
#: while a lane holds less than its share and gives at least one element; the Dataset the
#: consumer waits for is read regardless). Small on purpose: the consumer's thread frees what
#: a read thread allocated, and once a thread's glibc arena has more than its trim threshold
#: free at the top (twice the largest block allocated by mmap and freed), glibc returns it to
#: the kernel and the next elements fault every page in again (with 1 MiB records, 2 MiB a
#: lane gave 2-3 times the faults per MiB of 1 MiB a lane).
_READ_AHEAD_BYTES = 2 << 20
#: Seconds a parallel interleave's read may take before the other Datasets of its thread go
#: to spare threads: far above a read that only needs the CPU, below a wait on storage.
_BLOCKED = 0.005

_ENDED = object()  # what a drained slot whose Dataset has ended gives
_ANY = object()  # the consumer of a non-deterministic interleave waits for any slot


def default_cycle_length() -> int:
    """TF's cycle length for AUTOTUNE: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def returned_pipeline(fn: Callable[..., Any], result: Any, guard: Guard | None,
                      what: str) -> Pipeline:
    """The pipeline of the Dataset ``fn`` returned (checked by ``guard`` on a worker)."""
    pipe = pipeline_of(result)
    if pipe is None:
        raise InvalidArgumentError(
            f"`{what}` must return a clusterwire.data.Dataset; {getattr(fn, '__qualname__', fn)}"
            f" returned {type(result).__name__}. Wrap the values in Dataset.from_tensors(...) "
            "or Dataset.from_tensor_slices(...).")
    return (guard or no_guard)(pipe)


def _types(element: Any) -> Any:
    """The structure and dtypes of ``element`` (what TF requires to match)."""
    def dtype(leaf: Any) -> str:
        kind = np.asarray(leaf).dtype
        return "string" if kind.kind in "SUO" else kind.name
    return repr(_map_structure(dtype, element))


@register
@dataclass(frozen=True)
class Concatenate(Op, Node):
    """``Dataset.concatenate``: this dataset's elements, then those of ``inputs[0]``."""

    kind = "concatenate"
    inputs: tuple[Pipeline, ...] = ()
    per_split = False  # the second dataset is whole, not split with the first

    def wrap(self, upstream: Factory) -> Factory:
        other = self.inputs[0].factory()

        def run() -> Iterator[Any]:
            kind = None
            for element in upstream():
                kind = kind or _types(element)
                yield element
            for element in other():
                if kind is not None and _types(element) != kind:
                    raise InvalidArgumentError(
                        f"concatenate: incompatible dataset elements: {kind} then "
                        f"{_types(element)}. Give `dataset` elements of the same structure and "
                        "dtypes (map one of them first).")
                kind = None
                yield element
        return run

    def cardinality(self, upstream: int) -> int:
        other = self.inputs[0].cardinality()
        if INFINITE in (upstream, other):
            return INFINITE
        return UNKNOWN if UNKNOWN in (upstream, other) else upstream + other


@register
@dataclass(frozen=True)
class FlatMap(Op, Node):
    """``Dataset.flat_map``: the elements of the Dataset ``fn`` returns, input by input
    (an interleave of one Dataset at a time)."""

    kind = "flat_map"
    fn: Callable[..., Any] = fn_field()
    guard: Guard | None = guard_field()

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: _Cycle(self._open, upstream(), 1, 1)

    def _open(self, element: Any) -> Iterator[Any]:
        return returned_pipeline(self.fn, call(self.fn, element), self.guard, "map_func").run()

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN


@register
@dataclass(frozen=True)
class Interleave(Op, Node):
    """``Dataset.interleave``: ``cycle_length`` of ``fn``'s Datasets open at once, taking
    ``block_length`` elements from each in turn; an ended one is replaced by the next
    input's in its place. With ``num_parallel_calls``, that many open Datasets (at most
    ``cycle_length``) are read ahead at once, on a thread per CPU while their reads only
    need the CPU; ``deterministic=False`` takes blocks in the order they are ready."""

    kind = "interleave"
    cycle_length: int
    block_length: int
    num_parallel_calls: int
    deterministic: bool
    fn: Callable[..., Any] = fn_field()
    guard: Guard | None = guard_field()
    #: A worker's pipeline threads (``limited``); the pool's threads are taken from it.
    budget: ThreadBudget | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        fix = "Give a positive int (or AUTOTUNE)."
        self._count("cycle_length", fix, allow=(AUTOTUNE,))
        self._count("block_length", "Give a positive int.")
        self._count("num_parallel_calls", fix, minimum=0, allow=(AUTOTUNE,))

    def wrap(self, upstream: Factory) -> Factory:
        cycle = default_cycle_length() if self.cycle_length == AUTOTUNE else self.cycle_length
        if self.num_parallel_calls == 0:
            return lambda: _Cycle(self._open, upstream(), cycle, self.block_length)
        calls = cycle if self.num_parallel_calls == AUTOTUNE else self.num_parallel_calls
        threads = min(calls, cycle)  # a thread more than the open Datasets would read none
        budget = self.budget

        def make() -> Iterator[Any]:
            granted = threads if budget is None else budget.take(threads)
            if not granted:  # the worker's pipeline threads are spent: read in the reader's
                return _Cycle(self._open, upstream(), cycle, self.block_length)
            return _ParallelCycle(self._open, upstream(), cycle, self.block_length,
                                  granted, self.deterministic, budget)
        return make

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        if self.cycle_length == AUTOTUNE:  # the worker's choice: within its limit
            cycle = min(default_cycle_length(), limits.max_cycle_length)
        else:
            cycle = self.cycle_length
            refuse_cycle(cycle, limits.max_cycle_length)
        if self.num_parallel_calls == 0:
            return replace(self, cycle_length=cycle)
        threads = parallelism(self.num_parallel_calls, "interleave", cycle, limits)
        return replace(self, cycle_length=cycle, num_parallel_calls=threads, budget=budget)

    def _open(self, element: Any) -> Iterator[Any]:
        return returned_pipeline(self.fn, call(self.fn, element), self.guard, "map_func").run()

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN


class _Cycle:
    """TF's InterleaveDatasetOp step by step: a slot whose Dataset ended is refilled from
    the input when the cycle comes back to it. An iterator object: an error (opening a
    Dataset, or reading one) fails one ``next`` and the cycle goes on from there, as TF's
    does, so ``ignore_errors`` can skip it."""

    def __init__(self, open_: Callable[[Any], Iterator[Any]], inputs: Iterator[Any],
                 cycle: int, block_length: int):
        self._open, self._inputs, self._block_length = open_, inputs, block_length
        self._slots: list[Iterator[Any] | None] = [None] * cycle
        self._index = self._block = self._open_count = 0
        self._inputs_left = True

    def __iter__(self) -> Iterator[Any]:
        return self

    def _advance(self) -> None:
        self._index, self._block = (self._index + 1) % len(self._slots), 0

    def __next__(self) -> Any:
        while self._inputs_left or self._open_count:
            current = self._slots[self._index]
            if current is not None:
                try:
                    element = next(current)
                except StopIteration:
                    self._slots[self._index] = None
                    self._open_count -= 1
                    self._advance()
                    continue
                self._block += 1
                if self._block == self._block_length:
                    self._advance()
                return element
            if not self._inputs_left:
                self._advance()
                continue
            try:
                element = next(self._inputs)
            except StopIteration:
                self._inputs_left = False
                continue
            self._slots[self._index] = self._open(element)
            self._open_count += 1
        raise StopIteration


class _Failed:
    """An error a read raised, kept in its place among its Dataset's elements; ``at_open``:
    the Dataset did not open."""

    __slots__ = ("error", "at_open")

    def __init__(self, error: BaseException, at_open: bool):
        self.error, self.at_open = error, at_open


class _Slot:
    """One open Dataset of a parallel interleave: the elements read ahead of the consumer
    (a ``_Failed`` last if the read stopped at an error), its lane, whether it has ended,
    whether a read of it is in flight, and ``given``: how many elements at the head of
    ``buffer`` were read while the consumer waited for them (not counted in the lane's
    ``held``). Guarded by its cycle's lock."""

    __slots__ = ("element", "lane", "iterator", "buffer", "failed", "ended", "given",
                 "reading")

    def __init__(self, element: Any, lane: int):
        self.element = element  # the input element whose Dataset this is
        self.lane = lane
        self.iterator: Iterator[Any] | None = None  # opened by the first read
        self.buffer: deque[Any] = deque()
        self.failed = self.ended = self.reading = False
        self.given = 0


class _Lane:
    """One read thread of a parallel interleave: the slots whose index is its own modulo
    the lanes are read on it, one read at a time; ``held``: the bytes of the elements read
    for them that the consumer has not taken; ``since``: when its read in flight started
    (0: none); ``wake``: locked while the thread has nothing to read (whoever gives it work
    releases it once, setting ``busy``)."""

    __slots__ = ("wake", "held", "busy", "since")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.held = 0
        self.busy = False
        self.since = 0.0


class _Spare:
    """A thread that reads for lanes stuck in a read (``slot``: the Dataset it reads an
    element of next); ``wake`` is locked while it has none (whoever gives it one releases
    it)."""

    __slots__ = ("wake", "slot")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.slot: _Slot | None = None


def _lane_thread(cycle: weakref.ref[_ParallelCycle], number: int,
                 wake: threading.Lock) -> None:
    """Lane ``number``'s thread: reads while there is something to read, then waits to be
    woken. It holds its cycle only while reading, so an abandoned cycle is collected (and
    closes, which wakes the thread to end)."""
    while True:
        wake.acquire()
        reading = cycle()
        if reading is None or not reading._read(number):
            return
        del reading


def _spare_thread(cycle: weakref.ref[_ParallelCycle], spare: _Spare) -> None:
    """A spare thread: reads what it is given, then waits to be given more (holding its
    cycle only while reading, as a lane's thread)."""
    while True:
        spare.wake.acquire()
        reading = cycle()
        if reading is None or not reading._spare_read(spare):
            return
        del reading


def _nbytes(element: Any) -> int:
    """The bytes of ``element``'s bytes and array leaves (other leaves count nothing)."""
    if isinstance(element, (bytes, bytearray)):
        return len(element)
    if isinstance(element, np.ndarray):
        return element.nbytes
    if isinstance(element, (tuple, list)):
        return sum(_nbytes(leaf) for leaf in element)
    if isinstance(element, dict):
        return sum(_nbytes(leaf) for leaf in element.values())
    return 0


class _ParallelCycle:
    """The open Datasets of a parallel interleave, read ahead into a buffer each (up to
    ``_READ_AHEAD`` elements) on ``threads`` threads: a lane per CPU at most, and spares.

    Each open Dataset belongs to a lane (its slot's index modulo the lanes), and a lane's
    thread reads an element at a time, each time of its Dataset whose next unread element
    the consumer comes to first, while it holds less than its share of
    ``_READ_AHEAD_BYTES`` (the Dataset the consumer waits for is read regardless, and what
    it waited for is not held against the share); then it sleeps until the consumer takes
    an element of its Datasets. Reads that need the CPU thus stay on as many threads as
    there are cores (more only take turns with the GIL, and each thread's allocator arena
    and cache). A read that waits (I/O, or on another Dataset) must not hold up the lane's
    other Datasets, though, nor the ``num_parallel_calls`` reads TF makes at once: once a
    lane's read is in flight for ``_BLOCKED`` seconds (looked at when the consumer takes an
    element, and every ``_BLOCKED`` seconds while it waits for one), spare threads (up to
    ``threads`` in all, started as needed) read its other Datasets, an element at a time
    each, while that Dataset has none buffered (or the consumer waits for it). A Dataset is
    never read by two threads at once.

    The consumer takes elements in TF's cycle order (``deterministic``) or from whichever
    Dataset has elements ready. An ended Dataset's place goes to the next input element
    when the consumer finds it drained (TF's cycle gives it that element when it comes
    back). A failed read fails one ``next`` in its place after the elements read before it,
    and the Dataset is read again (a generator that raised then ends), as in TF; nothing is
    read past a failure before the consumer took it. Its ``threads`` go back to ``budget``
    when it ends or is dropped."""

    def __init__(self, open_: Callable[[Any], Iterator[Any]], inputs: Iterator[Any],
                 cycle: int, block_length: int, threads: int, deterministic: bool,
                 budget: ThreadBudget | None = None):
        self._budget, self._threads = budget, threads
        self._open, self._inputs, self._block_length = open_, inputs, block_length
        self._deterministic = deterministic
        # A plain lock: Condition's default RLock costs more on every hand-off.
        self._changed = threading.Condition(threading.Lock())
        # What the consumer waits for: a slot, _ANY slot, or None. A read wakes it only for
        # that (the consumer wakes once per element it needs, not for every element read).
        self._awaited: _Slot | object | None = None
        self._closed = False
        self._slots: list[_Slot | None] = [None] * cycle
        self._index = 0
        self._left = block_length  # elements left in the current slot's block
        self._inputs_left = True
        lanes = min(threads, default_cycle_length())
        self._lanes = [_Lane() for _ in range(lanes)]
        self._lane_slots = [list(range(lane, cycle, lanes)) for lane in range(lanes)]
        self._share = _READ_AHEAD_BYTES // lanes
        self._spares_left = threads - lanes  # spare threads not started yet
        self._idle: list[_Spare] = []  # idle spares; the last one idle is given work first
        self._me = weakref.ref(self)
        for number, lane in enumerate(self._lanes):
            threading.Thread(target=_lane_thread, args=(self._me, number, lane.wake),
                             daemon=True, name=f"clusterwire-interleave-{number}").start()
        for index in range(cycle):
            if not self._fill(index):
                break

    def __iter__(self) -> Iterator[Any]:
        return self

    def _reads_next(self, number: int) -> _Slot | None:
        """The open Dataset lane ``number`` reads an element of next (under the lock): of its
        Datasets, the one whose first unread element the consumer comes to first (the rest of
        the current block, then a block per slot in cycle order). The one the consumer waits
        for is read at any rate; the others while the lane holds less than its share of
        ``_READ_AHEAD_BYTES`` and their buffer has room. None: nothing to read now."""
        if self._closed:
            return None
        awaited = self._awaited
        if isinstance(awaited, _Slot) and awaited.lane == number and not (
                awaited.buffer or awaited.ended or awaited.failed or awaited.reading):
            return awaited
        if self._lanes[number].held >= self._share:
            return None
        return self._first_needed(number, _READ_AHEAD)

    def _first_needed(self, number: int, room: int) -> _Slot | None:
        """Of lane ``number``'s Datasets not being read, with fewer than ``room`` elements
        buffered, the one whose first unread element the consumer comes to first."""
        best, best_key = None, None
        count, block = len(self._slots), self._block_length
        for index in self._lane_slots[number]:
            slot = self._slots[index]
            if slot is None or slot.reading or slot.ended or slot.failed:
                continue
            ahead = len(slot.buffer)
            if ahead >= room:
                continue
            distance = (index - self._index) % count
            if not distance:
                visit = 0 if ahead < self._left else 1 + (ahead - self._left) // block
            else:
                visit = ahead // block
            if best_key is None or (visit, distance) < best_key:
                best, best_key = slot, (visit, distance)
        return best

    def _put(self, slot: _Slot, element: Any, failure: _Failed | None, ended: bool) -> None:
        """Record a read of ``slot`` (under the lock), waking the consumer if it waits for
        it."""
        slot.reading = False
        if element is not _ENDED:
            if self._awaited is slot and not slot.buffer:
                slot.given += 1  # the consumer takes it at once
            else:
                self._lanes[slot.lane].held += _nbytes(element)
            slot.buffer.append(element)
        if failure is not None:
            slot.buffer.append(failure)
            slot.failed = True
        slot.ended = slot.ended or ended
        if self._awaited in (slot, _ANY):
            self._changed.notify()

    def _read_one(self, slot: _Slot) -> tuple[Any, _Failed | None, bool]:
        """One read of ``slot`` (not under the lock): (element or _ENDED, failure, ended)."""
        try:
            if slot.iterator is None:
                slot.iterator = self._open(slot.element)
            return next(slot.iterator), None, False
        except StopIteration:
            return _ENDED, None, True
        except BaseException as err:  # noqa: BLE001 - the consumer raises it in its place
            at_open = slot.iterator is None
            return _ENDED, _Failed(err, at_open), at_open

    def _read(self, number: int) -> bool:
        """Lane ``number``'s reads: an element at a time, each of the Dataset ``_reads_next``
        names (opened first), until it names none. False once the cycle is closed."""
        lane = self._lanes[number]
        with self._changed:
            slot = self._reads_next(number)
            if slot is None:
                lane.busy = False
                return not self._closed
            slot.reading, lane.since = True, time.monotonic()
        while True:
            element, failure, ended = self._read_one(slot)
            with self._changed:
                self._put(slot, element, failure, ended)
                slot = self._reads_next(number)
                if slot is None:
                    lane.busy, lane.since = False, 0.0
                    return not self._closed
                slot.reading, lane.since = True, time.monotonic()

    def _rescue(self) -> _Slot | None:
        """A Dataset for a spare to read an element of (under the lock): of a lane whose
        read has been in flight for ``_BLOCKED`` seconds, the one the consumer waits for or
        else the first it needs that has nothing buffered."""
        if self._closed:
            return None
        now = time.monotonic()
        for number, lane in enumerate(self._lanes):
            if not lane.since or now - lane.since < _BLOCKED:
                continue
            awaited = self._awaited
            if isinstance(awaited, _Slot) and awaited.lane == number and not (
                    awaited.buffer or awaited.ended or awaited.failed or awaited.reading):
                return awaited
            slot = self._first_needed(number, 1)
            if slot is not None:
                return slot
        return None

    def _dispatch_spares(self) -> None:
        """Give what ``_rescue`` finds to idle spares, starting spares as needed (under the
        lock)."""
        while self._idle or self._spares_left:
            slot = self._rescue()
            if slot is None:
                return
            slot.reading = True
            if self._idle:
                spare = self._idle.pop()
                spare.slot = slot
                spare.wake.release()
            else:
                self._start_spare(slot)

    def _start_spare(self, slot: _Slot) -> None:
        """Start a spare thread reading ``slot`` (under the lock)."""
        spare = _Spare()
        spare.slot = slot
        self._spares_left -= 1
        threading.Thread(target=_spare_thread, args=(self._me, spare), daemon=True,
                         name="clusterwire-interleave-spare").start()

    def _spare_read(self, spare: _Spare) -> bool:
        """A spare's reads: the Dataset it was given, then what ``_rescue`` finds, until it
        finds nothing. False once the cycle is closed (the thread ends)."""
        slot = spare.slot
        if slot is None or self._closed:  # woken by _close
            return False
        while True:
            element, failure, ended = self._read_one(slot)
            with self._changed:
                self._put(slot, element, failure, ended)
                if self._closed:
                    return False
                slot = self._rescue()
                if slot is None:
                    spare.slot = None
                    self._idle.append(spare)
                    return True
                slot.reading = True

    def _feed(self, number: int) -> None:
        """Wake lane ``number``'s thread if it is idle and has something to read (under the
        lock)."""
        lane = self._lanes[number]
        if not lane.busy and self._reads_next(number) is not None:
            lane.busy = True
            lane.wake.release()

    def _fill(self, index: int) -> bool:
        """Open the next input's Dataset in slot ``index``; False if the input has ended."""
        self._slots[index] = None
        if not self._inputs_left:
            return False
        try:
            element = next(self._inputs)
        except StopIteration:
            self._inputs_left = False
            return False
        with self._changed:
            self._slots[index] = _Slot(element, index % len(self._lanes))
            self._feed(index % len(self._lanes))
        return True

    def _advance(self) -> None:
        self._index = (self._index + 1) % len(self._slots)
        self._left = self._block_length

    def _wait(self) -> None:
        """Wait for a read (under the lock), giving stuck lanes' Datasets to spares (a
        spare busy now may be idle by the next look)."""
        self._dispatch_spares()
        spares = self._threads > len(self._lanes)
        if not self._changed.wait(_BLOCKED if spares else None):
            self._dispatch_spares()

    def _pick_ready(self) -> None:
        """Move to a slot with something for the consumer (an element, an error, or its end;
        the current one first), waiting for a read if none has: ``deterministic=False``, a
        switch starts a new block."""
        count = len(self._slots)
        with self._changed:
            while True:
                for step in range(count):
                    index = (self._index + step) % count
                    slot = self._slots[index]
                    if slot is not None and (slot.buffer or slot.ended):
                        if step:
                            self._index, self._left = index, self._block_length
                        return
                self._awaited = _ANY
                self._wait()
                self._awaited = None

    def _take(self, slot: _Slot) -> Any:
        """``slot``'s next buffered element (or ``_Failed``), waiting for its read; ``_ENDED``
        if it has ended and is drained. Its lane is woken for its next read at once."""
        with self._changed:
            while not slot.buffer:
                if slot.ended:
                    return _ENDED
                self._awaited = slot
                self._feed(slot.lane)
                self._wait()
                self._awaited = None
            item = slot.buffer.popleft()
            if isinstance(item, _Failed):
                slot.failed = False
            elif slot.given:
                slot.given -= 1
            else:
                self._lanes[slot.lane].held -= _nbytes(item)
            self._feed(slot.lane)
            if self._idle or self._spares_left:
                self._dispatch_spares()
            return item

    def __next__(self) -> Any:
        while True:
            if all(s is None for s in self._slots):
                self._close()
                raise StopIteration
            if not self._deterministic:
                self._pick_ready()
            slot = self._slots[self._index]
            if slot is None:
                self._advance()
                continue
            item = self._take(slot)
            if item is _ENDED:
                self._fill(self._index)
                self._advance()
                continue
            if isinstance(item, _Failed):
                # TF's parallel interleave (unlike its sequential one) counts a Dataset that
                # failed to open as an element of the block, and finds it ended on its next visit.
                if item.at_open:
                    self._count_one()
                raise item.error
            self._count_one()
            return item

    def _count_one(self) -> None:
        """One element of the current block taken: the cycle moves on after the last."""
        self._left -= 1
        if not self._left:
            self._advance()

    def _close(self) -> None:
        """No more reads; idle threads are woken to end, busy ones end after their read.
        Idempotent."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            for lane in self._lanes:
                if not lane.busy:
                    lane.busy = True
                    lane.wake.release()
            idle, self._idle = self._idle, []
            for spare in idle:
                spare.wake.release()
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.give(self._threads)

    def __del__(self) -> None:
        if hasattr(self, "_lanes"):
            self._close()
