"""The base of ``clusterwire.data.ops``: ``Node`` (how a source or transformation travels
to workers, see the package docstring), the ``register`` of node kinds, and the field makers
and argument checks the node modules share. It imports no node module, so they all import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from clusterwire.data.pipeline import Pipeline, Source
from clusterwire.errors import InvalidArgumentError

#: What a worker applies to a pipeline a user function returned (identity locally).
Guard = Callable[[Pipeline], Pipeline]

_FN = "fn"
#: Fields not sent as argument values: the inputs (sent as pipelines), what the builder
#: gives (see ``Node.build``), what ``Op.limited`` sets there and the readable dirs a worker
#: gives a file format's read.
_SKIPPED = ("inputs", "guard", "dataset_type", "budget", "limits", "readable")

NODES: dict[str, type[Node]] = {}


def fn_field(optional: bool = False) -> Any:
    """A dataclass field holding a user function (None allowed when ``optional``)."""
    if optional:
        return dataclasses.field(default=None, metadata={_FN: True})
    return dataclasses.field(metadata={_FN: True})


def guard_field() -> Any:
    """The field where a worker's Guard goes (None: run what a function returns as is)."""
    return dataclasses.field(default=None, compare=False, repr=False)


def dataset_type_field() -> Any:
    """The field where the builder puts the Dataset class: a node whose elements are
    Datasets (a window) makes them with it, as ``dataset_type(source)``. It is given, not
    imported, because that class builds the nodes and so sits above them."""
    return dataclasses.field(kw_only=True, compare=False, repr=False)


def no_guard(pipe: Pipeline) -> Pipeline:
    return pipe


def count(value: Any, name: str, fix: str, minimum: int = 1, allow: tuple[int, ...] = ()
          ) -> int:
    """``value`` as an int >= ``minimum`` (or one of ``allow``); else InvalidArgumentError
    naming the argument ``name`` and the ``fix``."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and (
            value >= minimum or value in allow):
        return int(value)
    raise InvalidArgumentError(f"`{name}` must be an int >= {minimum}, got {value!r}. {fix}")


class Node:
    """A source or transformation that travels as a ``NodeDef`` (see the module docstring)."""

    kind: ClassVar[str]

    def params(self) -> dict[str, Any]:
        """The arguments sent as values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore
                if f.name not in _SKIPPED and not f.metadata.get(_FN)}

    def functions(self) -> dict[str, Callable[..., Any]]:
        """The user functions set, by field name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore
                if f.metadata.get(_FN) and getattr(self, f.name) is not None}

    def inputs_of(self) -> tuple[Pipeline, ...]:
        """The pipelines this node reads."""
        return tuple(getattr(self, "inputs", ()))

    def _count(self, name: str, fix: str, minimum: int = 1, allow: tuple[int, ...] = ()
               ) -> None:
        """Check field ``name`` (see ``count``): nodes check their arguments where they
        are made, so a worker checks a client's as the client's own Dataset call did."""
        object.__setattr__(self, name, count(getattr(self, name), name, fix, minimum, allow))

    def check_on_worker(self) -> None:
        """Raise if a worker must not run this node as the client sent it."""

    @classmethod
    def build(cls, params: dict[str, Any], fns: dict[str, Callable[..., Any]],
              inputs: tuple[Pipeline, ...], guard: Guard | None,
              dataset_type: Callable[[Source], Any]) -> Node:
        """The node of a NodeDef: its ``params`` and ``fns``, and what the builder gives to
        the nodes with a field for it: ``inputs``, the worker's ``guard`` and
        ``dataset_type`` (the Dataset class, for the nodes whose elements are Datasets)."""
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        names = {f.name for f in fields}
        fn_names = {f.name for f in fields if f.metadata.get(_FN)}
        if set(params) & (fn_names | set(_SKIPPED)) or not set(fns) <= fn_names:
            raise InvalidArgumentError(
                f"Malformed dataset: {cls.kind!r} gets functions {sorted(fns)} and arguments "
                f"{sorted(params)}.")
        given = {"inputs": inputs, "guard": guard, "dataset_type": dataset_type}
        return cls(**params, **fns, **{k: v for k, v in given.items() if k in names})


def register(cls: type[Node]) -> type[Node]:
    """Make ``cls`` known to graph.from_def under ``cls.kind``."""
    NODES[cls.kind] = cls
    return cls

