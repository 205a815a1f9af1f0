"""The core sources and transformations of an input pipeline, and how to run them (those
that read other pipelines, as ``zip`` and ``interleave``, are in ``clusterwire.data.ops``).

The same objects run a dataset locally (``Dataset.__iter__``) and on a
worker, where the source may be restricted to a split (a range of source
units: range items, tensor slices or files) or to a static shard.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from clusterwire.data.limits import PipelineLimits, ThreadBudget, refuse_above
from clusterwire.data.splits import FILE_KINDS, provider
from clusterwire.errors import InvalidArgumentError

INFINITE = -1
UNKNOWN = -2
AUTOTUNE = -1
_RANGE_CHUNK = 4096

Factory = Callable[[], Iterator[Any]]


def normalize(value: Any) -> Any:
    """TF's conversion of a produced value: numbers/lists become numpy, structure is kept."""
    if isinstance(value, (np.ndarray, np.generic, bytes, str)):
        return value
    if isinstance(value, tuple):
        return tuple(normalize(v) for v in value)
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items()}
    array = np.asarray(value)
    if array.dtype.hasobject:
        raise InvalidArgumentError(
            f"Element value {value!r:.80} of type {type(value).__name__} cannot be converted to "
            "a numpy array of a fixed dtype.")
    return array[()] if array.ndim == 0 else array


def call(fn: Callable[..., Any], element: Any) -> Any:
    """Call a user function as tf.data does: a tuple element is unpacked into arguments."""
    return fn(*element) if isinstance(element, tuple) else fn(element)


def _map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    if isinstance(structure, tuple):
        return tuple(_map_structure(fn, s) for s in structure)
    if isinstance(structure, dict):
        return {k: _map_structure(fn, v) for k, v in structure.items()}
    return fn(structure)


def _leaves(structure: Any) -> list[Any]:
    if isinstance(structure, tuple):
        return [leaf for s in structure for leaf in _leaves(s)]
    if isinstance(structure, dict):
        return [leaf for v in structure.values() for leaf in _leaves(v)]
    return [structure]


def _stack(elements: list[Any]) -> Any:
    first = elements[0]
    if isinstance(first, tuple):
        return tuple(_stack([e[i] for e in elements]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _stack([e[k] for e in elements]) for k in first}
    return np.stack([np.asarray(e) for e in elements])


# ---- Sources ----------------------------------------------------------------

class Source:
    """A source of elements; ``units()`` is its count of split units, or None if
    unsplittable; ``split_kind`` names its split provider (``clusterwire.data.splits``)."""

    split_kind = "elements"

    def units(self) -> int | None:
        return None

    def cardinality(self) -> int:
        return UNKNOWN

    def read(self, start: int, end: int) -> Iterator[Any]:
        """The elements of source units ``[start, end)``."""
        raise InvalidArgumentError(f"{type(self).__name__} cannot be split.")

    def iterate(self) -> Iterator[Any]:
        units = self.units()
        return self.read(0, units) if units is not None else iter(())

    def open(self) -> Iterator[Any]:
        """The iterator of a dataset of this source alone: ``iterate()``'s elements, where a
        source may add to it (the service's has ``state_dict()``)."""
        return self.iterate()

    def has_files(self) -> bool:
        """Whether its units are files or parts of one (static FILE sharding's sources)."""
        return self.split_kind in FILE_KINDS

    def split_epochs(self, units: int, epochs: int) -> tuple[int, int]:
        """The (units, epochs) distributed_epoch splits for ``units`` units read ``epochs``
        times (-1: forever): as given, unless a source folds its epochs into its units."""
        return units, epochs


@dataclass(frozen=True)
class RangeSource(Source):
    """``Dataset.range``: int64 scalars."""

    start: int
    stop: int
    step: int

    def units(self) -> int:
        return len(range(self.start, self.stop, self.step))

    def cardinality(self) -> int:
        return self.units()

    def read(self, start: int, end: int) -> Iterator[Any]:
        first = self.start + start * self.step
        for chunk in range(start, end, _RANGE_CHUNK):
            count = min(_RANGE_CHUNK, end - chunk)
            begin = first + (chunk - start) * self.step
            yield from np.arange(begin, begin + count * self.step, self.step, dtype=np.int64)

    def gather(self, indices: np.ndarray) -> Iterator[Any]:
        """The elements of units ``indices`` (an int64 array), in that order."""
        yield from np.int64(self.start) + indices * np.int64(self.step)


@dataclass(frozen=True)
class SlicesSource(Source):
    """``Dataset.from_tensor_slices``: slices of arrays along their first dimension."""

    tensors: Any

    def units(self) -> int:
        return len(_leaves(self.tensors)[0])

    def cardinality(self) -> int:
        return self.units()

    def read(self, start: int, end: int) -> Iterator[Any]:
        for index in range(start, end):
            yield _map_structure(lambda t, i=index: t[i], self.tensors)

    def gather(self, indices: np.ndarray) -> Iterator[Any]:
        """The elements of units ``indices`` (an int64 array), in that order."""
        for index in indices.tolist():
            yield _map_structure(lambda t, i=index: t[i], self.tensors)

    def select(self, units: np.ndarray) -> SlicesSource:
        """This source of units ``units`` (an int64 array) only, in that order."""
        return replace(self, tensors=_map_structure(lambda t: t[units], self.tensors))


@dataclass(frozen=True)
class FilesSource(Source):
    """``Dataset.from_files``: the text lines of files (bytes, without line ends); a file is
    a split of distributed_epoch."""

    split_kind = "file"
    paths: tuple[str, ...]

    def units(self) -> int:
        return len(self.paths)

    def read(self, start: int, end: int) -> Iterator[Any]:
        for path in self.paths[start:end]:
            with open(path, "rb") as handle:
                for line in handle:
                    yield line.rstrip(b"\n").rstrip(b"\r")

    def select(self, units: np.ndarray) -> FilesSource:
        """This source of files ``units`` (an int64 array) only, in that order."""
        return replace(self, paths=tuple(self.paths[i] for i in units.tolist()))


@dataclass(frozen=True)
class GeneratorSource(Source):
    """``Dataset.from_generator``: what a generator function yields (not splittable)."""

    fn: Callable[..., Iterator[Any]]
    args: tuple = ()

    def iterate(self) -> Iterator[Any]:
        for value in self.fn(*self.args):
            yield normalize(value)


# ---- Transformations --------------------------------------------------------

class Op:
    """A transformation: wraps the factory of its input's iterators."""

    elementwise = False  # one output per input, independent of neighbours
    per_split = True  # may run on each split of a distributed_epoch by itself

    def wrap(self, upstream: Factory) -> Factory:
        raise NotImplementedError

    def cardinality(self, upstream: int) -> int:
        return upstream

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        """This op as a worker runs it under ``limits`` (see ``clusterwire.data.limits``),
        its threads taken from ``budget``; InvalidArgumentError if a size is over a limit."""
        return self


def parallelism(value: int, what: str, autotune: int, limits: PipelineLimits) -> int:
    """Threads for ``num_parallel_calls`` = ``value`` (AUTOTUNE: ``autotune``) on a worker:
    clamped to ``max_parallel_calls``, as TF's AUTOTUNE sizes parallelism to the machine."""
    if value < AUTOTUNE:
        raise InvalidArgumentError(f"{what} num_parallel_calls must be >= 0 or AUTOTUNE (-1), "
                                   f"got {value}.")
    return min(autotune if value == AUTOTUNE else value, limits.max_parallel_calls)


@dataclass(frozen=True)
class Map(Op):
    fn: Callable[..., Any]
    num_parallel_calls: int = 0
    budget: ThreadBudget | None = field(default=None, compare=False, repr=False)
    elementwise = True

    def wrap(self, upstream: Factory) -> Factory:
        fn, budget = self.fn, self.budget
        if self.num_parallel_calls in (0, 1):
            return lambda: _MapIterator(fn, upstream())
        workers = 4 if self.num_parallel_calls == AUTOTUNE else self.num_parallel_calls

        def make() -> Iterator[Any]:
            granted = workers if budget is None else budget.take(workers)
            if not granted:  # the worker's pipeline threads are spent: map in the reader's
                return _MapIterator(fn, upstream())
            return _ParallelMapIterator(fn, upstream(), granted, budget)
        return make

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        if self.num_parallel_calls in (0, 1):
            return self
        threads = parallelism(self.num_parallel_calls, "map", 4, limits)
        return replace(self, num_parallel_calls=threads, budget=budget)


class _MapIterator:
    """``fn`` of each element. An iterator object rather than a generator: a call that
    raises fails that element only, so ``ignore_errors`` can go on to the next one."""

    def __init__(self, fn: Callable[..., Any], elements: Iterator[Any]):
        self._fn, self._elements = fn, elements

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return normalize(call(self._fn, next(self._elements)))


class _ParallelMapIterator:
    """Ordered map over a thread pool with ``2 * workers`` calls in flight; a failed call
    fails its element only (as ``_MapIterator``). Its ``workers`` threads go back to
    ``budget`` when it ends or is dropped."""

    def __init__(self, fn: Callable[..., Any], elements: Iterator[Any], workers: int,
                 budget: ThreadBudget | None = None):
        self._budget = budget
        self._fn, self._elements, self._workers = fn, elements, workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="clusterwire-map")
        self._pending: deque = deque()
        self._exhausted = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while not self._exhausted and len(self._pending) < 2 * self._workers:
            try:
                element = next(self._elements)
            except StopIteration:
                self._exhausted = True
                break
            self._pending.append(self._pool.submit(call, self._fn, element))
        if not self._pending:
            self._close(cancel=False)
            raise StopIteration
        return normalize(self._pending.popleft().result())

    def _close(self, cancel: bool) -> None:
        self._pool.shutdown(wait=False, cancel_futures=cancel)
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.give(self._workers)

    def __del__(self) -> None:
        if hasattr(self, "_pool"):
            self._close(cancel=True)


@dataclass(frozen=True)
class Filter(Op):
    fn: Callable[..., Any]

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: _FilterIterator(self.fn, upstream())

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN


class _FilterIterator:
    """The elements ``fn`` keeps; a call that raises fails that element only."""

    def __init__(self, fn: Callable[..., Any], elements: Iterator[Any]):
        self._fn, self._elements = fn, elements

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            element = next(self._elements)
            if bool(call(self._fn, element)):
                return element


@dataclass(frozen=True)
class Batch(Op):
    batch_size: int
    drop_remainder: bool = False

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch batch_size must be > 0, got {self.batch_size}.")
        refuse_above(self.batch_size, limits.max_buffer_elements, "batch batch_size",
                     "max_buffer_elements")
        return self

    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            iterator = upstream()
            while True:
                chunk = list(itertools.islice(iterator, self.batch_size))
                if not chunk or (self.drop_remainder and len(chunk) < self.batch_size):
                    return
                yield _stack(chunk)
        return run

    def cardinality(self, upstream: int) -> int:
        if upstream < 0:
            return upstream
        whole, rest = divmod(upstream, self.batch_size)
        return whole + (1 if rest and not self.drop_remainder else 0)


@dataclass(frozen=True)
class Unbatch(Op):
    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            for element in upstream():
                leaves = _leaves(element)
                for index in range(len(leaves[0])):
                    yield _map_structure(lambda t, i=index: t[i], element)
        return run

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN


@dataclass(frozen=True)
class Shuffle(Op):
    buffer_size: int
    seed: int | None = None
    reshuffle_each_iteration: bool = True

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        if self.buffer_size < 1:
            raise InvalidArgumentError(f"shuffle buffer_size must be > 0, got "
                                       f"{self.buffer_size}.")
        refuse_above(self.buffer_size, limits.max_buffer_elements, "shuffle buffer_size",
                     "max_buffer_elements")
        return self

    def wrap(self, upstream: Factory) -> Factory:
        epochs = itertools.count()

        def run() -> Iterator[Any]:
            epoch = next(epochs) if self.reshuffle_each_iteration else 0
            rng = np.random.default_rng(None if self.seed is None else [self.seed, epoch])
            buffer: list[Any] = []
            for element in upstream():
                if len(buffer) < self.buffer_size:
                    buffer.append(element)
                    continue
                index = int(rng.integers(len(buffer)))
                yield buffer[index]
                buffer[index] = element
            for index in rng.permutation(len(buffer)):
                yield buffer[index]
        return run


@dataclass(frozen=True)
class Take(Op):
    count: int

    def wrap(self, upstream: Factory) -> Factory:
        if self.count < 0:
            return upstream
        return lambda: itertools.islice(upstream(), self.count)

    def cardinality(self, upstream: int) -> int:
        if self.count < 0:
            return upstream
        if upstream == INFINITE:
            return self.count
        return min(upstream, self.count) if upstream >= 0 else UNKNOWN


@dataclass(frozen=True)
class Skip(Op):
    count: int

    def wrap(self, upstream: Factory) -> Factory:
        if self.count < 0:
            return lambda: iter(())
        return lambda: itertools.islice(upstream(), self.count, None)

    def cardinality(self, upstream: int) -> int:
        if upstream < 0:
            return upstream
        return 0 if self.count < 0 else max(0, upstream - self.count)


@dataclass(frozen=True)
class Repeat(Op):
    count: int = -1

    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            rounds = itertools.count() if self.count < 0 else range(self.count)
            for _ in rounds:
                produced = False
                for element in upstream():
                    produced = True
                    yield element
                if not produced:
                    return
        return run

    def cardinality(self, upstream: int) -> int:
        if upstream == 0 or upstream == UNKNOWN:
            return upstream
        if self.count < 0 or upstream == INFINITE:
            return INFINITE
        return upstream * self.count


@dataclass(frozen=True)
class Prefetch(Op):
    buffer_size: int
    budget: ThreadBudget | None = field(default=None, compare=False, repr=False)
    elementwise = True

    def wrap(self, upstream: Factory) -> Factory:
        size = 2 if self.buffer_size == AUTOTUNE else max(1, self.buffer_size)
        return lambda: _prefetch(upstream(), size, self.budget)

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        size = 2 if self.buffer_size == AUTOTUNE else max(1, self.buffer_size)
        return replace(self, buffer_size=min(size, limits.max_prefetch), budget=budget)


_DONE = object()


def _prefetch(elements: Iterator[Any], size: int, budget: ThreadBudget | None = None
              ) -> Iterator[Any]:
    """Produce ``elements`` on a background thread, ``size`` ahead of the reader; with
    ``budget``, only if it grants the thread (else pass them through: prefetch does not
    change the elements)."""
    if budget is not None and not budget.take(1):
        yield from elements
        return
    slots: queue.Queue = queue.Queue(size)
    stop = threading.Event()

    def offer(item: tuple) -> bool:
        """Put ``item`` unless the reader has stopped; whether it was put."""
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for element in elements:
                if not offer((element, None)):
                    return
            offer((_DONE, None))
        except BaseException as err:  # handed to the reader
            offer((_DONE, err))
        finally:
            if budget is not None:
                budget.give(1)

    threading.Thread(target=produce, daemon=True, name="clusterwire-prefetch").start()
    try:
        while True:
            element, error = slots.get()
            if element is _DONE:
                if error is not None:
                    raise error
                return
            yield element
    finally:
        stop.set()


@dataclass(frozen=True)
class Enumerate(Op):
    start: int = 0

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: ((np.int64(i), e) for i, e in enumerate(upstream(), self.start))


# ---- Running ----------------------------------------------------------------

@dataclass(frozen=True)
class Pipeline:
    """A source and its transformations."""

    source: Source
    ops: tuple[Op, ...] = field(default_factory=tuple)

    def cardinality(self) -> int:
        count = self.source.cardinality()
        for op in self.ops:
            count = op.cardinality(count)
        return count

    def factory(self, source: Factory | None = None, ops: tuple[Op, ...] | None = None
                ) -> Factory:
        """What makes this pipeline's iterators (each call: one pass, an epoch), optionally
        from another source factory or with other ops. The ops keep their state across the
        passes of one factory (a reshuffling ``shuffle``'s epoch, a ``cache``)."""
        factory: Factory = source or self.source.iterate
        for op in self.ops if ops is None else ops:
            factory = op.wrap(factory)
        return factory

    def run(self, source: Factory | None = None, ops: tuple[Op, ...] | None = None
            ) -> Iterator[Any]:
        """Iterate, optionally from another source factory or with other ops."""
        return self.factory(source, ops)()


def pipeline_of(value: Any) -> Pipeline | None:
    """The pipeline of a clusterwire ``Dataset`` (what holds a Pipeline at ``.pipeline``:
    the modules below ``dataset`` take Datasets without importing it), else None."""
    pipe = getattr(value, "pipeline", None)
    return pipe if isinstance(pipe, Pipeline) else None


@dataclass(frozen=True)
class SplitPlan:
    """How a pipeline is split: units per epoch, epochs (-1 forever), ops run per split."""

    units: int
    epochs: int
    ops: tuple[Op, ...]
    align: int  # split sizes are multiples of this (a leading batch's size)
    kind: str  # the source's split kind (``clusterwire.data.splits``)

    def split_units(self, workers: int) -> int:
        """Units per split, for ``workers`` live workers (the source kind's provider)."""
        return provider(self.kind).units_per_split(self.units, workers, self.align)


def split_plan(pipeline: Pipeline) -> SplitPlan:
    """The split plan of ``pipeline``; InvalidArgumentError if its source cannot be split.

    A ``repeat`` preceded only by element-wise ops repeats the source's
    splits (it becomes epochs); the other ops run on each split by itself.
    """
    units = pipeline.source.units()
    if units is None:
        raise InvalidArgumentError(
            f"processing_mode='distributed_epoch' needs a splittable source (Dataset.range, "
            f"from_tensor_slices, from_files); {type(pipeline.source).__name__} cannot be "
            "split. Use processing_mode='parallel_epochs'.")
    for op in pipeline.ops:
        if not op.per_split:
            raise InvalidArgumentError(
                f"processing_mode='distributed_epoch' runs the transformations on each split "
                f"by itself, which {type(op).__name__.lower()} cannot do (its other dataset "
                "would be read once per split). Use processing_mode='parallel_epochs'.")
    ops, epochs, align = list(pipeline.ops), 1, 1
    for index, op in enumerate(ops):
        if isinstance(op, (Map, Filter, Prefetch)):
            continue
        if isinstance(op, Repeat):
            epochs = op.count
            del ops[index]
        break
    units, epochs = pipeline.source.split_epochs(units, epochs)
    for op in ops:
        if isinstance(op, Batch):
            align = op.batch_size
        if not (isinstance(op, (Map, Prefetch))):
            break
    return SplitPlan(units, epochs, tuple(ops), align, pipeline.source.split_kind)
