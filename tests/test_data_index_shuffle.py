"""The index permutation behind ``Dataset.global_shuffle``: a bijection on ``[0, n)`` keyed by
(seed, epoch), computed per index with O(1) state."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from clusterwire import errors
from clusterwire.data.index_shuffle import MAX_SIZE, IndexPermutation

SIZES = [1, 2, 3, 5, 7, 13, 31, 97, 8191, 4, 8, 1024, 65536, 5, 9, 1025, 65537, 10 ** 6]


@pytest.mark.parametrize("size", SIZES)
def test_a_permutation_is_a_bijection_on_its_range(size):
    shuffled = IndexPermutation(size, seed=42, epoch=3).apply(np.arange(size))
    assert shuffled.dtype == np.int64
    assert np.array_equal(np.sort(shuffled), np.arange(size))


@pytest.mark.parametrize("size", [1, 2, 3, 16, 17, 1000])
def test_one_index_at_a_time_agrees_with_the_array_form(size):
    permutation = IndexPermutation(size, seed=-7)
    assert [permutation(i) for i in range(size)] == permutation.apply(
        np.arange(size)).tolist()


def test_the_order_is_fixed_by_seed_and_epoch_and_differs_between_them():
    def order(seed, epoch):
        return IndexPermutation(1000, seed, epoch).apply(np.arange(1000)).tolist()
    assert order(1, 0) == order(1, 0)
    assert len({tuple(order(seed, epoch)) for seed in (0, 1, 2, -1, 2 ** 63 - 1)
                for epoch in (0, 1, 2)}) == 15
    assert order(1, 0) != list(range(1000))


def test_a_part_of_the_range_maps_as_the_whole_does():
    permutation = IndexPermutation(10 ** 5, seed=5)
    whole = permutation.apply(np.arange(10 ** 5))
    assert np.array_equal(permutation.apply(np.arange(4000, 9000)), whole[4000:9000])


def test_state_is_constant_whatever_the_size():
    small, large = IndexPermutation(10, 1), IndexPermutation(MAX_SIZE, 1)
    assert not hasattr(small, "__dict__")  # __slots__: size, two ints, the round keys
    assert len(small._keys) == len(large._keys)
    tracemalloc.start()
    try:
        permutation = IndexPermutation(10 ** 8, seed=3)
        last = permutation(10 ** 8 - 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0 <= last < 10 ** 8 and peak < 16 * 1024  # not 10**8 of anything


def test_an_empty_range_maps_nothing():
    assert IndexPermutation(0, 1).apply(np.arange(0)).size == 0


@pytest.mark.parametrize("args,message", [
    ((-1, 1), "0 to"), ((MAX_SIZE + 1, 1), "0 to"),
    ((10, 2 ** 63), "int64"), ((10, -2 ** 63 - 1), "int64"), ((10, 1, -1), "uint64")])
def test_bad_arguments_are_invalid_argument_errors(args, message):
    with pytest.raises(errors.InvalidArgumentError, match=message):
        IndexPermutation(*args)


def test_an_index_outside_the_range_is_refused():
    with pytest.raises(errors.InvalidArgumentError, match=r"outside \[0, 10\)"):
        IndexPermutation(10, 1)(10)
    with pytest.raises(errors.InvalidArgumentError, match=r"not all in \[0, 10\)"):
        IndexPermutation(10, 1).apply(np.arange(5, 11))  # cycle walking from 10 may not end
    with pytest.raises(errors.InvalidArgumentError, match=r"not all in \[0, 10\)"):
        IndexPermutation(10, 1).apply(np.array([-1]))
