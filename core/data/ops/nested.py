"""Transformations over datasets: ``concatenate``, and ``flat_map``/``interleave``, whose
function returns a Dataset per input element."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

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
)
from clusterwire.errors import InvalidArgumentError


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
    """``Dataset.flat_map``: the elements of the Dataset ``fn`` returns, input by input."""

    kind = "flat_map"
    fn: Callable[..., Any] = fn_field()
    guard: Guard | None = guard_field()

    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            for element in upstream():
                yield from returned_pipeline(self.fn, call(self.fn, element), self.guard,
                                             "map_func").run()
        return run

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

    def __post_init__(self) -> None:
        fix = "Give a positive int (or AUTOTUNE)."
        self._count("cycle_length", fix, allow=(AUTOTUNE,))
        self._count("block_length", "Give a positive int.")
        self._count("num_parallel_calls", fix, minimum=0, allow=(AUTOTUNE,))

    def wrap(self, upstream: Factory) -> Factory:
        cycle = default_cycle_length() if self.cycle_length == AUTOTUNE else self.cycle_length
        if self.num_parallel_calls == 0:
            return lambda: self._sequential(upstream(), cycle)
        threads = cycle if self.num_parallel_calls == AUTOTUNE else self.num_parallel_calls
        return lambda: self._parallel(upstream(), cycle, threads)

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN

    def _open(self, element: Any) -> Iterator[Any]:
        return returned_pipeline(self.fn, call(self.fn, element), self.guard, "map_func").run()

    def _sequential(self, inputs: Iterator[Any], cycle: int) -> Iterator[Any]:
        # TF's InterleaveDatasetOp step by step: a slot whose Dataset ended is refilled from
        # the input before the cycle moves on.
        slots: list[Iterator[Any] | None] = [None] * cycle
        index = block = 0
        open_count, inputs_left = 0, True
        while inputs_left or open_count:
            current = slots[index]
            if current is not None:
                try:
                    element = next(current)
                except StopIteration:
                    slots[index] = None
                    open_count -= 1
                else:
                    yield element
                    block += 1
                    if block < self.block_length:
                        continue
                index, block = (index + 1) % cycle, 0
            elif inputs_left:
                try:
                    slots[index] = self._open(next(inputs))
                    open_count += 1
                except StopIteration:
                    inputs_left = False
            else:
                index, block = (index + 1) % cycle, 0

    def _parallel(self, inputs: Iterator[Any], cycle: int, threads: int) -> Iterator[Any]:
        reader = _ParallelCycle(self, inputs, cycle, threads)
        try:
            yield from reader.run()
        finally:
            reader.close()


class _ParallelCycle:
    """The open Datasets of a parallel interleave, each with its next block being read (or
    opened) on the pool: the consumer takes blocks in TF's cycle order (deterministic) or
    as they complete; an ended Dataset's place goes to the next input element."""

    def __init__(self, op: Interleave, inputs: Iterator[Any], cycle: int, threads: int):
        self._op, self._inputs, self._cycle = op, inputs, cycle
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="clusterwire-interleave")
        self._slots: list[Future | None] = [None] * cycle  # each: (iterator, block, ended)
        self._order: deque[int] = deque()  # slots in the order their Datasets were opened
        self._inputs_left = True

    def _read(self, iterator: Iterator[Any] | None, element: Any) -> tuple:
        if iterator is None:
            iterator = self._op._open(element)
        block = []
        try:
            for _ in range(self._op.block_length):
                block.append(next(iterator))
        except StopIteration:
            return iterator, block, True
        return iterator, block, False

    def _fill(self, index: int) -> bool:
        """Open the next input's Dataset in slot ``index``; False if the input has ended."""
        if not self._inputs_left:
            return False
        try:
            element = next(self._inputs)
        except StopIteration:
            self._inputs_left = False
            return False
        self._slots[index] = self._pool.submit(self._read, None, element)
        return True

    def run(self) -> Iterator[Any]:
        for index in range(self._cycle):
            if not self._fill(index):
                break
        index = 0
        while any(s is not None for s in self._slots):
            if not self._op.deterministic:
                ready = wait([s for s in self._slots if s is not None],
                             return_when=FIRST_COMPLETED).done
                index = next(i for i, s in enumerate(self._slots) if s in ready)
            future = self._slots[index]
            if future is not None:
                iterator, block, ended = future.result()
                self._slots[index] = None
                if not ended:
                    self._slots[index] = self._pool.submit(self._read, iterator, None)
                else:  # the next input's Dataset takes this place (as in TF, whose cycle
                    self._fill(index)  # comes back to it next round)
                yield from block
            index = (index + 1) % self._cycle

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
