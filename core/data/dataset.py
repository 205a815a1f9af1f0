"""``clusterwire.data.Dataset``: tf.data's Dataset API over numpy pipelines.

A Dataset is an immutable description (a source plus transformations, some of which read
other Datasets: ``zip``, ``concatenate``, ``interleave``... see ``clusterwire.data.ops``); it
runs locally when iterated, or on tf.data service workers after
``apply(distribute(...))``. Elements are numpy arrays and scalars, bytes,
tuples and dicts of these. User functions must be importable module-level
functions to run on workers (see ``clusterwire.data.functions``).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from clusterwire.data import file_datasets, pipeline
from clusterwire.data.ops import batching, global_shuffle, nested, sources, stateful
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
from clusterwire.data.splits import RECORD_BLOCK_BYTES
from clusterwire.errors import InvalidArgumentError


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


def _datasets(structure: Any, name: str) -> tuple[Any, list[Pipeline]]:
    """(``structure`` with each Dataset replaced by its index, the Datasets' pipelines)."""
    pipes: list[Pipeline] = []

    def index(part: Any) -> Any:
        if isinstance(part, Dataset):
            pipes.append(part.pipeline)
            return len(pipes) - 1
        if isinstance(part, tuple):
            return tuple(index(p) for p in part)
        if isinstance(part, dict):
            return {k: index(v) for k, v in part.items()}
        fix = " Use a tuple instead of a list." if isinstance(part, list) else ""
        raise InvalidArgumentError(
            f"`{name}` must be a Dataset or a (nested) tuple or dict of Datasets; it holds "
            f"{type(part).__name__}.{fix}")
    return index(structure), pipes


def _function(fn: Any, name: str) -> Any:
    if not callable(fn):
        raise InvalidArgumentError(f"`{name}` must be callable, got {fn!r:.80}.")
    return fn


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


def _values(padding_values: Any) -> Any:
    return None if padding_values is None else pipeline.normalize(padding_values)


def _shapes(padded_shapes: Any) -> Any:
    """``padded_shapes`` with each shape a list (tuples and dicts are structure)."""
    if padded_shapes is None or isinstance(padded_shapes, list):
        return padded_shapes
    if isinstance(padded_shapes, tuple):
        return tuple(_shapes(s) for s in padded_shapes)
    if isinstance(padded_shapes, dict):
        return {k: _shapes(v) for k, v in padded_shapes.items()}
    if isinstance(padded_shapes, np.ndarray):
        return padded_shapes.tolist()
    raise InvalidArgumentError(f"`padded_shapes` takes a list of sizes (None: the largest) per "
                               f"component, got {padded_shapes!r:.80}.")


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
    def list_files(file_pattern: Any, shuffle: bool | None = None,
                   seed: int | None = None) -> Dataset:
        """The file names matching a glob (or a list of globs; see
        ``file_datasets.list_files``), sorted, then shuffled unless ``shuffle=False`` (a new
        order each epoch, fixed by ``seed``), as ``tf.data.Dataset.list_files``."""
        names = _dataset(file_datasets.list_files(file_pattern))
        return names if shuffle is False else names.shuffle(names.cardinality(), seed=seed)

    @staticmethod
    def from_parquet(paths: Any, columns: Sequence[str] | None = None,
                     batch_rows: int | None = None) -> Dataset:
        """The rows of Parquet files; a row group is a split (``file_datasets.from_parquet``)."""
        return _dataset(file_datasets.from_parquet(paths, columns, batch_rows))

    @staticmethod
    def from_tar_shards(paths: Any, indexed: bool = False) -> Dataset:
        """The samples of WebDataset tar shards; a shard is a split; ``indexed=True`` counts
        their samples for ``global_shuffle`` (``file_datasets.from_tar_shards``)."""
        return _dataset(file_datasets.from_tar_shards(paths, indexed))

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        """One element: ``tensors`` (arrays, tuples and dicts of them) as numpy."""
        return Dataset(sources.TensorsSource(pipeline.normalize(tensors)))

    @staticmethod
    def counter(start: int = 0, step: int = 1, dtype: Any = np.int64) -> Dataset:
        """``start``, ``start + step``, ... forever, of ``dtype``."""
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)  # refused by CounterSource, which names `dtype`
        return Dataset(sources.CounterSource(_int(start, "start"), _int(step, "step"), name))

    @staticmethod
    def zip(*args: Any, datasets: Any = None) -> Dataset:
        """The elements of ``datasets`` (a tuple or dict of Datasets, nested or not; or the
        Datasets as arguments) side by side, until the shortest ends."""
        if datasets is not None and args:
            raise InvalidArgumentError("zip takes its Datasets as arguments or as "
                                       "`datasets`, not both.")
        if datasets is None:
            if not args:
                raise InvalidArgumentError("zip needs Datasets: zip(a, b) or "
                                           "zip(datasets=(a, b)).")
            datasets = args[0] if len(args) == 1 else tuple(args)
        structure, pipes = _datasets(datasets, "datasets")
        return Dataset(sources.ZipSource(structure, tuple(pipes)))

    @staticmethod
    def choose_from_datasets(datasets: Sequence[Dataset], choice_dataset: Dataset,
                             stop_on_empty_dataset: bool = True) -> Dataset:
        """The next element of ``datasets[i]`` for each ``i`` (an int64 scalar) of
        ``choice_dataset``; a chosen Dataset that has ended ends this one with
        ``stop_on_empty_dataset``, else its choices are skipped."""
        _, pipes = _datasets(tuple(datasets), "datasets")
        if not isinstance(choice_dataset, Dataset):
            raise InvalidArgumentError(f"`choice_dataset` must be a Dataset of int64 scalars, "
                                       f"got {type(choice_dataset).__name__}.")
        return Dataset(sources.ChooseSource(bool(stop_on_empty_dataset),
                                            (choice_dataset.pipeline, *pipes)))

    @staticmethod
    def sample_from_datasets(datasets: Sequence[Dataset], weights: Sequence[float] | None = None,
                             seed: int | None = None, stop_on_empty_dataset: bool = False,
                             rerandomize_each_iteration: bool | None = None) -> Dataset:
        """Each element from one of ``datasets`` drawn at random with ``weights`` (default:
        uniform); a ``seed`` fixes the draws. An ended Dataset is skipped from then on (or,
        with ``stop_on_empty_dataset``, ends this one)."""
        _, pipes = _datasets(tuple(datasets), "datasets")
        try:
            chosen = (1.0,) * len(pipes) if weights is None else tuple(float(w) for w in weights)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"`weights` must be a list of numbers, one per Dataset, "
                                       f"got {weights!r}.") from None
        return Dataset(sources.SampleSource(
            tuple(chosen), None if seed is None else _int(seed, "seed"),
            bool(stop_on_empty_dataset), bool(rerandomize_each_iteration), tuple(pipes)))

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

    def global_shuffle(self, seed: int | None = None, reshuffle_each_iteration: bool = True
                       ) -> Dataset:
        """All elements in the order of a permutation fixed by ``seed`` and the epoch (a new
        one each iteration with ``reshuffle_each_iteration``), the same however many workers
        and consumers read it; no buffer. The input must be random-access (``range`` or
        ``from_tensor_slices``, then only ``map``, ``prefetch``, ``take``, ``skip``); a
        ``seed`` of None is drawn once, here (see ``clusterwire.data.ops.global_shuffle``)."""
        chosen = secrets.randbelow(2 ** 63) if seed is None else seed
        return Dataset(global_shuffle.GlobalShuffleSource(chosen, reshuffle_each_iteration,
                                                          (self._pipeline,)))

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

    def concatenate(self, dataset: Dataset) -> Dataset:
        """This dataset's elements, then ``dataset``'s."""
        if not isinstance(dataset, Dataset):
            raise InvalidArgumentError(f"`dataset` must be a Dataset, got "
                                       f"{type(dataset).__name__}.")
        return self._with(nested.Concatenate((dataset.pipeline,)))

    def flat_map(self, map_func: Callable[..., Dataset]) -> Dataset:
        """The elements of the Dataset ``map_func`` returns for each element, in order."""
        return self._with(nested.FlatMap(_function(map_func, "map_func")))

    def interleave(self, map_func: Callable[..., Dataset], cycle_length: int | None = None,
                   block_length: int | None = None, num_parallel_calls: int | None = None,
                   deterministic: bool | None = None) -> Dataset:
        """The Datasets ``map_func`` returns, ``cycle_length`` open at once (None: the CPU
        count), ``block_length`` (None: 1) elements from each in turn. With
        ``num_parallel_calls`` (an int or AUTOTUNE) threads read ahead of the consumer;
        ``deterministic=False`` lets a ready Dataset go before a slower one."""
        cycle = pipeline.AUTOTUNE if cycle_length is None else cycle_length
        block = 1 if block_length is None else block_length
        parallel = 0 if num_parallel_calls is None else num_parallel_calls
        return self._with(nested.Interleave(cycle, block, parallel, deterministic is not False,
                                            _function(map_func, "map_func")))

    def padded_batch(self, batch_size: int, padded_shapes: Any = None,
                     padding_values: Any = None, drop_remainder: bool = False) -> Dataset:
        """Batches of ``batch_size`` whose components are padded to ``padded_shapes`` (per
        component a list of sizes, None or -1 for the batch's largest; None: the largest in
        every dimension) with ``padding_values`` (default 0, b"" or False)."""
        return self._with(batching.PaddedBatch(batch_size, _shapes(padded_shapes),
                                               _values(padding_values),
                                               bool(drop_remainder)))

    def bucket_by_sequence_length(
            self, element_length_func: Callable[..., Any], bucket_boundaries: Sequence[int],
            bucket_batch_sizes: Sequence[int], padded_shapes: Any = None,
            padding_values: Any = None, pad_to_bucket_boundary: bool = False,
            no_padding: bool = False, drop_remainder: bool = False) -> Dataset:
        """Elements grouped into buckets by ``element_length_func``'s length (bucket ``i``:
        ``bucket_boundaries[i-1] <= length < bucket_boundaries[i]``), batched
        ``bucket_batch_sizes[i]`` at a time and padded (see ``padded_batch``)."""
        return self._with(batching.BucketBySequenceLength(
            tuple(bucket_boundaries), tuple(bucket_batch_sizes), _shapes(padded_shapes),
            _values(padding_values), bool(pad_to_bucket_boundary), bool(no_padding),
            bool(drop_remainder), _function(element_length_func, "element_length_func")))

    def rebatch(self, batch_size: int | Sequence[int], drop_remainder: bool = False
                ) -> Dataset:
        """The rows of this dataset's batches in batches of ``batch_size`` (or of the sizes
        of a list, in turn): what ``unbatch().batch(batch_size)`` gives, without the copies."""
        sizes = tuple(batch_size) if isinstance(batch_size, (list, tuple, np.ndarray)) \
            else (batch_size,)
        return self._with(batching.Rebatch(sizes, bool(drop_remainder)))

    def window(self, size: int, shift: int | None = None, stride: int = 1,
               drop_remainder: bool = False) -> Dataset:
        """Windows of ``size`` elements, ``stride`` apart, starting every ``shift`` (default
        ``size``) elements; each a Dataset (a structure of Datasets for structured
        elements), for ``flat_map(lambda w: w.batch(size))`` and the like."""
        return self._with(batching.Window(size, size if shift is None else shift, stride,
                                          bool(drop_remainder), dataset_type=Dataset))

    def group_by_window(self, key_func: Callable[..., Any],
                        reduce_func: Callable[[Any, Dataset], Dataset],
                        window_size: int | None = None,
                        window_size_func: Callable[[Any], Any] | None = None) -> Dataset:
        """Elements grouped by ``key_func`` (an int64); each full window of a group
        (``window_size``, or ``window_size_func(key)``; at the end, what is left) becomes
        the elements of ``reduce_func(key, window_dataset)``."""
        return self._with(batching.GroupByWindow(
            0 if window_size is None else window_size, _function(key_func, "key_func"),
            _function(reduce_func, "reduce_func"),
            None if window_size_func is None else _function(window_size_func,
                                                            "window_size_func"),
            dataset_type=Dataset))

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element, from the ``index``-th."""
        return self._with(stateful.Shard(num_shards, index))

    def scan(self, initial_state: Any, scan_func: Callable[[Any, Any], tuple[Any, Any]]
             ) -> Dataset:
        """``scan_func(state, element)`` -> ``(new_state, output)``, from ``initial_state``."""
        return self._with(stateful.Scan(pipeline.normalize(initial_state),
                                        _function(scan_func, "scan_func")))

    def take_while(self, predicate: Callable[..., Any]) -> Dataset:
        """The elements until ``predicate`` is first false."""
        return self._with(stateful.TakeWhile(_function(predicate, "predicate")))

    def unique(self) -> Dataset:
        """Each distinct element (int or string scalars) once, in first-seen order."""
        return self._with(stateful.Unique())

    def cache(self, filename: str = "") -> Dataset:
        """Keep the first complete pass (in memory; or in the file ``filename``, kept for
        later runs) and replay it on later passes (e.g. after ``repeat``)."""
        if not isinstance(filename, (str, os.PathLike)):
            raise InvalidArgumentError(f"`filename` must be a path or '', got {filename!r}.")
        return self._with(stateful.Cache(os.fspath(filename)))

    def ignore_errors(self, log_warning: bool = False) -> Dataset:
        """Leave out the elements whose making raised (logging them with ``log_warning``)."""
        return self._with(stateful.IgnoreErrors(bool(log_warning)))

    def with_element_ids(self) -> Dataset:
        """``(id, element)`` pairs, locally: each element with the stable id of its source
        element (a batch: the list of its rows'), the ids ``distribute(...,
        element_ids=True)`` gives (see ``clusterwire.data.provenance``); InvalidArgumentError
        naming a transformation through which ids are not defined."""
        from clusterwire.data import provenance  # its rules load only for element ids

        return _dataset(provenance.with_public_ids(self._pipeline))

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


def _dataset(pipe: Pipeline) -> Dataset:
    return Dataset(pipe.source, pipe.ops)


def TFRecordDataset(filenames: Any, compression_type: str | None = None,  # noqa: N802 - TF's name
                    buffer_size: int | None = None,
                    num_parallel_reads: int | None = None, *,
                    index_filenames: Any = None,
                    block_bytes: int = RECORD_BLOCK_BYTES) -> Dataset:
    """The records (bytes) of TFRecord files, as ``tf.data.TFRecordDataset``.

    ``filenames``: a file name, a list of them, or a Dataset of names (``list_files``'s).
    ``compression_type``: None (or ""), "GZIP" or "ZLIB". ``buffer_size``: bytes read at a
    time (None: 256 KiB). ``num_parallel_reads``: None reads the files one after the other;
    N (or AUTOTUNE) reads N at once, interleaving their records one at a time in TF's order.
    A damaged record is DataLossError naming the file and offset, where the consumer reads.

    ``index_filenames`` (clusterwire's; uncompressed files named in a list): the files'
    indexes (``clusterwire.data.tfrecord``'s format), one per file, or True for
    ``<file>.idx``. They are read here, and distributed_epoch then hands out blocks of records
    (about ``block_bytes`` each) of one file per split, not whole files (a split's records
    in file order, whatever ``num_parallel_reads``).
    """
    return _dataset(file_datasets.tfrecords(filenames, compression_type, buffer_size,
                                            num_parallel_reads, index_filenames, block_bytes))
