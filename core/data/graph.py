"""Pipeline <-> DatasetDef protobuf plus raw buffers (what travels to workers).

Tensors (``from_tensor_slices``, generator arguments) and pickled functions
are payloads: one codec-encoded list whose buffers travel beside the header.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from clusterwire import codec
from clusterwire.data import functions, pipeline
from clusterwire.data.permissions import WorkerPermissions
from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.data_service_pb2 import DatasetDef, FunctionRef, OpDef


class _Payloads:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, value: Any) -> int:
        self.items.append(value)
        return len(self.items) - 1


def _function(fn: Callable[..., Any], payloads: _Payloads) -> FunctionRef:
    name = functions.reference(fn)
    if name is not None:
        return FunctionRef(name=name)
    return FunctionRef(name=functions.describe(fn), pickled=True,
                       payload=payloads.add(functions.pickle_function(fn)))


def to_def(pipe: pipeline.Pipeline) -> tuple[DatasetDef, list[Any]]:
    """The DatasetDef of ``pipe`` and the buffers its payloads refer to."""
    payloads = _Payloads()
    out = DatasetDef()
    source = pipe.source
    if isinstance(source, pipeline.RangeSource):
        out.source.range.start, out.source.range.stop = source.start, source.stop
        out.source.range.step = source.step
    elif isinstance(source, pipeline.SlicesSource):
        out.source.slices.payload = payloads.add(source.tensors)
    elif isinstance(source, pipeline.FilesSource):
        out.source.files.paths.extend(source.paths)
    elif isinstance(source, pipeline.GeneratorSource):
        out.source.generator.fn.CopyFrom(_function(source.fn, payloads))
        out.source.generator.args_payload = payloads.add(tuple(source.args))
    else:
        raise InvalidArgumentError(
            f"A dataset read from {type(source).__name__} cannot be sent to tf.data service "
            "workers (a distributed dataset cannot be distributed again).")
    for op in pipe.ops:
        out.ops.append(_op_def(op, payloads))
    header, buffers = codec.encode(payloads.items)
    out.payloads.CopyFrom(header)
    return out, buffers


def _op_def(op: pipeline.Op, payloads: _Payloads) -> OpDef:
    out = OpDef()
    if isinstance(op, pipeline.Map):
        out.map.fn.CopyFrom(_function(op.fn, payloads))
        out.map.num_parallel_calls = op.num_parallel_calls
    elif isinstance(op, pipeline.Filter):
        out.filter.CopyFrom(_function(op.fn, payloads))
    elif isinstance(op, pipeline.Batch):
        out.batch.batch_size, out.batch.drop_remainder = op.batch_size, op.drop_remainder
    elif isinstance(op, pipeline.Unbatch):
        out.unbatch.SetInParent()
    elif isinstance(op, pipeline.Shuffle):
        out.shuffle.buffer_size = op.buffer_size
        out.shuffle.has_seed = op.seed is not None
        out.shuffle.seed = op.seed or 0
        out.shuffle.reshuffle_each_iteration = op.reshuffle_each_iteration
    elif isinstance(op, pipeline.Take):
        out.take = op.count
    elif isinstance(op, pipeline.Skip):
        out.skip = op.count
    elif isinstance(op, pipeline.Repeat):
        out.repeat = op.count
    elif isinstance(op, pipeline.Prefetch):
        out.prefetch = op.buffer_size
    elif isinstance(op, pipeline.Enumerate):
        out.enumerate = op.start
    else:  # pragma: no cover - every Op subclass is listed above
        raise InvalidArgumentError(f"Unknown transformation {op!r}")
    return out


def check_no_pickled(dataset: DatasetDef) -> None:
    """InvalidArgumentError if ``dataset`` carries a pickled function."""
    refs = [dataset.source.generator.fn] if dataset.source.HasField("generator") else []
    refs += [op.map.fn if op.HasField("map") else op.filter for op in dataset.ops
             if op.HasField("map") or op.HasField("filter")]
    for ref in refs:
        if ref.pickled:
            raise functions.not_allowed(ref.name)


def fingerprint(dataset: DatasetDef, buffers: Sequence[Any]) -> str:
    """A digest identifying a dataset (definition and payload bytes)."""
    digest = hashlib.sha256(dataset.SerializeToString(deterministic=True))
    for buffer in buffers:
        digest.update(memoryview(buffer).cast("B"))
    return digest.hexdigest()


def _unresolved(*_args: Any) -> Any:
    raise InvalidArgumentError("The dispatcher does not run dataset functions.")


def from_def(dataset: DatasetDef, buffers: Sequence[Any],
             permissions: WorkerPermissions | None = None,
             allow_cloudpickle: bool = False) -> pipeline.Pipeline:
    """The pipeline a DatasetDef describes.

    With ``permissions`` (a worker) its functions are the allowed ones they name (or
    unpickled, with ``allow_cloudpickle``) and its files are checked against the readable
    directories; without, functions are placeholders, enough to plan splits and
    cardinality (the dispatcher).
    """
    items = codec.decode(dataset.payloads, list(buffers)) if dataset.HasField("payloads") else []

    def payload(index: int) -> Any:
        if not isinstance(items, list) or index >= len(items):
            raise InvalidArgumentError(f"Malformed dataset: payload {index} is missing.")
        return items[index]

    def function(ref: FunctionRef, what: str) -> Callable[..., Any]:
        if permissions is None:
            return _unresolved
        if ref.pickled:
            return functions.unpickle_function(bytes(payload(ref.payload)), allow_cloudpickle,
                                               f"{ref.name} ({what})")
        return permissions.function(ref.name)

    kind = dataset.source.WhichOneof("kind")
    source: pipeline.Source
    if kind == "range":
        r = dataset.source.range
        source = pipeline.RangeSource(r.start, r.stop, r.step)
    elif kind == "slices":
        source = pipeline.SlicesSource(payload(dataset.source.slices.payload))
    elif kind == "files":
        paths = tuple(dataset.source.files.paths)
        if permissions is not None:
            paths = tuple(permissions.path(p) for p in paths)
        source = pipeline.FilesSource(paths)
    elif kind == "generator":
        g = dataset.source.generator
        source = pipeline.GeneratorSource(function(g.fn, "generator"),
                                          tuple(payload(g.args_payload)))
    else:
        raise InvalidArgumentError(f"Malformed dataset: unknown source {kind!r}.")
    return pipeline.Pipeline(source, tuple(_op(op, function) for op in dataset.ops))


def _op(op: OpDef, function: Callable[[FunctionRef, str], Callable[..., Any]]) -> pipeline.Op:
    kind = op.WhichOneof("kind")
    if kind == "map":
        return pipeline.Map(function(op.map.fn, "map"), op.map.num_parallel_calls)
    if kind == "filter":
        return pipeline.Filter(function(op.filter, "filter"))
    if kind == "batch":
        return pipeline.Batch(op.batch.batch_size, op.batch.drop_remainder)
    if kind == "unbatch":
        return pipeline.Unbatch()
    if kind == "shuffle":
        s = op.shuffle
        return pipeline.Shuffle(s.buffer_size, s.seed if s.has_seed else None,
                                s.reshuffle_each_iteration)
    simple = {"take": pipeline.Take, "skip": pipeline.Skip, "repeat": pipeline.Repeat,
              "prefetch": pipeline.Prefetch, "enumerate": pipeline.Enumerate}
    if kind in simple:
        return simple[kind](getattr(op, kind))
    raise InvalidArgumentError(f"Malformed dataset: unknown transformation {kind!r}.")
