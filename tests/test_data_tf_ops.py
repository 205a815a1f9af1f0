"""tf.data's sources and transformations, element for element against TensorFlow 2.21.

The expected elements were produced by TF itself (tests/fixtures/tf_ops/make_expected.py
builds the same pipelines in tf.data); CI needs no TensorFlow. Each case runs locally,
through a DatasetDef round trip (what a worker builds), and a subset through the service.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import threading

import cw_tf_ops_functions as fns
import numpy as np
import pytest
from conftest import child_env, in_process_data_service, wait_for

from clusterwire import data, errors
from clusterwire.data import graph
from clusterwire.data.permissions import WorkerPermissions

pytestmark = pytest.mark.timeout(60)

D = data.Dataset
_FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tf_ops", "expected.json")
with open(_FIXTURE) as _handle:
    EXPECTED = json.load(_handle)["cases"]


def _interleave(cycle, block, parallel, deterministic=None):
    return lambda: D.range(1, 7).interleave(fns.repeat_self, cycle_length=cycle,
                                            block_length=block, num_parallel_calls=parallel,
                                            deterministic=deterministic)


CASES = {
    "from_tensors_tuple": lambda: D.from_tensors((np.arange(3), b"x", 2.5)),
    "from_tensors_dict": lambda: D.from_tensors({"a": [[1, 2]], "b": np.float32(3)}),
    "zip_tuple": lambda: D.zip((D.range(5), D.range(10, 13))),
    "zip_dict": lambda: D.zip({"a": D.range(3),
                               "b": D.from_tensor_slices([[1, 2], [3, 4], [5, 6]])}),
    "zip_nested": lambda: D.zip((D.range(3), (D.range(4).map(fns.times_two),
                                              D.from_tensor_slices([b"a", b"b", b"c"])))),
    "zip_varargs": lambda: D.zip(D.range(3), D.range(5, 9)),
    "concatenate": lambda: D.range(3).concatenate(D.range(10, 12)),
    "concatenate_tuple": lambda: D.zip((D.range(2), D.range(2))).concatenate(
        D.zip((D.range(5, 6), D.range(7, 8)))),
    "counter": lambda: D.counter(5, 2).take(4),
    "counter_default": lambda: D.counter().take(3),
    "flat_map": lambda: D.range(5).flat_map(fns.ranges),
    "flat_map_slices": lambda: D.from_tensor_slices([[1, 2], [3, 4]]).flat_map(fns.slices),
    "interleave_c2_b4_pNone": _interleave(2, 4, None),
    "interleave_c3_b1_pNone": _interleave(3, 1, None),
    "interleave_c3_b2_p2": _interleave(3, 2, 2),
    "interleave_c4_b3_p-1": _interleave(4, 3, data.AUTOTUNE),
    "interleave_c1_b2_pNone": _interleave(1, 2, None),
    "interleave_c5_b1_p3": _interleave(5, 1, 3),
    "interleave_nondeterministic": _interleave(3, 2, 3, deterministic=False),
    "interleave_empty_c2_b2_pNone": lambda: D.range(6).interleave(
        fns.range_mod_3, cycle_length=2, block_length=2),
    "interleave_empty_c2_b2_p2": lambda: D.range(6).interleave(
        fns.range_mod_3, cycle_length=2, block_length=2, num_parallel_calls=2),
    "interleave_empty_c3_b1_p3": lambda: D.range(6).interleave(
        fns.range_mod_3, cycle_length=3, block_length=1, num_parallel_calls=3),
    "flat_map_empty": lambda: D.range(5).flat_map(fns.range_mod_2),
    "concatenate_empty_first": lambda: D.range(0).concatenate(D.range(3)),
    "zip_with_counter": lambda: D.zip((D.counter(10, -3), D.range(4))),
    "counter_int32": lambda: D.counter(2, 5, dtype=np.int32).take(3),
    "take_while_tuple": lambda: D.zip((D.range(10), D.range(10, 20))).take_while(
        fns.sum_below_16),
    "padded_batch_strings_bools": lambda: D.range(1, 4).map(fns.fill_strings_bools)
    .padded_batch(2),
    "window_drop_shift_beyond": lambda: D.range(11).window(2, 4, 2, True).flat_map(fns.batch_2),
    "bucket_no_padding": lambda: D.from_tensor_slices(
        np.array([5, 1, 2, 7, 3, 6])).bucket_by_sequence_length(
        element_length_func=fns.identity, bucket_boundaries=[3], bucket_batch_sizes=[2, 2],
        no_padding=True),
    "rebatch_tuple": lambda: D.zip((D.range(7), D.range(7).map(fns.as_string))).batch(3)
    .rebatch(2),
    "scan_output_tuple": lambda: D.range(4).scan(np.int64(10), fns.scan_pairs),
    "unique_dict": lambda: D.from_tensor_slices({"a": [3, 1, 3, 2]}).unique(),
    "unique_after_map": lambda: D.range(12).map(fns.mod_4).unique(),
    "interleave_ignore_errors_pNone": lambda: D.range(3).interleave(
        fns.inner_reciprocals, cycle_length=2, block_length=2).ignore_errors(),
    "interleave_ignore_errors_p2": lambda: D.range(3).interleave(
        fns.inner_reciprocals, cycle_length=2, block_length=2, num_parallel_calls=2
    ).ignore_errors(),
    "interleave_open_errors_pNone": lambda: D.range(6).interleave(
        fns.reciprocal_of_x_mod_3_minus_1, cycle_length=2, block_length=1).ignore_errors(),
    "interleave_open_errors_p2": lambda: D.range(6).interleave(
        fns.reciprocal_of_x_mod_3_minus_1, cycle_length=2, block_length=1,
        num_parallel_calls=2).ignore_errors(),
    "interleave_long_blocks_pNone": lambda: D.range(1, 5).interleave(
        fns.range_times_7, cycle_length=2, block_length=10),
    "interleave_long_blocks_p2": lambda: D.range(1, 5).interleave(
        fns.range_times_7, cycle_length=2, block_length=10, num_parallel_calls=2),
    "flat_map_open_error_ignored": lambda: D.range(4).flat_map(
        fns.reciprocal_of_x_minus_2).ignore_errors(),
    "padded_batch": lambda: D.range(1, 8).map(fns.fill).padded_batch(3),
    "padded_batch_shapes_values": lambda: D.range(1, 6).map(fns.fill).padded_batch(
        2, padded_shapes=[6], padding_values=np.int64(-1), drop_remainder=True),
    "padded_batch_tuple": lambda: D.range(1, 5).map(fns.fill_tuple).padded_batch(
        3, padded_shapes=([None], [4, None], []), padding_values=(np.int64(7), b"-", 0)),
    "padded_batch_dict": lambda: D.range(1, 5).map(fns.fill_dict).padded_batch(
        2, padding_values={"v": np.int64(-1), "f": np.float32(0.5)}),
    "shard": lambda: D.range(10).shard(3, 1),
    "shard_0": lambda: D.range(10).shard(3, 0),
    "scan": lambda: D.range(6).scan(np.int64(0), fns.scan_sum),
    "scan_tuple_state": lambda: D.range(1, 6).scan((np.int64(0), np.int64(1)),
                                                   fns.scan_tuple_state),
    "scan_tuple_element": lambda: D.zip((D.range(4), D.range(4))).scan(
        np.int64(1), fns.scan_tuple_element),
    "take_while": lambda: D.range(10).take_while(fns.below_five),
    "unique": lambda: D.from_tensor_slices([1, 1, 2, 4, 2, 1, 5]).unique(),
    "unique_strings": lambda: D.from_tensor_slices([b"b", b"a", b"b", b"c", b"a"]).unique(),
    "choose_from_datasets": lambda: D.choose_from_datasets(
        [D.from_tensors(b"foo").repeat(), D.from_tensors(b"bar").repeat(),
         D.from_tensors(b"baz").repeat()], D.range(3).repeat(3)),
    "choose_stop_on_empty": lambda: D.choose_from_datasets(
        [D.range(2), D.range(10, 20)], D.from_tensor_slices(np.array([0, 1, 0, 0, 1]))),
    "choose_skip_empty": lambda: D.choose_from_datasets(
        [D.range(2), D.range(10, 20)], D.from_tensor_slices(np.array([0, 1, 0, 0, 1])),
        stop_on_empty_dataset=False),
    "window": lambda: D.range(7).window(3, 2, 1, True).flat_map(fns.batch_3),
    "window_keep_remainder": lambda: D.range(7).window(3).flat_map(fns.batch_3),
    "window_stride": lambda: D.range(10).window(3, 1, 2, False).flat_map(fns.batch_3),
    "window_shift_beyond_size": lambda: D.range(10).window(2, 3).flat_map(fns.batch_2),
    "window_tuple": lambda: D.zip((D.range(5), D.range(10, 15))).window(2).flat_map(
        fns.zip_batch_2),
    "group_by_window": lambda: D.range(10).group_by_window(
        key_func=fns.mod_3, reduce_func=fns.batch_10, window_size=2),
    "group_by_window_size_func": lambda: D.range(20).group_by_window(
        key_func=fns.mod_2, reduce_func=fns.batch_10, window_size_func=fns.twice_plus_3),
    "bucket_by_sequence_length": lambda: D.from_tensor_slices(
        np.array([5, 1, 2, 7, 3, 6, 1, 4, 2, 8])).map(fns.fill).bucket_by_sequence_length(
        element_length_func=fns.length, bucket_boundaries=[3, 6], bucket_batch_sizes=[2, 2, 3]),
    "bucket_pad_to_boundary": lambda: D.from_tensor_slices(
        np.array([5, 1, 2, 3, 4, 1, 4, 2, 5])).map(fns.fill).bucket_by_sequence_length(
        element_length_func=fns.length, bucket_boundaries=[3, 6], bucket_batch_sizes=[2, 2, 3],
        pad_to_bucket_boundary=True, padding_values=np.int64(-1), drop_remainder=True),
    "rebatch": lambda: D.range(10).batch(4).rebatch(3),
    "rebatch_list": lambda: D.range(12).batch(5).rebatch([2, 3]),
    "rebatch_drop": lambda: D.range(10).batch(4).rebatch(3, drop_remainder=True),
    "cache_repeat": lambda: D.range(4).map(fns.times_three).cache().repeat(2),
    "ignore_errors": lambda: D.from_tensor_slices(np.array([1.0, 2.0, 0.0, 4.0], np.float32)).map(
        fns.reciprocal_checked).ignore_errors(),
}

# Seeded sampling: TF's draws come from its own generator, so the order differs; what must
# hold is TF's multiset and each input's own order (checked in the tests below).
SAMPLED = {
    "sample_from_datasets": lambda: D.sample_from_datasets(
        [D.range(10), D.range(100, 110)], weights=[0.5, 0.5], seed=7),
    "sample_stop_on_empty": lambda: D.sample_from_datasets(
        [D.range(3), D.range(100, 200)], weights=[0.5, 0.5], seed=7, stop_on_empty_dataset=True),
    "sample_uneven_weights": lambda: D.sample_from_datasets(
        [D.range(5), D.range(100, 120), D.range(200, 203)], weights=[0.2, 0.7, 0.1], seed=11),
}

ERRORS = {
    "error_shard_num_shards": lambda: D.range(4).shard(0, 0),
    "error_shard_index": lambda: D.range(4).shard(2, 2),
    "error_window_size": lambda: D.range(4).window(0),
    "error_window_shift": lambda: D.range(4).window(2, 0),
    "error_interleave_cycle": lambda: D.range(4).interleave(D.from_tensors, cycle_length=0),
    "error_interleave_block": lambda: D.range(4).interleave(D.from_tensors, block_length=0),
    "error_padded_batch_size": lambda: D.range(4).padded_batch(0),
    "error_padded_too_small": lambda: D.range(1, 5).map(fns.fill).padded_batch(
        2, padded_shapes=[2]),
    "error_unique_float": lambda: D.from_tensor_slices([1.0, 2.0]).unique(),
    "error_choose_index": lambda: D.choose_from_datasets(
        [D.range(2)], D.from_tensor_slices(np.array([0, 3]))),
    "error_zip_not_dataset": lambda: D.zip((D.range(3), [1, 2])),
    "error_choose_int32": lambda: D.choose_from_datasets(
        [D.range(2)], D.from_tensor_slices(np.array([0, 0], np.int32))),
    "error_unique_pair": lambda: D.from_tensor_slices(([1, 2], [3, 4])).unique(),
    "error_concatenate_types": lambda: D.range(3).concatenate(D.from_tensors(b"x")),
    "error_sample_weights": lambda: D.sample_from_datasets([D.range(3), D.range(3)],
                                                           weights=[0.5]),
}
# What each error names (argument and fix) in clusterwire's message.
ERROR_WORDS = {
    "error_shard_num_shards": "num_shards", "error_shard_index": "index",
    "error_window_size": "size", "error_window_shift": "shift",
    "error_interleave_cycle": "cycle_length", "error_interleave_block": "block_length",
    "error_padded_batch_size": "batch_size", "error_padded_too_small": "padded_shapes",
    "error_unique_float": "int32, int64 or string", "error_choose_index": "choice_dataset",
    "error_zip_not_dataset": "tuple instead of a list", "error_sample_weights": "weights",
    "error_concatenate_types": "incompatible", "error_choose_int32": "int64 scalars",
    "error_unique_pair": "one component",
}


def decode(encoded):
    if "tuple" in encoded:
        return tuple(decode(v) for v in encoded["tuple"])
    if "dict" in encoded:
        return {k: decode(v) for k, v in encoded["dict"].items()}
    if "bytes" in encoded:
        return base64.b64decode(encoded["bytes"])
    if "bytes_array" in encoded:
        values = [base64.b64decode(v) for v in encoded["bytes_array"]]
        return np.array(values, dtype=object).reshape(encoded["shape"])
    return np.array(encoded["values"], dtype=encoded["dtype"]).reshape(encoded["shape"])


def assert_same(actual, expected, where="element"):
    """``actual`` (clusterwire) equals ``expected`` (TF): structure, shape, dtype kind, values.

    dtypes compare by kind: TF makes float32 of Python floats where numpy makes float64."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), (where, actual)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (where, actual)
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, bytes):
        assert bytes(actual) == expected, (where, actual, expected)
    else:
        got = np.asarray(actual)
        assert got.shape == expected.shape, (where, got.shape, expected.shape)
        if expected.dtype == object:
            assert got.dtype.kind == "S" and got.tolist() == expected.tolist(), (where, got)
        else:
            assert got.dtype.kind == expected.dtype.kind, (where, got.dtype, expected.dtype)
            np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=where)


def assert_elements(actual, name, ordered=True):
    expected = [decode(e) for e in EXPECTED[name]["elements"]]
    assert len(actual) == len(expected), (name, actual)
    if not ordered:
        key = repr
        actual = sorted(actual, key=lambda e: key(_plain(e)))
        expected = sorted(expected, key=lambda e: key(_plain(e)))
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_same(a, e, f"{name}[{index}]")


def _plain(value):
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return bytes(value)
    return np.asarray(value).tolist()


def test_every_fixture_case_has_a_test():
    assert set(EXPECTED) == set(CASES) | set(SAMPLED) | set(ERRORS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_local_elements_match_tf(name):
    assert_elements(list(CASES[name]()), name, ordered=name != "interleave_nondeterministic")


@pytest.mark.parametrize("name", sorted({**CASES, **SAMPLED}))
def test_cardinality_matches_tf(name):
    assert {**CASES, **SAMPLED}[name]().cardinality() == EXPECTED[name]["cardinality"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_worker_built_pipeline_matches_tf(name):
    """The DatasetDef round trip a worker makes (its functions allowed by @data.function)."""
    definition, buffers = graph.to_def(CASES[name]().pipeline)
    pipe = graph.from_def(definition, buffers, WorkerPermissions())
    assert_elements(list(pipe.run()), name, ordered=name != "interleave_nondeterministic")


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampling_gives_tfs_multiset_in_each_inputs_order(name):
    expected = [int(decode(e)) for e in EXPECTED[name]["elements"]]
    first = [int(x) for x in SAMPLED[name]()]
    assert [int(x) for x in SAMPLED[name]()] == first  # seeded
    assert first != sorted(first)  # drawn from the inputs in turn, not one after the other
    if name == "sample_stop_on_empty":  # ends once the 3-element input is drawn after its end
        assert [x for x in expected if x < 100] == [x for x in first if x < 100] == [0, 1, 2]
        assert len(expected) < 103 and len(first) < 103
    else:  # every element of every input
        assert sorted(first) == sorted(expected)
    for hundreds in (0, 1, 2):
        part = [x for x in first if x // 100 == hundreds]
        assert part == sorted(part)


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_argument_errors_are_invalid_argument_naming_the_fix(name):
    assert "error" in EXPECTED[name]  # TF raised too (see the fixture for its class)
    with pytest.raises(errors.InvalidArgumentError, match=ERROR_WORDS[name]):
        list(ERRORS[name]())


# ---- through the service -------------------------------------------------------------------

THROUGH_SERVICE = ["from_tensors_dict", "zip_dict", "concatenate", "counter", "flat_map",
                   "interleave_c3_b2_p2", "interleave_c4_b3_p-1", "padded_batch_tuple", "shard",
                   "scan_tuple_state", "take_while", "unique_strings", "choose_skip_empty",
                   "window_tuple", "group_by_window_size_func", "bucket_pad_to_boundary",
                   "rebatch_list", "cache_repeat", "ignore_errors"]
# distributed_epoch runs the transformations on each split of the source by itself: for
# these (one output group per input element) the elements are TF's, in another order.
PER_ELEMENT = ["flat_map", "flat_map_slices", "interleave_c2_b4_pNone", "interleave_c3_b2_p2",
               "ignore_errors"]


@pytest.fixture(scope="module")
def one_worker():
    with in_process_data_service(workers=1) as dispatcher:
        yield dispatcher.target


@pytest.fixture(scope="module")
def two_workers():
    with in_process_data_service(workers=2) as dispatcher:
        yield dispatcher.target


def through(dataset, target, mode):
    return list(dataset.apply(data.distribute(processing_mode=mode, service=target)))


@pytest.mark.parametrize("name", THROUGH_SERVICE)
def test_parallel_epochs_through_the_service_match_tf(name, one_worker):
    assert_elements(through(CASES[name](), one_worker, "parallel_epochs"), name)


@pytest.mark.parametrize("name", PER_ELEMENT)
def test_distributed_epoch_through_the_service_gives_tfs_elements(name, two_workers):
    assert_elements(through(CASES[name](), two_workers, "distributed_epoch"), name,
                    ordered=False)


def test_distributed_epoch_refuses_concatenate(two_workers):
    with pytest.raises(errors.InvalidArgumentError, match="parallel_epochs"):
        through(D.range(4).concatenate(D.range(2)), two_workers, "distributed_epoch")


@pytest.mark.timeout(120)
def test_worker_processes_of_local_data_service_match_tf(monkeypatch):
    """Real worker processes (importing the functions' module), elements over grpc+local."""
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])
    with data.LocalDataService(workers=2, data_transfer_protocol="grpc+local",
                               imports=["cw_tf_ops_functions"]) as service:
        for name in ("interleave_c3_b2_p2", "flat_map_empty"):
            got = through(CASES[name](), service.target, "distributed_epoch")
            assert_elements(got, name, ordered=False)
        for name in ("padded_batch_tuple", "group_by_window_size_func", "window_tuple"):
            got = through(CASES[name](), service.target, "parallel_epochs")  # each worker's
            expected = [decode(e) for e in EXPECTED[name]["elements"]]  # whole dataset
            assert len(got) == 2 * len(expected)
            for element in expected:
                matches = [g for g in got if repr(_plain(g)) == repr(_plain(element))]
                assert len(matches) == 2, (name, element)
                assert_same(matches[0], element, name)


# ---- default deny inside nested pipelines --------------------------------------------------

def test_nested_functions_and_files_obey_default_deny(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "ok.txt").write_text("a\nb\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret\n")
    marker = tmp_path / "ran"
    with in_process_data_service(workers=1, readable_dirs=[str(allowed)]) as dispatcher:
        target = dispatcher.target
        refused = [  # a child pipeline's function, a returned Dataset's function and files
            D.zip((D.range(1), D.from_tensor_slices(np.array([f"touch {marker}"])).map(
                os.system))),
            D.range(2).interleave(fns.not_allowed_dataset, cycle_length=2),
            D.range(2).flat_map(fns.not_allowed_dataset),
            D.range(1).group_by_window(fns.mod_2, fns.not_allowed_dataset, window_size=1),
        ]
        for dataset in refused:
            with pytest.raises(errors.PermissionDeniedError, match="not allowed|never run"):
                through(dataset, target, "parallel_epochs")
        for dataset in [D.range(1).concatenate(D.from_files([str(secret)])),
                        D.from_tensor_slices(np.array([str(secret).encode()])).flat_map(
                            fns.lines)]:
            with pytest.raises(errors.PermissionDeniedError, match="readable_dirs"):
                through(dataset, target, "parallel_epochs")
        with pytest.raises(errors.PermissionDeniedError, match="does not write files"):
            through(D.range(3).cache(str(tmp_path / "cache")), target, "parallel_epochs")
        ok = D.from_tensor_slices(np.array([str(allowed / "ok.txt").encode()] * 2)).interleave(
            fns.lines, cycle_length=2, num_parallel_calls=2)
        assert through(ok, target, "parallel_epochs") == [b"a", b"a", b"b", b"b"]
    assert not marker.exists()


# ---- behaviour beyond the fixtures ---------------------------------------------------------

def test_parallel_interleave_reads_its_open_datasets_at_once():
    """Each open Dataset's first element waits for all 3 readers: a sequential interleave
    could not get past the first (the barrier would time out)."""
    def waiting(barrier):
        barrier.wait()
        yield np.int64(1)

    def opener(barrier):
        return lambda _: D.from_generator(waiting, args=(barrier,))

    barrier = threading.Barrier(3, timeout=20)
    dataset = D.range(3).interleave(opener(barrier), cycle_length=3, num_parallel_calls=3)
    assert [int(x) for x in dataset] == [1, 1, 1]
    sequential = D.range(2).interleave(opener(threading.Barrier(2, timeout=0.5)),
                                       cycle_length=2)
    with pytest.raises(threading.BrokenBarrierError):
        list(sequential)


def test_interleave_default_cycle_length_is_the_cpu_count():
    count = len(os.sched_getaffinity(0))
    dataset = D.range(1, count + 2).interleave(fns.repeat_self)
    first_round = [int(x) for x in dataset][:count]
    assert first_round == list(range(1, count + 1))


def test_interleave_error_reaches_the_consumer_at_its_place():
    dataset = D.from_tensor_slices(np.array([1.0, 2.0], np.float32)).interleave(
        fns.not_a_dataset, cycle_length=2, num_parallel_calls=2)
    with pytest.raises(errors.InvalidArgumentError, match="must return a clusterwire.data"):
        list(dataset)


def test_file_cache_is_written_after_a_complete_pass_and_read_by_later_runs(tmp_path):
    path = str(tmp_path / "cache")
    first = D.range(5).map(fns.times_three).cache(path)
    partial = iter(first)
    assert [int(next(partial)) for _ in range(2)] == [0, 3]
    del partial
    assert not any(name.startswith("cache") for name in os.listdir(tmp_path))
    assert [int(x) for x in first] == [0, 3, 6, 9, 12]
    # A later run reads the file, not its own (different) input, as TF does.
    assert [int(x) for x in D.range(100).cache(path)] == [0, 3, 6, 9, 12]
    with open(path + ".cwcache", "r+b") as handle:
        handle.truncate(os.path.getsize(path + ".cwcache") - 3)
    with pytest.raises(errors.DataLossError, match="truncated"):
        list(D.range(100).cache(path))


def test_memory_cache_replays_without_running_the_input_again():
    calls = []

    def counted(x):
        calls.append(x)
        return x

    dataset = D.range(3).map(counted).cache().repeat(3)
    assert len(list(dataset)) == 9 and len(calls) == 3


def test_ignore_errors_goes_on_after_a_failed_parallel_map():
    values = np.array([1.0, 0.0, 4.0, 0.0, 2.0], np.float32)
    dataset = D.from_tensor_slices(values).map(fns.reciprocal_checked,
                                               num_parallel_calls=3).ignore_errors()
    assert [float(x) for x in dataset] == [1.0, 0.25, 0.5]


def test_window_of_a_dict_is_a_dict_of_datasets():
    windows = list(D.from_tensor_slices({"a": np.arange(5)}).window(2, drop_remainder=True))
    assert len(windows) == 2 and isinstance(windows[0]["a"], D)
    assert [int(x) for x in windows[1]["a"]] == [2, 3]


def test_cardinalities():
    assert D.zip((D.range(3), D.range(5))).cardinality() == 3
    assert D.zip((D.range(3), D.counter())).cardinality() == 3
    assert D.range(3).concatenate(D.range(4)).cardinality() == 7
    assert D.counter().cardinality() == data.INFINITE_CARDINALITY
    assert D.range(10).shard(3, 1).cardinality() == 3
    assert D.range(10).padded_batch(4, drop_remainder=True).cardinality() == 2
    assert D.range(10).flat_map(fns.ranges).cardinality() == data.UNKNOWN_CARDINALITY
    assert D.from_tensors(1).cardinality() == 1


def test_a_zipped_shuffle_reshuffles_each_epoch_as_in_tf():
    values = [int(a) for a, _ in D.zip((D.range(6).shuffle(6, seed=1), D.range(6))).repeat(2)]
    first, second = values[:6], values[6:]
    assert sorted(first) == sorted(second) == list(range(6)) and first != second


def test_rebatch_to_zero_is_an_error():
    # TF 2.21 accepts rebatch(0) and loops forever on the first element (so no fixture).
    with pytest.raises(errors.InvalidArgumentError, match="batch_size"):
        D.range(4).batch(2).rebatch(0)


def test_a_tampered_node_is_refused_where_a_worker_builds_it():
    """A hostile client's DatasetDef: the node checks its arguments on the worker as the
    client's Dataset call would, and unknown kinds or fields are malformed."""
    from clusterwire import codec

    definition, buffers = graph.to_def(D.range(5).window(2).flat_map(fns.batch_2).pipeline)
    params = codec.decode(definition.payloads, list(buffers))
    assert params[definition.ops[0].node.params]["size"] == 2

    def rebuilt(change=None, kind=None):
        items = [dict(p) if isinstance(p, dict) else p for p in params]
        if kind == "tensors":
            items[definition.ops[0].node.params] = {}
        items[definition.ops[0].node.params].update(change or {})
        tampered = type(definition)()
        tampered.CopyFrom(definition)
        header, new_buffers = codec.encode(items)
        tampered.payloads.CopyFrom(header)
        if kind:
            tampered.ops[0].node.kind = kind
        return graph.from_def(tampered, new_buffers, WorkerPermissions())

    for change, words in [({"size": -1}, "`size` must be an int >= 1"),
                          ({"guard": 1}, "Malformed dataset"),
                          ({"stride": "x"}, "`stride` must be an int"),
                          ({"extra": 1}, "Malformed dataset")]:
        with pytest.raises(errors.InvalidArgumentError, match=words):
            rebuilt(change)
    with pytest.raises(errors.InvalidArgumentError, match="unknown node"):
        rebuilt(kind="no_such_op")
    with pytest.raises(errors.InvalidArgumentError, match="not a transformation"):
        rebuilt({"tensors": 1}, kind="tensors")
    assert [list(map(int, b)) for b in rebuilt().run()] == [[0, 1], [2, 3], [4]]


def test_node_arguments_are_checked_where_the_node_is_made():
    from clusterwire.data.ops import sources

    pipes = (D.range(2).pipeline, D.range(3).pipeline)
    for bad in [(0, 0), (0, 5), (0,)]:
        with pytest.raises(errors.InvalidArgumentError, match="each of its 2 datasets once"):
            sources.ZipSource(bad, pipes)
    with pytest.raises(errors.InvalidArgumentError, match="weights"):
        sources.SampleSource((0.5, -1.0), None, False, False, pipes)
    with pytest.raises(errors.InvalidArgumentError, match="dtype"):
        D.counter(dtype="U5")
    with pytest.raises(errors.InvalidArgumentError, match="at least one Dataset"):
        D.choose_from_datasets([], D.range(1))


def test_nondeterministic_interleave_lets_a_ready_dataset_go_first():
    released = threading.Event()

    def values(x):
        if x == 0:
            assert released.wait(20), "the slow Dataset was never released"
        yield np.int64(x)

    def opener(x):
        return D.from_generator(values, args=(int(x),))

    iterator = iter(D.range(2).interleave(opener, cycle_length=2, num_parallel_calls=2,
                                          deterministic=False))
    assert int(next(iterator)) == 1  # the first Dataset is still blocked
    released.set()
    assert [int(x) for x in iterator] == [0]


def test_interleave_threads_end_with_their_iterator():
    def interleave_threads():
        # An error an earlier test kept (pytest.raises' excinfo is a reference cycle) holds
        # its pipeline, threads and all, until the garbage collector frees it.
        gc.collect()
        return [t for t in threading.enumerate() if t.name.startswith("clusterwire-interleave")]

    dataset = D.range(1, 5).interleave(fns.repeat_self, cycle_length=4, num_parallel_calls=4)
    assert len(list(dataset)) == 10
    wait_for(lambda: not interleave_threads(), what="the pool's threads to end")
    iterator = iter(dataset)
    next(iterator)
    assert interleave_threads()
    del iterator  # left unfinished
    wait_for(lambda: not interleave_threads(), what="an abandoned pool's threads to end")
