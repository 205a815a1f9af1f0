"""Transformations over datasets: ``concatenate``, and ``flat_map``/``interleave``, whose
function returns a Dataset per input element."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from clusterwire.data.limits import PipelineLimits, ThreadBudget, refuse_cycle
from clusterwire.data.ops import Guard, Node, fn_field, guard_field, no_guard, register
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
)
from clusterwire.errors import InvalidArgumentError

#: Elements read ahead of the consumer per open Dataset of a parallel interleave: a block
#: of a large ``block_length`` is read in parts, so memory stays bounded.
_READ_AHEAD = 8

_ENDED: Future = Future()  # the read of a slot whose Dataset has ended
_ENDED.set_result((None, [], True, None))


def default_cycle_length() -> int:
    """TF's cycle length for AUTOTUNE: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def returned_pipeline(fn: Callable[..., Any], result: Any, guard: Guard | None,
                      what: str) -> Pipeline:
    """The pipeline of the Dataset ``fn`` returned (checked by ``guard`` on a worker)."""
    pipe = getattr(result, "pipeline", None)
    if not isinstance(pipe, Pipeline):
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
    input's in its place. With ``num_parallel_calls`` threads read a block ahead of each
    open Dataset; ``deterministic=False`` takes blocks in the order they are ready."""

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
        threads = cycle if self.num_parallel_calls == AUTOTUNE else self.num_parallel_calls
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


class _ParallelCycle:
    """The open Datasets of a parallel interleave, each with its next elements being read
    (or the Dataset opened) on the pool, up to ``_READ_AHEAD`` of them: the consumer takes
    them in TF's cycle order (``deterministic``) or as reads complete. An ended Dataset's
    place goes to the next input element at once (TF's cycle gives it that element when it
    comes back). A failed read fails one ``next`` after the elements read before it, and
    the Dataset is read again (a generator that raised then ends), as in TF. Its
    ``threads`` go back to ``budget`` when it ends or is dropped."""

    def __init__(self, open_: Callable[[Any], Iterator[Any]], inputs: Iterator[Any],
                 cycle: int, block_length: int, threads: int, deterministic: bool,
                 budget: ThreadBudget | None = None):
        self._budget, self._threads = budget, threads
        self._open, self._inputs, self._block_length = open_, inputs, block_length
        self._deterministic = deterministic
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="clusterwire-interleave")
        self._slots: list[Future | None] = [None] * cycle
        self._output: deque[Any] = deque()
        self._error: BaseException | None = None
        self._index = 0
        self._left = block_length  # elements left in the current slot's block
        self._inputs_left = True
        for index in range(cycle):
            if not self._fill(index):
                break

    def __iter__(self) -> Iterator[Any]:
        return self

    def _read(self, iterator: Iterator[Any] | None, element: Any, count: int) -> tuple:
        """(iterator, elements, ended, error): up to ``count`` elements of the Dataset
        (opened first for a new input ``element``); ended: it has no more, or did not open."""
        elements: list[Any] = []
        try:
            if iterator is None:
                iterator = self._open(element)
            for _ in range(count):
                elements.append(next(iterator))
        except StopIteration:
            return iterator, elements, True, None
        except Exception as err:  # noqa: BLE001 - the consumer raises it in its place
            return iterator, elements, iterator is None, err
        return iterator, elements, False, None

    def _submit(self, index: int, iterator: Iterator[Any] | None, element: Any,
                count: int) -> None:
        self._slots[index] = self._pool.submit(self._read, iterator, element,
                                               min(count, _READ_AHEAD))

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
        self._submit(index, None, element, self._block_length)
        return True

    def __next__(self) -> Any:
        while not self._output:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if all(s is None for s in self._slots):
                self._close(cancel=False)
                raise StopIteration
            self._step()
        return self._output.popleft()

    def _advance(self) -> None:
        self._index = (self._index + 1) % len(self._slots)
        self._left = self._block_length

    def _step(self) -> None:
        """Take the current slot's next read, then move the cycle as TF's would."""
        if not self._deterministic:  # any ready read, each its own block
            ready = wait([s for s in self._slots if s is not None],
                         return_when=FIRST_COMPLETED).done
            self._index = next(i for i, s in enumerate(self._slots) if s in ready)
            self._left = self._block_length
        future = self._slots[self._index]
        if future is None:
            self._advance()
            return
        iterator, elements, ended, self._error = future.result()
        self._output.extend(elements)
        self._left -= len(elements)
        if ended and self._error is not None and iterator is None:
            # TF's parallel interleave (unlike its sequential one) counts a Dataset that
            # failed to open as an element of the block, and finds it ended on its next visit.
            self._left -= 1
            self._slots[self._index] = _ENDED
            if not self._left:
                self._advance()
        elif ended:
            self._fill(self._index)
            self._advance()
        elif self._left:  # the block goes on: a read was cut at _READ_AHEAD, or failed
            self._submit(self._index, iterator, None, self._left)
        else:
            self._submit(self._index, iterator, None, self._block_length)
            self._advance()

    def _close(self, cancel: bool) -> None:
        self._pool.shutdown(wait=False, cancel_futures=cancel)
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.give(self._threads)

    def __del__(self) -> None:
        if hasattr(self, "_pool"):
            self._close(cancel=True)
