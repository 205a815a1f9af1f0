"""``Dataset.global_shuffle``: a source reading a random-access pipeline in the order of an
index permutation (``clusterwire.data.index_shuffle``), with no buffer of elements.

Random access: a ``range`` or ``from_tensor_slices`` source, the rows of ``from_parquet``
(without ``batch_rows``), the records of ``TFRecordDataset(..., index_filenames=...)`` or the
samples of ``from_tar_shards(indexed=True)`` (a file read with a ``random_access`` view: each
gather reads the row groups its rows fall in, each record or sample at its offset from its
file's index), then only ``map``, ``prefetch``, ``take``
and ``skip`` (one element per index; ``take``/``skip`` move the index window,
``map``/``prefetch`` run on the shuffled elements). Its units are positions
in the shuffled order, so a distributed_epoch split ``[a, b)`` yields the input's elements
``perm(a) .. perm(b - 1)``: the same permutation however many workers read it. With
``reshuffle_each_iteration`` epoch ``e`` uses the key ``(seed, e)``; in distributed_epoch
a finite ``repeat`` after it becomes ``units * count`` positions (unit ``u`` is position
``u % units`` of epoch ``u // units``), as a worker knows a split's units, not its epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from clusterwire.data.index_shuffle import IndexPermutation
from clusterwire.data.ops.base import Node, register
from clusterwire.data.pipeline import Map, Pipeline, Prefetch, Skip, Source, Take
from clusterwire.errors import InvalidArgumentError

_CHUNK = 1 << 16  # indices permuted at once: amortises the cycle walk's numpy passes
_ELEMENTWISE = (Map, Prefetch)


def _not_random_access(what: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"global_shuffle needs a random-access input (Dataset.range, from_tensor_slices, "
        f"from_parquet without batch_rows, TFRecordDataset with index_filenames or "
        f"from_tar_shards(indexed=True), then only map, prefetch, take and skip); {what} is "
        "not. Call global_shuffle() "
        "before it (e.g. ds.global_shuffle().filter(...)), or use shuffle(buffer_size) for "
        "this input.")


@register
@dataclass(frozen=True)
class GlobalShuffleSource(Node, Source):
    """The elements of ``inputs[0]`` in the order of the ``(seed, epoch)`` permutation."""

    kind = "global_shuffle"
    seed: int
    reshuffle_each_iteration: bool
    inputs: tuple[Pipeline, ...] = ()

    def __post_init__(self) -> None:
        seed = self.seed
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not (
                -2 ** 63 <= seed < 2 ** 63):
            raise InvalidArgumentError(f"global_shuffle `seed` must be an int64 or None, got "
                                       f"{seed!r:.80}.")
        object.__setattr__(self, "seed", int(seed))
        if not isinstance(self.reshuffle_each_iteration, (bool, np.bool_)):
            raise InvalidArgumentError(
                f"global_shuffle `reshuffle_each_iteration` must be a bool, got "
                f"{self.reshuffle_each_iteration!r:.80}.")
        if len(self.inputs) != 1:
            raise InvalidArgumentError("Malformed dataset: global_shuffle reads one dataset.")
        source, ops = self.inputs[0].source, self.inputs[0].ops
        read = ops[0] if ops and hasattr(ops[0], "random_access") else None
        if read is not None:
            view = read.random_access(source)
            if view is None:
                raise _not_random_access(f"{type(read).__name__} with its arguments")
            count, ops = view[0], ops[1:]
        elif hasattr(source, "gather"):
            count = source.units()
        else:
            raise _not_random_access(f"a {type(source).__name__}")
        object.__setattr__(self, "_read", read)
        offset, elementwise = 0, []
        for op in ops:
            if isinstance(op, _ELEMENTWISE):
                elementwise.append(op)
            elif isinstance(op, Skip):
                skipped = count if op.count < 0 else min(op.count, count)
                offset, count = offset + skipped, count - skipped
            elif isinstance(op, Take):
                count = count if op.count < 0 else min(op.count, count)
            else:
                raise _not_random_access(type(op).__name__.lower())
        object.__setattr__(self, "_window", (offset, count))
        object.__setattr__(self, "_ops", tuple(elementwise))
        object.__setattr__(self, "_epochs", itertools.count())  # one per local iteration

    def units(self) -> int:
        return self._window[1]  # type: ignore[attr-defined]

    def cardinality(self) -> int:
        return self.units()

    def split_epochs(self, units: int, epochs: int) -> tuple[int, int]:
        if not self.reshuffle_each_iteration or epochs == 1:
            return units, epochs
        if epochs < 0:
            raise InvalidArgumentError(
                "processing_mode='distributed_epoch' cannot reshuffle a global_shuffle on "
                "every epoch of an endless repeat() (a split's epoch is not known to its "
                "worker). Use repeat(count), global_shuffle(reshuffle_each_iteration=False) "
                "or processing_mode='parallel_epochs'.")
        return units * epochs, 1

    def iterate(self) -> Iterator[Any]:
        return self.read(*self.epoch_window())

    def epoch_window(self) -> tuple[int, int]:
        """The shuffled positions of the next local iteration's epoch (see ``read``)."""
        epoch = next(self._epochs) if self.reshuffle_each_iteration else 0  # type: ignore
        units = self.units()
        return epoch * units, (epoch + 1) * units

    @property
    def index_window(self) -> tuple[int, int]:
        """(first index, count) of the input's elements it reads (after take and skip)."""
        return self._window  # type: ignore[attr-defined]

    @property
    def reads_files(self) -> bool:
        """Its input is a file format's random-access view, not a range or slices."""
        return self._read is not None  # type: ignore[attr-defined]

    @property
    def elementwise_ops(self) -> tuple[Any, ...]:
        """The input's ``map`` and ``prefetch``, run on the shuffled elements."""
        return self._ops  # type: ignore[attr-defined]

    def read(self, start: int, end: int) -> Iterator[Any]:
        """The elements at shuffled positions ``[start, end)`` (past ``units()``: of the
        later epochs, see the module docstring)."""
        return self.inputs[0].run(source=lambda: self.gathered(start, end),
                                  ops=self._ops)  # type: ignore[attr-defined]

    def gathered(self, start: int, end: int, with_ids: bool = False) -> Iterator[Any]:
        """The input's source elements at shuffled positions ``[start, end)``; ``with_ids``:
        as ``(input index, element)`` pairs (``clusterwire.data.provenance``)."""
        offset, units = self._window  # type: ignore[attr-defined]
        if units == 0:
            return
        source: Any = self.inputs[0].source
        read: Any = self._read  # type: ignore[attr-defined]
        gather = source.gather if read is None else read.random_access(source)[1]
        permutation, key = None, -1
        position = start
        try:
            while position < end:
                epoch = position // units
                stop = min(end, position + _CHUNK, (epoch + 1) * units)
                wanted = epoch if self.reshuffle_each_iteration else 0
                if wanted != key:
                    permutation, key = IndexPermutation(units, self.seed, wanted), wanted
                first = position - epoch * units
                indices = permutation.apply(  # type: ignore[union-attr]
                    np.arange(first, first + stop - position))
                chosen = indices + offset
                yield from (zip(chosen, gather(chosen), strict=True) if with_ids
                            else gather(chosen))
                position = stop
        finally:
            if read is not None:  # a file view: its open files
                gather.close()
