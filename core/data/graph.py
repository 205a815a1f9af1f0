"""Pipeline <-> DatasetDef protobuf plus raw buffers (what travels to workers).

Tensors (``from_tensor_slices``, generator arguments) and pickled functions
are payloads: one codec-encoded list whose buffers travel beside the header.
The nodes of ``clusterwire.data.ops`` travel as NodeDefs, with the pipelines they read
nested in them (sharing the root's payloads). On a worker, a Dataset that a node's user
function returns goes through ``to_def``/``from_def`` too, so the same rules (allowed
functions, readable files) apply to it as to the client's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from clusterwire import codec
from clusterwire.data import functions, ops, pipeline
from clusterwire.data.dataset import Dataset
from clusterwire.data.limits import PipelineLimits, ThreadBudget
from clusterwire.data.ops import formats
from clusterwire.data.permissions import WorkerPermissions
from clusterwire.errors import InvalidArgumentError
from clusterwire.protos.data_service_pb2 import DatasetDef, FunctionRef, NodeDef, OpDef


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
    out = _pipeline_def(pipe, payloads)
    header, buffers = codec.encode(payloads.items)
    out.payloads.CopyFrom(header)
    return out, buffers


def _node_def(node: ops.Node, payloads: _Payloads) -> NodeDef:
    return NodeDef(kind=node.kind, params=payloads.add(node.params()),
                   fns=[_named(name, _function(fn, payloads))
                        for name, fn in node.functions().items()],
                   inputs=[_pipeline_def(p, payloads) for p in node.inputs_of()])


def _named(field: str, ref: FunctionRef) -> FunctionRef:
    # A node's functions travel as "field=reference" so optional ones can be left out.
    ref.name = f"{field}={ref.name}"
    return ref


def _pipeline_def(pipe: pipeline.Pipeline, payloads: _Payloads) -> DatasetDef:
    out = DatasetDef()
    source = pipe.source
    if isinstance(source, ops.Node):
        out.source.node.CopyFrom(_node_def(source, payloads))
    elif isinstance(source, pipeline.RangeSource):
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
    return out


def _op_def(op: pipeline.Op, payloads: _Payloads) -> OpDef:
    out = OpDef()
    if isinstance(op, ops.Node):
        out.node.CopyFrom(_node_def(op, payloads))
    elif isinstance(op, pipeline.Map):
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
    for ref in _function_refs(dataset):
        if ref.pickled:
            raise functions.not_allowed(ref.name)


def _function_refs(dataset: DatasetDef) -> list[FunctionRef]:
    """Every function of ``dataset``, in its nodes' input pipelines too."""
    refs = [dataset.source.generator.fn] if dataset.source.HasField("generator") else []
    refs += [op.map.fn if op.HasField("map") else op.filter for op in dataset.ops
             if op.HasField("map") or op.HasField("filter")]
    nodes = [dataset.source.node] if dataset.source.HasField("node") else []
    nodes += [op.node for op in dataset.ops if op.HasField("node")]
    for node in nodes:
        refs += node.fns
        for child in node.inputs:
            refs += _function_refs(child)
    return refs


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
             allow_cloudpickle: bool = False,
             limits: tuple[PipelineLimits, ThreadBudget] | None = None) -> pipeline.Pipeline:
    """The pipeline a DatasetDef describes.

    With ``permissions`` (a worker) its functions are the allowed ones they name (or
    unpickled, with ``allow_cloudpickle``) and its files are checked against the readable
    directories; without, functions are placeholders, enough to plan splits and
    cardinality (the dispatcher). With ``limits`` (a worker's limits and thread budget)
    every transformation, in its nodes' inputs and in the Datasets its functions return
    too, runs under them (``Op.limited``).
    """
    items = codec.decode(dataset.payloads, list(buffers)) if dataset.HasField("payloads") else []
    guard = None if permissions is None else (
        lambda pipe: from_def(*to_def(pipe), permissions, allow_cloudpickle, limits))
    return _Reader(items, permissions, allow_cloudpickle, guard, limits).pipeline(dataset)


class _Reader:
    """Builds the pipelines of one DatasetDef (and of its nodes' inputs) from its payloads."""

    def __init__(self, items: Any, permissions: WorkerPermissions | None,
                 allow_cloudpickle: bool, guard: ops.Guard | None,
                 limits: tuple[PipelineLimits, ThreadBudget] | None = None):
        self.items, self.permissions = items, permissions
        self.allow_cloudpickle, self.guard = allow_cloudpickle, guard
        self.limits = limits

    def payload(self, index: int) -> Any:
        if not isinstance(self.items, list) or index >= len(self.items):
            raise InvalidArgumentError(f"Malformed dataset: payload {index} is missing.")
        return self.items[index]

    def function(self, ref: FunctionRef, what: str) -> Callable[..., Any]:
        if self.permissions is None:
            return _unresolved
        if ref.pickled:
            return functions.unpickle_function(bytes(self.payload(ref.payload)),
                                               self.allow_cloudpickle, f"{ref.name} ({what})")
        return self.permissions.function(ref.name)

    def node(self, node: NodeDef) -> ops.Node:
        cls = ops.NODES.get(node.kind)
        params = self.payload(node.params)
        if cls is None or not isinstance(params, dict):
            raise InvalidArgumentError(f"Malformed dataset: unknown node {node.kind!r}.")
        fns = {}
        for ref in node.fns:
            field, sep, name = ref.name.partition("=")
            if not sep:
                raise InvalidArgumentError(f"Malformed dataset: function {ref.name!r} of "
                                           f"{node.kind!r} names no field.")
            named = FunctionRef()
            named.CopyFrom(ref)
            named.name = name
            fns[field] = self.function(named, f"{node.kind} {field}")
        inputs = tuple(self.pipeline(child) for child in node.inputs)
        try:
            built = cls.build(params, fns, inputs, self.guard, Dataset)
        except TypeError as err:
            raise InvalidArgumentError(f"Malformed dataset: {node.kind!r}: {err}") from None
        if self.permissions is not None:
            built.check_on_worker()
            if isinstance(built, formats.ReadsFiles):
                built = built.on_worker(self.permissions.readable_dirs)
        return built

    def pipeline(self, dataset: DatasetDef) -> pipeline.Pipeline:
        permissions = self.permissions
        kind = dataset.source.WhichOneof("kind")
        source: pipeline.Source
        if kind == "node":
            source = self.node(dataset.source.node)  # type: ignore[assignment]
            if not isinstance(source, pipeline.Source):
                raise InvalidArgumentError(
                    f"Malformed dataset: {dataset.source.node.kind!r} is not a source.")
        elif kind == "range":
            r = dataset.source.range
            source = pipeline.RangeSource(r.start, r.stop, r.step)
        elif kind == "slices":
            source = pipeline.SlicesSource(self.payload(dataset.source.slices.payload))
        elif kind == "files":
            paths = tuple(dataset.source.files.paths)
            if permissions is not None:
                paths = tuple(permissions.path(p) for p in paths)
            source = pipeline.FilesSource(paths)
        elif kind == "generator":
            g = dataset.source.generator
            source = pipeline.GeneratorSource(self.function(g.fn, "generator"),
                                              tuple(self.payload(g.args_payload)))
        else:
            raise InvalidArgumentError(f"Malformed dataset: unknown source {kind!r}.")
        return pipeline.Pipeline(source, tuple(self.op(op) for op in dataset.ops))

    def op(self, op: OpDef) -> pipeline.Op:
        if op.HasField("node"):
            node = self.node(op.node)
            if not isinstance(node, pipeline.Op):
                raise InvalidArgumentError(
                    f"Malformed dataset: {op.node.kind!r} is not a transformation.")
            built = node
        else:
            built = _op(op, self.function)
        return built if self.limits is None else built.limited(*self.limits)


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
