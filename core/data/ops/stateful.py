"""Transformations that look at a whole stream: ``shard``, ``scan``, ``take_while``,
``unique``, ``cache`` and ``ignore_errors``."""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

import numpy as np

from clusterwire import codec
from clusterwire.data.limits import PipelineLimits, ThreadBudget
from clusterwire.data.ops.base import Node, fn_field, register
from clusterwire.data.pipeline import INFINITE, UNKNOWN, Factory, Op, _leaves, call, normalize
from clusterwire.errors import (
    DataLossError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from clusterwire.protos.service_pb2 import Value

_log = logging.getLogger(__name__)


@register
@dataclass(frozen=True)
class Shard(Op, Node):
    """``Dataset.shard``: every ``num_shards``-th element from the ``index``-th."""

    kind = "shard"
    num_shards: int
    index: int

    def __post_init__(self) -> None:
        self._count("num_shards", "Give the number of shards (> 0).")
        self._count("index", "Give 0 to num_shards - 1.", minimum=0)
        if self.index >= self.num_shards:
            raise InvalidArgumentError(f"`index` must be between 0 and {self.num_shards - 1} "
                                       f"(num_shards - 1), got {self.index}.")

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: itertools.islice(upstream(), self.index, None, self.num_shards)

    def cardinality(self, upstream: int) -> int:
        if upstream < 0:
            return upstream
        whole, rest = divmod(upstream, self.num_shards)
        return whole + (1 if self.index < rest else 0)


@register
@dataclass(frozen=True)
class Scan(Op, Node):
    """``Dataset.scan``: ``scan_func(state, element)`` gives ``(new_state, output)``."""

    kind = "scan"
    initial_state: Any
    scan_func: Callable[..., Any] = fn_field()

    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            state = self.initial_state
            for element in upstream():
                result = self.scan_func(state, element)
                if not isinstance(result, tuple) or len(result) != 2:
                    raise InvalidArgumentError(
                        f"`scan_func` must return a (new_state, output_element) pair, got "
                        f"{result!r:.100}.")
                state, output = normalize(result)
                yield output
        return run


@register
@dataclass(frozen=True)
class TakeWhile(Op, Node):
    """``Dataset.take_while``: elements until ``predicate`` is first false."""

    kind = "take_while"
    predicate: Callable[..., Any] = fn_field()

    def wrap(self, upstream: Factory) -> Factory:
        return lambda: itertools.takewhile(lambda e: bool(call(self.predicate, e)), upstream())

    def cardinality(self, upstream: int) -> int:
        return UNKNOWN


def _unique_key(element: Any) -> Any:
    leaves = _leaves(element)
    if len(leaves) != 1:
        raise InvalidArgumentError(
            f"unique: elements must have one component (as in TF), got {len(leaves)}; map "
            "them to the one to compare first.")
    leaf = leaves[0]
    if isinstance(leaf, (bytes, str)):
        return leaf
    array = np.asarray(leaf)
    if array.shape == () and array.dtype.kind in "iuSU":
        return array.item()
    raise InvalidArgumentError(
        f"unique: elements must be int32, int64 or string scalars (as in TF), got "
        f"{array.dtype}{list(array.shape)}.")


@register
@dataclass(frozen=True)
class Unique(Op, Node):
    """``Dataset.unique``: each distinct element once, at its first occurrence. On a
    worker (``limits``) it remembers at most ``max_buffer_elements`` distinct elements: one
    more fails there."""

    kind = "unique"
    limits: PipelineLimits | None = field(default=None, compare=False, repr=False)

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        return replace(self, limits=limits)

    def wrap(self, upstream: Factory) -> Factory:
        most = None if self.limits is None else self.limits.max_buffer_elements

        def run() -> Iterator[Any]:
            seen: set[Any] = set()
            for element in upstream():
                key = _unique_key(element)
                if key not in seen:
                    if most is not None and len(seen) == most:
                        raise ResourceExhaustedError(
                            f"unique() on this tf.data service worker remembers at most {most} "
                            "distinct elements (WorkerConfig pipeline_limits "
                            "max_buffer_elements) and its input has more. Deduplicate fewer "
                            "elements, or raise max_buffer_elements on the workers.")
                    seen.add(key)
                    yield element
        return run

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN


_LENGTH = struct.Struct("<Q")


def _write(handle: BinaryIO, element: Any) -> None:
    header, buffers = codec.encode(element)
    views = [memoryview(b).cast("B") for b in buffers]
    data = header.SerializeToString()
    handle.write(_LENGTH.pack(len(data)) + data + _LENGTH.pack(len(views)))
    for view in views:
        handle.write(_LENGTH.pack(view.nbytes))
        handle.write(view)


def _read_exact(handle: BinaryIO, size: int, path: str) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise DataLossError(f"cache file {path!r} is truncated at byte {handle.tell()}; delete "
                            "it to rebuild the cache.")
    return data


def _read(path: str) -> Iterator[Any]:
    with open(path, "rb") as handle:
        while True:
            prefix = handle.read(_LENGTH.size)
            if not prefix:
                return
            if len(prefix) != _LENGTH.size:
                raise DataLossError(f"cache file {path!r} is truncated at byte "
                                    f"{handle.tell()}; delete it to rebuild the cache.")
            header = Value.FromString(_read_exact(handle, _LENGTH.unpack(prefix)[0], path))
            count = _LENGTH.unpack(_read_exact(handle, _LENGTH.size, path))[0]
            buffers = [_read_exact(handle, _LENGTH.unpack(
                _read_exact(handle, _LENGTH.size, path))[0], path) for _ in range(count)]
            yield codec.decode(header, buffers)


@register
@dataclass(frozen=True)
class Cache(Op, Node):
    """``Dataset.cache``: the first complete pass is kept (in memory, or in the file
    ``filename``, which later passes and later runs read) and replayed. A pass left
    unfinished is not kept, as in TF. On a worker (``limits``) a pass in memory keeps at most
    ``max_buffer_elements``: a longer one (an infinite input's) fails there."""

    kind = "cache"
    filename: str
    limits: PipelineLimits | None = field(default=None, compare=False, repr=False)

    def check_on_worker(self) -> None:
        if self.filename:
            raise PermissionDeniedError(
                f"A tf.data service worker does not write files a client names: cache("
                f"{self.filename!r}) runs only where the dataset is iterated locally. Use "
                "cache() (memory) on the workers.")

    def wrap(self, upstream: Factory) -> Factory:
        if self.filename:
            return lambda: self._file(upstream)
        kept: list[list[Any]] = []
        lock = threading.Lock()
        most = None if self.limits is None else self.limits.max_buffer_elements

        def run() -> Iterator[Any]:
            if kept:
                yield from kept[0]
                return
            recorded = []
            for element in upstream():
                if most is not None and len(recorded) == most:
                    raise ResourceExhaustedError(
                        f"cache() on this tf.data service worker keeps at most {most} elements "
                        "of a pass (WorkerConfig pipeline_limits max_buffer_elements) and its "
                        "input has more (an infinite input never ends). Cache fewer elements "
                        "(take(n).cache()), drop cache(), or raise max_buffer_elements on the "
                        "workers.")
                recorded.append(element)
                yield element
            with lock:
                if not kept:
                    kept.append(recorded)
        return run

    def limited(self, limits: PipelineLimits, budget: ThreadBudget) -> Op:
        return self if self.filename else replace(self, limits=limits)

    def _file(self, upstream: Factory) -> Iterator[Any]:
        path = self.filename + ".cwcache"
        if os.path.exists(path):
            yield from _read(path)
            return
        partial = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
        try:
            with open(partial, "wb") as handle:
                for element in upstream():
                    _write(handle, element)
                    yield element
            os.replace(partial, path)  # complete passes only, whole or not at all
        finally:
            if os.path.exists(partial):
                os.unlink(partial)


@register
@dataclass(frozen=True)
class IgnoreErrors(Op, Node):
    """``Dataset.ignore_errors``: an element whose making raised is left out (logged with
    ``log_warning``); an input that cannot go on after an error ends there."""

    kind = "ignore_errors"
    log_warning: bool

    def wrap(self, upstream: Factory) -> Factory:
        def run() -> Iterator[Any]:
            elements = upstream()
            while True:
                try:
                    element = next(elements)
                except StopIteration:
                    return
                except Exception as err:  # noqa: BLE001 - what ignore_errors is for
                    if self.log_warning:
                        _log.warning("ignore_errors: an element was left out: %s", err)
                    continue
                yield element
        return run

    def cardinality(self, upstream: int) -> int:
        return INFINITE if upstream == INFINITE else UNKNOWN
