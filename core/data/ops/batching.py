"""Batching transformations: ``padded_batch``, ``rebatch``, ``window``,
``group_by_window`` and ``bucket_by_sequence_length``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from clusterwire.data.limits import PipelineLimits, ThreadBudget, refuse_above
from clusterwire.data.ops.base import (
    Guard,
    Node,
    count,
    dataset_type_field,
    fn_field,
    guard_field,
    register,
)
from clusterwire.data.ops.nested import returned_pipeline
from clusterwire.data.ops.sources import ElementsSource
from clusterwire.data.pipeline import (
    INFINITE,
    UNKNOWN,
    Factory,
    Op,
    Source,
    _leaves,
    _map_structure,
    call,
)
from clusterwire.errors import InvalidArgumentError, ResourceExhaustedError


def _zip_structure(fn: Callable[..., Any], structure: Any, *others: Any) -> Any:
    """``fn`` of the leaves of ``structure`` and the matching parts of ``others`` (whose
    structure matches it, or is a leaf applying to all of its leaves)."""
    if isinstance(structure, (tuple, dict)):
        keys = range(len(structure)) if isinstance(structure, tuple) else structure.keys()
        parts = {}
        for key in keys:
            matched = []
            for other in others:
                if isinstance(other, type(structure)):
                    if len(other) != len(structure) or (
                            isinstance(other, dict) and key not in other):
                        raise InvalidArgumentError(
                            f"padded_batch: {other!r:.100} does not match the element's "
                            f"structure {_describe(structure)}.")
                    matched.append(other[key])
                else:
                    matched.append(other)
            parts[key] = _zip_structure(fn, structure[key], *matched)
        return tuple(parts.values()) if isinstance(structure, tuple) else parts
    return fn(structure, *others)


def _describe(structure: Any) -> str:
    return repr(_map_structure(lambda _: "·", structure)).replace("'·'", "·")


def _default_padding(dtype: np.dtype) -> Any:
    if dtype.kind in "SU":
        return dtype.type()
    return False if dtype.kind == "b" else 0


def pad_and_stack(values: list[Any], padded_shape: Any, padding_value: Any,
                  most: int | None = None) -> np.ndarray:
    """``values`` (arrays of one rank) stacked, padded up to ``padded_shape`` (None or -1:
    the largest in the batch) with ``padding_value`` (None: 0, b"" or False); at most
    ``most`` values where ``padded_shape`` pads beyond the largest."""
    arrays = [np.asarray(v) for v in values]
    rank = arrays[0].ndim
    if any(a.ndim != rank for a in arrays):
        raise InvalidArgumentError(
            f"padded_batch: the elements of a batch have different ranks "
            f"{sorted({a.ndim for a in arrays})}; padded_batch pads dimensions, it cannot add "
            "them.")
    largest = [max(a.shape[d] for a in arrays) for d in range(rank)]
    if padded_shape is None:
        target = largest
    else:
        try:
            wanted = [None if d is None else int(d) for d in padded_shape]
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"padded_batch: `padded_shapes` takes a shape (a list of sizes or None) per "
                f"component, got {padded_shape!r:.80}.") from None
        if len(wanted) != rank:
            raise InvalidArgumentError(
                f"padded_batch: `padded_shapes` {wanted} has rank {len(wanted)} but the "
                f"element has rank {rank}; give one size (or None) per dimension.")
        target = [largest[d] if w in (-1, None) else w for d, w in enumerate(wanted)]
        for d, size in enumerate(target):
            if largest[d] > size:
                raise InvalidArgumentError(
                    f"padded_batch: attempted to pad to a smaller size than the input element "
                    f"(dimension {d}: element {largest[d]}, `padded_shapes` {size}); raise that "
                    "size or give None to pad to the largest in the batch.")
    values_count = len(arrays) * int(np.prod(target, dtype=object))
    if most is not None and target != largest and values_count > most:
        raise InvalidArgumentError(
            f"padded_batch: padded_shapes {target} make a batch of {len(arrays)} "
            f"{values_count} values, above this tf.data service worker's limit of {most} "
            "(WorkerConfig pipeline_limits max_padded_values). Give smaller padded_shapes "
            "(None pads to the largest in the batch), or raise max_padded_values on the "
            "workers.")
    dtype = np.result_type(*arrays) if arrays[0].dtype.kind in "SU" else arrays[0].dtype
    fill = _default_padding(dtype) if padding_value is None else padding_value
    if np.ndim(fill) != 0:
        raise InvalidArgumentError(f"padded_batch: a padding value must be a scalar, got "
                                   f"{fill!r:.80}.")
    out = np.full((len(arrays), *target), fill, dtype=dtype)
    for index, array in enumerate(arrays):
        out[(index, *(slice(0, n) for n in array.shape))] = array
    return out


def padded(chunk: list[Any], padded_shapes: Any, padding_values: Any,
           limits: PipelineLimits | None = None) -> Any:
    """One padded batch of ``chunk`` (see ``pad_and_stack``), structure-wise, under a
    worker's ``limits``."""
    counter = itertools.count()
    indexed = _map_structure(lambda _: next(counter), chunk[0])
    columns = list(zip(*(_leaves(e) for e in chunk), strict=True))
    most = None if limits is None else limits.max_padded_values
    return _zip_structure(
        lambda i, shape, value: pad_and_stack(list(columns[i]), shape, value, most),
        indexed, padded_shapes, padding_values)


def _chunks(elements: Iterator[Any], size: int, drop_remainder: bool) -> Iterator[list[Any]]:
    while True:
        chunk = list(itertools.islice(elements, size))
        if not chunk or (drop_remainder and len(chunk) < size):
            return
        yield chunk


def _batched_cardinality(upstream: int, size: int, drop_remainder: bool) -> int:
    if upstream < 0:
        return upstream
    whole, rest = divmod(upstream, size)
    return whole + (1 if rest and not drop_remainder else 0)


@register
@dataclass(frozen=True)
class PaddedBatch(Op, Node):
    """``Dataset.padded_batch``."""

    kind = "padded_batch"
    batch_size: int
    padded_shapes: Any
    padding_values: Any
    drop_remainder: bool
    limits: PipelineLimits | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._count("batch_size", "Give a positive int.")

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        refuse_above(self.batch_size, limits.max_buffer_elements, "padded_batch batch_size",
                     "max_buffer_elements")
        return replace(self, limits=limits)

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: (padded(chunk, self.padded_shapes, self.padding_values, self.limits)
                        for chunk in
                        _chunks(upstream(), self.batch_size, self.drop_remainder))

    def cardinality(self, upstream: int) -> int:
        return _batched_cardinality(upstream, self.batch_size, self.drop_remainder)


@register
@dataclass(frozen=True)
class Rebatch(Op, Node):
    """``Dataset.rebatch``: the rows of the input batches in batches of ``batch_sizes[0]``,
    ``batch_sizes[1]``, ... (cycling)."""

    kind = "rebatch"
    batch_sizes: tuple[int, ...]
    drop_remainder: bool

    def __post_init__(self) -> None:
        if not isinstance(self.batch_sizes, (tuple, list)) or not self.batch_sizes:
            raise InvalidArgumentError(f"`batch_size` of rebatch must be an int or a non-empty "
                                       f"list of them, got {self.batch_sizes!r}.")
        object.__setattr__(self, "batch_sizes", tuple(
            count(b, "batch_size", "Give a positive int (or a list of them).")
            for b in self.batch_sizes))

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        refuse_above(max(self.batch_sizes), limits.max_buffer_elements, "rebatch batch_size",
                     "max_buffer_elements")
        return self

    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            sizes = itertools.cycle(self.batch_sizes)
            wanted, pending, have = next(sizes), [], 0
            for element in upstream():
                rows = len(_rows(element))
                start = 0
                while start < rows:
                    take = min(wanted - have, rows - start)
                    pending.append(_map_structure(lambda a, s=start, t=take: a[s:s + t],
                                                  element))
                    have, start = have + take, start + take
                    if have == wanted:
                        yield _concat(pending)
                        wanted, pending, have = next(sizes), [], 0
            if pending and not self.drop_remainder:
                yield _concat(pending)
        return run

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN


def _rows(element: Any) -> Any:
    leaf = np.asarray(_leaves(element)[0])
    if leaf.ndim == 0:
        raise InvalidArgumentError(
            "rebatch needs batched elements (at least one dimension); got a scalar. Use "
            "batch(...) first.")
    return leaf


def _concat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, tuple):
        return tuple(_concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    return np.concatenate([np.asarray(p) for p in parts])


def window_dataset(elements: list[Any], dataset_type: Callable[[Source], Any]) -> Any:
    """A window as TF makes it: the element structure with a Dataset (of ``dataset_type``)
    per component."""
    counter = itertools.count()
    indexed = _map_structure(lambda _: next(counter), elements[0])
    columns = list(zip(*(_leaves(e) for e in elements), strict=True))
    return _map_structure(lambda i: dataset_type(ElementsSource(list(columns[i]))), indexed)


@register
@dataclass(frozen=True)
class Window(Op, Node):
    """``Dataset.window``: windows of ``size`` elements (``stride`` apart), one every
    ``shift`` elements, each a Dataset (per component); TF's WindowDatasetOp step by step."""

    kind = "window"
    size: int
    shift: int
    stride: int
    drop_remainder: bool
    dataset_type: Callable[[Source], Any] = dataset_type_field()

    def __post_init__(self) -> None:
        for name in ("size", "shift", "stride"):
            self._count(name, "Give a positive int.")

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        refuse_above((self.size - 1) * self.stride + 1, limits.max_buffer_elements,
                     "window (size - 1) * stride + 1", "max_buffer_elements")
        return self

    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            elements = upstream()
            target = (self.size - 1) * self.stride + 1
            buffer: list[Any] = []
            ended = False
            while True:
                if not ended:
                    buffer.extend(itertools.islice(elements, target - len(buffer)))
                    ended = len(buffer) < target
                if not buffer or (self.drop_remainder and len(buffer) < target):
                    return
                yield window_dataset(buffer[::self.stride][:self.size], self.dataset_type)
                if self.shift >= len(buffer):
                    if not ended:  # discard up to the next window's start, keeping none
                        gap = self.shift - len(buffer)
                        ended = sum(1 for _ in itertools.islice(elements, gap)) < gap
                    buffer = []
                else:
                    del buffer[:self.shift]
        return run

    def cardinality(self, upstream: int) -> int:
        if upstream < 0:
            return upstream
        if self.drop_remainder:
            rest = upstream - ((self.size - 1) * self.stride + 1)
            return 0 if rest < 0 else rest // self.shift + 1
        return -(-upstream // self.shift)


def _key(value: Any, what: str) -> int:
    array = np.asarray(value)
    if array.shape != () or array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"`{what}` must return an int64 scalar, got {value!r:.80}.")
    return int(array)


def grouped(elements: Iterator[Any], key_of: Callable[[Any], int],
            size_of: Callable[[int], int], limits: PipelineLimits | None = None
            ) -> Iterator[tuple[int, list[Any]]]:
    """(key, window) pairs as TF's GroupByWindowDatasetOp makes them: a group goes as soon
    as it holds its window size; at the end of the input the rest go in key order. With a
    worker's ``limits``, the groups hold at most ``max_buffer_elements`` in all."""
    groups: dict[int, list[Any]] = {}
    sizes: dict[int, int] = {}
    held = 0
    for element in elements:
        key = key_of(element)
        if limits is not None and held == limits.max_buffer_elements:
            raise ResourceExhaustedError(
                f"The groups of this pipeline hold {held} elements in {len(groups)} keys, this "
                "tf.data service worker's limit (WorkerConfig pipeline_limits "
                "max_buffer_elements). Use fewer keys or smaller windows, or raise "
                "max_buffer_elements on the workers.")
        if key not in groups:
            groups[key] = []
            if key not in sizes:
                sizes[key] = size_of(key)
        groups[key].append(element)
        held += 1
        if len(groups[key]) == sizes[key]:
            held -= sizes[key]
            yield key, groups.pop(key)
    for key in sorted(groups):
        yield key, groups[key]


def _window_size(value: Any, what: str) -> int:
    size = _key(value, what)
    if size <= 0:
        raise InvalidArgumentError(f"`{what}` returned window size {size}; it must be > 0.")
    return size


@register
@dataclass(frozen=True)
class GroupByWindow(Op, Node):
    """``Dataset.group_by_window``: elements grouped by ``key_func``; each window of a group
    (``window_size``, or ``window_size_func(key)``) becomes ``reduce_func(key, window)``'s
    Dataset."""

    kind = "group_by_window"
    window_size: int
    key_func: Callable[..., Any] = fn_field()
    reduce_func: Callable[..., Any] = fn_field()
    window_size_func: Callable[..., Any] | None = fn_field(optional=True)
    guard: Guard | None = guard_field()
    dataset_type: Callable[[Source], Any] = dataset_type_field()
    limits: PipelineLimits | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.window_size == 0) == (self.window_size_func is None):
            raise InvalidArgumentError("group_by_window needs exactly one of `window_size` "
                                       "and `window_size_func`.")
        self._count("window_size", "Give a positive int.", minimum=0)

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        refuse_above(self.window_size, limits.max_buffer_elements,
                     "group_by_window window_size", "max_buffer_elements")
        return replace(self, limits=limits)

    def wrap(self, upstream: Factory) -> Factory:
        def size_of(key: int) -> int:
            if self.window_size_func is None:
                return self.window_size
            return _window_size(self.window_size_func(np.int64(key)), "window_size_func")

        def run() -> Iterator[Any]:
            windows = grouped(upstream(), lambda e: _key(call(self.key_func, e), "key_func"),
                              size_of, self.limits)
            for key, window in windows:
                result = self.reduce_func(np.int64(key),
                                          window_dataset(window, self.dataset_type))
                yield from returned_pipeline(self.reduce_func, result, self.guard,
                                             "reduce_func").run()
        return run

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN


def _boundary_shapes(shapes: Any, element: Any, boundary: int) -> Any:
    """``shapes`` with unknown sizes set to ``boundary``; without ``shapes``, each
    component's first dimension (its sequence) padded to ``boundary``, the others to the
    batch's largest (TF knows which dimensions vary from the element spec; we do not)."""
    if shapes is None:
        return _map_structure(lambda a: [boundary] + [None] * (np.ndim(a) - 1)
                              if np.ndim(a) else [], element)
    return _zip_structure(lambda _, s: [boundary if d in (None, -1) else d for d in s],
                          element, shapes)


@register
@dataclass(frozen=True)
class BucketBySequenceLength(Op, Node):
    """``Dataset.bucket_by_sequence_length``: elements bucketed by
    ``element_length_func``'s length (``bucket_boundaries``), batched per bucket (padded
    as ``padded_batch``, up to the bucket's boundary with ``pad_to_bucket_boundary``)."""

    kind = "bucket_by_sequence_length"
    bucket_boundaries: tuple[int, ...]
    bucket_batch_sizes: tuple[int, ...]
    padded_shapes: Any
    padding_values: Any
    pad_to_bucket_boundary: bool
    no_padding: bool
    drop_remainder: bool
    element_length_func: Callable[..., Any] = fn_field()
    limits: PipelineLimits | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        boundaries = tuple(count(b, "bucket_boundaries", "Give increasing positive ints.")
                           for b in self.bucket_boundaries)
        if list(boundaries) != sorted(set(boundaries)):
            raise InvalidArgumentError(f"`bucket_boundaries` must increase, got "
                                       f"{list(boundaries)}.")
        sizes = tuple(count(b, "bucket_batch_sizes", "Give positive ints.")
                      for b in self.bucket_batch_sizes)
        if len(sizes) != len(boundaries) + 1:
            raise InvalidArgumentError(
                f"`bucket_batch_sizes` must have len(bucket_boundaries) + 1 = "
                f"{len(boundaries) + 1} entries (one per bucket), got {len(sizes)}.")
        object.__setattr__(self, "bucket_boundaries", boundaries)
        object.__setattr__(self, "bucket_batch_sizes", sizes)

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        refuse_above(max(self.bucket_batch_sizes), limits.max_buffer_elements,
                     "bucket_by_sequence_length bucket_batch_sizes", "max_buffer_elements")
        return replace(self, limits=limits)

    def _bucket(self, element: Any) -> int:
        length = _key(call(self.element_length_func, element), "element_length_func")
        bucket = int(np.searchsorted(self.bucket_boundaries, length, side="right"))
        if self.pad_to_bucket_boundary and bucket == len(self.bucket_boundaries):
            raise InvalidArgumentError(
                f"bucket_by_sequence_length: an element has length {length}; with "
                "pad_to_bucket_boundary=True elements must be shorter than "
                f"max(bucket_boundaries) = {max(self.bucket_boundaries)}.")
        return bucket

    def _batch(self, bucket: int, window: list[Any]) -> Iterator[Any]:
        size = self.bucket_batch_sizes[bucket]
        for chunk in _chunks(iter(window), size, self.drop_remainder):
            if self.no_padding:
                yield _concat([_map_structure(lambda a: np.asarray(a)[None], e) for e in chunk])
                continue
            shapes = self.padded_shapes
            if self.pad_to_bucket_boundary:
                shapes = _boundary_shapes(shapes, chunk[0], self.bucket_boundaries[bucket] - 1)
            yield padded(chunk, shapes, self.padding_values, self.limits)

    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            sizes = self.bucket_batch_sizes
            for bucket, window in grouped(upstream(), self._bucket, lambda b: sizes[b],
                                          self.limits):
                yield from self._batch(bucket, window)
        return run

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN

