"""Sources: ``from_tensors``, ``counter``, ``zip``, ``choose_from_datasets``,
``sample_from_datasets`` and the elements of one ``window``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from clusterwire.data.ops.base import Node, register
from clusterwire.data.pipeline import INFINITE, UNKNOWN, Pipeline, Source
from clusterwire.errors import InvalidArgumentError


@register
@dataclass(frozen=True)
class TensorsSource(Node, Source):
    """``Dataset.from_tensors``: one element."""

    kind = "tensors"
    tensors: Any

    def cardinality(self) -> int:
        return 1

    def iterate(self) -> Iterator[Any]:
        yield self.tensors


@register
@dataclass(frozen=True)
class ElementsSource(Node, Source):
    """The elements of one window of ``Dataset.window`` (one component of them)."""

    kind = "elements"
    elements: list

    def cardinality(self) -> int:
        return len(self.elements)

    def iterate(self) -> Iterator[Any]:
        return iter(self.elements)


@register
@dataclass(frozen=True)
class CounterSource(Node, Source):
    """``Dataset.counter``: ``start``, ``start + step``, ... forever."""

    kind = "counter"
    start: int
    step: int
    dtype: str

    def __post_init__(self) -> None:
        try:
            kind = np.dtype(self.dtype)
        except TypeError:
            kind = np.dtype(object)
        if kind.kind not in "iuf":
            raise InvalidArgumentError(f"`dtype` of counter must be numeric, got "
                                       f"{self.dtype!r}.")
        object.__setattr__(self, "dtype", kind.name)

    def cardinality(self) -> int:
        return INFINITE

    def iterate(self) -> Iterator[Any]:
        dtype = np.dtype(self.dtype)
        return (dtype.type(v) for v in itertools.count(self.start, self.step))


def pack(structure: Any, values: list[Any]) -> Any:
    """``structure`` (tuples/dicts whose leaves are indices into ``values``) filled in."""
    if isinstance(structure, tuple):
        return tuple(pack(s, values) for s in structure)
    if isinstance(structure, dict):
        return {k: pack(v, values) for k, v in structure.items()}
    return values[structure]


class _Recorder:
    """Stands for the values in ``pack``: records the indices a structure names."""

    def __init__(self, used: list[Any]):
        self.used = used

    def __getitem__(self, index: Any) -> None:
        self.used.append(index)


def _min_cardinality(counts: list[int]) -> int:
    finite = [c for c in counts if c >= 0]
    if finite:
        return min(finite) if UNKNOWN not in counts or min(finite) == 0 else UNKNOWN
    return UNKNOWN if UNKNOWN in counts else INFINITE


class _Reads:
    """A source reading ``inputs``: their iterator factories are made once, so what they
    keep (a reshuffling shuffle's epoch, a cache) carries from one pass to the next (as
    TF's ops keep theirs for the dataset's lifetime)."""

    inputs: tuple[Pipeline, ...]

    def __post_init__(self) -> None:
        self.check_inputs()
        object.__setattr__(self, "_factories", tuple(p.factory() for p in self.inputs))

    def check_inputs(self) -> None:
        """Raise InvalidArgumentError if the inputs do not fit the other arguments."""

    def opened(self) -> list[Iterator[Any]]:
        """An iterator of each input, for one pass."""
        return [make() for make in self._factories]  # type: ignore[attr-defined]


@register
@dataclass(frozen=True)
class ZipSource(_Reads, Node, Source):
    """``Dataset.zip``: the elements of ``inputs`` side by side in ``structure`` (tuples and
    dicts whose leaves index ``inputs``), until the shortest ends."""

    kind = "zip"
    structure: Any
    inputs: tuple[Pipeline, ...] = ()

    def check_inputs(self) -> None:
        used: list[Any] = []
        pack(self.structure, _Recorder(used))
        if sorted(used) != list(range(len(self.inputs))):
            raise InvalidArgumentError(
                f"zip: the structure {self.structure!r:.100} does not name each of its "
                f"{len(self.inputs)} datasets once.")

    def cardinality(self) -> int:
        return _min_cardinality([p.cardinality() for p in self.inputs])

    def iterate(self) -> Iterator[Any]:
        iterators = self.opened()
        while True:
            values = []
            for iterator in iterators:
                try:
                    values.append(next(iterator))
                except StopIteration:
                    return
            yield pack(self.structure, values)


def _index(choice: Any, count: int) -> int:
    array = np.asarray(choice)
    if array.shape != () or array.dtype != np.int64:
        raise InvalidArgumentError(
            f"choose_from_datasets: `choice_dataset` must produce int64 scalars, got "
            f"{array.dtype}{list(array.shape)}.")
    index = int(array)
    if not 0 <= index < count:
        raise InvalidArgumentError(
            f"choose_from_datasets: `choice_dataset` chose dataset {index}, but there are "
            f"{count} datasets (valid choices: 0 to {count - 1}).")
    return index


def _directed_cardinality(inputs: tuple[Pipeline, ...]) -> int:
    # TF's DirectedInterleave: infinite as soon as one data input is, even when the choices
    # end (choose_from_datasets over repeat()ed inputs with 9 choices: INFINITE); else unknown.
    counts = [p.cardinality() for p in inputs]
    return INFINITE if INFINITE in counts else UNKNOWN


def _directed(choices: Iterator[int], iterators: list[Iterator[Any] | None],
              stop_on_empty: bool) -> Iterator[Any]:
    """The next element of the input each choice names; an input that has ended ends it
    all with ``stop_on_empty``, else it is skipped from then on (TF's directed interleave)."""
    live = len(iterators)
    for index in choices:
        iterator = iterators[index]
        if iterator is None:
            continue
        try:
            yield next(iterator)
        except StopIteration:
            if stop_on_empty:
                return
            iterators[index] = None
            live -= 1
            if not live:
                return


@register
@dataclass(frozen=True)
class ChooseSource(_Reads, Node, Source):
    """``Dataset.choose_from_datasets``: ``inputs[0]`` chooses among ``inputs[1:]``."""

    kind = "choose"
    stop_on_empty_dataset: bool
    inputs: tuple[Pipeline, ...] = ()

    def check_inputs(self) -> None:
        if len(self.inputs) < 2:
            raise InvalidArgumentError("choose_from_datasets needs at least one Dataset in "
                                       "`datasets`.")

    def cardinality(self) -> int:
        return _directed_cardinality(self.inputs[1:])

    def iterate(self) -> Iterator[Any]:
        choice, *inputs = self.opened()
        choices = (_index(c, len(inputs)) for c in choice)
        return _directed(choices, list(inputs), self.stop_on_empty_dataset)


@register
@dataclass(frozen=True)
class SampleSource(_Reads, Node, Source):
    """``Dataset.sample_from_datasets``: each element from an input drawn with ``weights``;
    a ``seed`` fixes the draws (per epoch with ``rerandomize_each_iteration``)."""

    kind = "sample"
    weights: tuple[float, ...]
    seed: int | None
    stop_on_empty_dataset: bool
    rerandomize_each_iteration: bool
    inputs: tuple[Pipeline, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_epochs", itertools.count())  # shared by its iterators

    def check_inputs(self) -> None:
        weights = self.weights
        if not self.inputs or not isinstance(weights, (tuple, list)) or len(weights) != len(
                self.inputs) or not all(isinstance(w, float) and w >= 0 for w in weights) or (
                sum(weights) <= 0):
            raise InvalidArgumentError(
                f"`weights` must be one non-negative weight per Dataset ({len(self.inputs)}) "
                f"with a positive sum, got {weights!r}.")

    def cardinality(self) -> int:
        return _directed_cardinality(self.inputs)

    def iterate(self) -> Iterator[Any]:
        epoch = next(self._epochs) if self.rerandomize_each_iteration else 0  # type: ignore
        rng = np.random.default_rng(None if self.seed is None else [self.seed, epoch])
        probabilities = np.asarray(self.weights, np.float64) / np.sum(self.weights)

        def choices() -> Iterator[int]:
            while True:
                yield from (int(i) for i in rng.choice(len(probabilities), 256, p=probabilities))
        return _directed(choices(), list(self.opened()), self.stop_on_empty_dataset)

