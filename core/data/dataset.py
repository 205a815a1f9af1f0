"""``clusterwire.data.Dataset``: tf.data's Dataset API over a linear numpy pipeline.

A Dataset is an immutable description (a source plus transformations); it
runs locally when iterated, or on tf.data service workers after
``apply(distribute(...))``. Elements are numpy arrays and scalars, bytes,
tuples and dicts of these. User functions must be importable module-level
functions to run on workers (see ``clusterwire.data.functions``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from clusterwire.data import pipeline
from clusterwire.data.pipeline import (
    Batch,
    Enumerate,
    FilesSource,
    Filter,
    GeneratorSource,
    Map,
    Op,
    Pipeline,
    Prefetch,
    RangeSource,
    Repeat,
    Shuffle,
    Skip,
    SlicesSource,
    Source,
    Take,
    Unbatch,
)


def _positive_int(value: Any, name: str, allow: tuple[int, ...] = ()) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and (
            value > 0 or value in allow):
        return int(value)
    extra = f" (or {', '.join(map(str, allow))})" if allow else ""
    raise ValueError(f"`{name}` must be a positive int{extra}, got {value!r}")


def _int(value: Any, name: str) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise ValueError(f"`{name}` must be an int, got {value!r}")


def _slices(tensors: Any) -> Any:
    if isinstance(tensors, tuple):
        return tuple(_slices(t) for t in tensors)
    if isinstance(tensors, dict):
        return {k: _slices(v) for k, v in tensors.items()}
    array = np.asarray(tensors)
    if array.dtype.hasobject:
        raise ValueError(f"from_tensor_slices: cannot convert {type(tensors).__name__} to a "
                         "numpy array of a fixed dtype.")
    if array.ndim == 0:
        raise ValueError("from_tensor_slices needs tensors with at least one dimension to "
                         "slice; got a scalar.")
    return array


class Dataset:
    """A tf.data-style dataset: build with the static sources, chain transformations."""

    def __init__(self, source: Source, ops: Sequence[Op] = ()):
        self._pipeline = Pipeline(source, tuple(ops))

    @property
    def pipeline(self) -> Pipeline:
        """The source and transformations this dataset stands for."""
        return self._pipeline

    def _with(self, op: Op) -> Dataset:
        return Dataset(self._pipeline.source, (*self._pipeline.ops, op))

    # ---- sources ----

    @staticmethod
    def range(*args: int) -> Dataset:
        """int64 scalars as Python's ``range(stop)`` / ``range(start, stop[, step])``."""
        if not 1 <= len(args) <= 3:
            raise ValueError(f"Dataset.range takes 1 to 3 arguments, got {len(args)}")
        values = [_int(a, "range argument") for a in args]
        bounds = range(*values)
        return Dataset(RangeSource(bounds.start, bounds.stop, bounds.step))

    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """Slices of arrays (or tuples/dicts of arrays) along their first dimension."""
        sliced = _slices(tensors)
        lengths = {len(leaf) for leaf in pipeline._leaves(sliced)}
        if len(lengths) != 1:
            raise ValueError(f"from_tensor_slices: all tensors need the same first dimension, "
                             f"got {sorted(lengths)}")
        return Dataset(SlicesSource(sliced))

    @staticmethod
    def from_files(paths: str | Sequence[str]) -> Dataset:
        """The text lines of files, as bytes without line ends (TF's TextLineDataset).

        In "distributed_epoch" each file is one split.
        """
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = tuple(os.fspath(p) for p in paths)
        if not paths:
            raise ValueError("from_files needs at least one file.")
        return Dataset(FilesSource(paths))

    @staticmethod
    def from_generator(generator: Callable[..., Iterator[Any]], args: Sequence[Any] | None = None
                       ) -> Dataset:
        """What ``generator(*args)`` yields; on workers it must be a module-level function."""
        if not callable(generator):
            raise TypeError(f"`generator` must be callable, got {generator!r}")
        return Dataset(GeneratorSource(generator, tuple(args or ())))

    # ---- transformations ----

    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
            deterministic: bool | None = None) -> Dataset:
        """Apply ``map_func`` to each element (a tuple element is passed as arguments).

        ``num_parallel_calls`` (an int or AUTOTUNE) runs calls on threads; output
        order is kept (``deterministic`` is accepted for TF compatibility).
        """
        parallel = 0 if num_parallel_calls is None else _positive_int(
            num_parallel_calls, "num_parallel_calls", (pipeline.AUTOTUNE,))
        return self._with(Map(map_func, parallel))

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """Keep the elements for which ``predicate`` is true."""
        return self._with(Filter(predicate))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stack ``batch_size`` consecutive elements (structure-wise)."""
        return self._with(Batch(_positive_int(batch_size, "batch_size"), bool(drop_remainder)))

    def unbatch(self) -> Dataset:
        """Split each element along its first dimension."""
        return self._with(Unbatch())

    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool = True) -> Dataset:
        """Shuffle with a ``buffer_size`` buffer; a ``seed`` makes it deterministic."""
        return self._with(Shuffle(_positive_int(buffer_size, "buffer_size"),
                                  None if seed is None else _int(seed, "seed"),
                                  bool(reshuffle_each_iteration)))

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (-1: all)."""
        return self._with(Take(_int(count, "count")))

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (-1: none)."""
        return self._with(Skip(_int(count, "count")))

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeat ``count`` times (None or -1: forever)."""
        return self._with(Repeat(-1 if count is None else _int(count, "count")))

    def prefetch(self, buffer_size: int) -> Dataset:
        """Produce up to ``buffer_size`` elements ahead on a background thread."""
        return self._with(Prefetch(_positive_int(buffer_size, "buffer_size",
                                                 (pipeline.AUTOTUNE,))))

    def enumerate(self, start: int = 0) -> Dataset:
        """``(index, element)`` pairs, the index an int64 counting from ``start``."""
        return self._with(Enumerate(_int(start, "start")))

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """``transformation_func(self)``, e.g. ``apply(distribute(...))``."""
        result = transformation_func(self)
        if not isinstance(result, Dataset):
            raise TypeError(f"`transformation_func` must return a Dataset, got {result!r}")
        return result

    # ---- iteration ----

    def cardinality(self) -> int:
        """The number of elements, INFINITE (-1) or UNKNOWN (-2)."""
        return self._pipeline.cardinality()

    def __iter__(self) -> Iterator[Any]:
        """An iterator of the elements. Of a dataset read through the service (nothing
        applied after ``distribute``) it has ``state_dict()``: the consumer's position, to
        resume from (``distribute(..., state=...)``)."""
        if not self._pipeline.ops:
            return self._pipeline.source.open()
        return self._pipeline.run()

    def as_numpy_iterator(self) -> Iterator[Any]:
        """An iterator of the elements as numpy values (what ``__iter__`` yields too)."""
        return iter(self)

    def __repr__(self) -> str:
        ops = ".".join(type(op).__name__.lower() for op in self._pipeline.ops)
        return f"<Dataset {type(self._pipeline.source).__name__}{'.' + ops if ops else ''}>"
