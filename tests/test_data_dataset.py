"""clusterwire.data.Dataset run locally (no service): sources, transformations, structure."""

from __future__ import annotations

import cw_data_functions as fns
import numpy as np
import pytest

from clusterwire import data, errors
from clusterwire.data import graph
from clusterwire.data.permissions import WorkerPermissions

pytestmark = pytest.mark.timeout(30)


def test_range_yields_int64_scalars_like_tf():
    values = list(data.Dataset.range(10).as_numpy_iterator())
    assert values == list(range(10))
    assert all(type(v) is np.int64 for v in values)
    assert list(data.Dataset.range(2, 11, 3)) == [2, 5, 8]
    assert list(data.Dataset.range(5, 0, -2)) == [5, 3, 1]


def test_from_tensor_slices_of_arrays_tuples_and_dicts():
    pairs = list(data.Dataset.from_tensor_slices((np.arange(3), np.arange(3) * 2.0)))
    assert [(int(a), float(b)) for a, b in pairs] == [(0, 0.0), (1, 2.0), (2, 4.0)]
    rows = list(data.Dataset.from_tensor_slices({"x": np.eye(2), "y": [7, 8]}))
    assert np.array_equal(rows[1]["x"], [0, 1]) and rows[1]["y"] == 8
    with pytest.raises(ValueError, match="same first dimension"):
        data.Dataset.from_tensor_slices((np.arange(3), np.arange(4)))


def test_from_files_reads_text_lines_as_bytes(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_bytes(b"one\ntwo\r\n")
    second.write_bytes(b"three")
    assert list(data.Dataset.from_files([str(first), str(second)])) == [b"one", b"two", b"three"]


def test_from_generator_with_args():
    assert list(data.Dataset.from_generator(fns.count_up, args=(3,))) == [0, 1, 2]


def test_map_filter_and_tuple_arguments():
    ds = data.Dataset.range(10).map(fns.square).filter(fns.is_even)
    assert list(ds) == [0, 4, 16, 36, 64]
    zipped = data.Dataset.from_tensor_slices((np.arange(4), np.arange(4))).map(fns.add)
    assert list(zipped) == [0, 2, 4, 6]


def test_parallel_map_keeps_order():
    ds = data.Dataset.range(200).map(fns.square, num_parallel_calls=data.AUTOTUNE)
    assert list(ds) == [x * x for x in range(200)]


def test_batch_unbatch_and_drop_remainder():
    batches = list(data.Dataset.range(7).batch(3))
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert len(list(data.Dataset.range(7).batch(3, drop_remainder=True))) == 2
    assert list(data.Dataset.range(7).batch(3).unbatch()) == list(range(7))
    structured = list(data.Dataset.from_tensor_slices(
        {"a": np.arange(4), "b": np.ones((4, 2))}).batch(2))
    assert structured[0]["b"].shape == (2, 2)


def test_shuffle_is_a_seeded_permutation():
    first = list(data.Dataset.range(50).shuffle(10, seed=3))
    again = list(data.Dataset.range(50).shuffle(10, seed=3))
    assert first == again and sorted(first) == list(range(50)) and first != list(range(50))


def test_take_skip_repeat_enumerate_prefetch():
    ds = data.Dataset.range(5)
    assert list(ds.take(2)) == [0, 1] and list(ds.skip(3)) == [3, 4]
    assert list(ds.take(-1)) == list(range(5)) and list(ds.skip(-1)) == []
    assert list(ds.repeat(2)) == [0, 1, 2, 3, 4] * 2
    assert list(ds.repeat().take(7)) == [0, 1, 2, 3, 4, 0, 1]
    assert [(int(i), int(v)) for i, v in ds.enumerate(10).take(2)] == [(10, 0), (11, 1)]
    assert list(ds.prefetch(2)) == list(range(5))


def test_cardinality():
    assert data.Dataset.range(10).batch(3).cardinality() == 4
    assert data.Dataset.range(10).repeat().cardinality() == data.INFINITE_CARDINALITY
    assert data.Dataset.range(10).filter(fns.is_even).cardinality() == data.UNKNOWN_CARDINALITY
    assert data.Dataset.range(10).repeat().take(3).cardinality() == 3


def test_apply_and_argument_checks():
    assert list(data.Dataset.range(3).apply(lambda d: d.map(fns.square))) == [0, 1, 4]
    with pytest.raises(ValueError, match="batch_size"):
        data.Dataset.range(3).batch(0)
    with pytest.raises(TypeError, match="must return a Dataset"):
        data.Dataset.range(3).apply(lambda d: 3)


def test_definition_round_trip_imports_functions_by_reference():
    ds = (data.Dataset.from_tensor_slices(np.arange(6)).map(fns.square).filter(fns.is_even)
          .batch(2).unbatch().shuffle(4, seed=1).take(5).skip(1).repeat(2).prefetch(1)
          .enumerate())
    definition, buffers = graph.to_def(ds.pipeline)
    assert definition.ops[0].map.fn.name == "cw_data_functions:square"
    rebuilt = graph.from_def(definition, buffers, WorkerPermissions())
    assert [(int(i), int(v)) for i, v in rebuilt.run()] == [
        (int(i), int(v)) for i, v in ds]


def test_lambda_needs_cloudpickle_and_is_refused_unless_allowed():
    pytest.importorskip("cloudpickle")
    ds = data.Dataset.range(3).map(lambda x: x + 1)
    definition, buffers = graph.to_def(ds.pipeline)
    assert definition.ops[0].map.fn.pickled
    with pytest.raises(errors.InvalidArgumentError, match="allow_cloudpickle"):
        graph.from_def(definition, buffers, WorkerPermissions(), allow_cloudpickle=False)
    assert list(graph.from_def(definition, buffers, WorkerPermissions(),
                               allow_cloudpickle=True).run()) == [1, 2, 3]


def test_a_worker_batch_stays_within_one_frames_buffer_limit():
    import threading

    from clusterwire.data import elements
    from clusterwire.data.streams import Stream
    from clusterwire.envelope import MAX_BUFFERS

    produced = threading.Event()

    def many_leaves():
        for n in range(1000):  # 100 arrays an element: 100,000 buffers in all
            yield {f"f{i}": np.full(2, n) for i in range(100)}
        produced.set()

    stream = Stream(many_leaves(), lambda e: elements.encode(e, ""))
    try:
        assert produced.wait(30)
        taken, end = stream.fetch("c", 1, max_elements=1000, max_bytes=1 << 30, wait=1.0)
        assert sum(len(e.buffers) for e in taken) <= MAX_BUFFERS
        assert len(taken) == MAX_BUFFERS // 100 and not end
        rest, end = stream.fetch("c", 2, max_elements=1000, max_bytes=1 << 30, wait=1.0)
        assert len(taken) + len(rest) == 1000 and end
    finally:
        stream.close()
