"""A parallel interleave's read-ahead: elements reach the consumer as they are read, and
each open Dataset is read at most ``_READ_AHEAD`` elements ahead of the consumer."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from conftest import wait_for

from clusterwire import data
from clusterwire.data.ops.nested import _READ_AHEAD

pytestmark = pytest.mark.timeout(60)

D = data.Dataset


def test_an_element_reaches_the_consumer_while_its_dataset_is_still_being_read():
    taken = threading.Event()

    def values():
        yield np.int64(1)
        assert taken.wait(20), "the consumer never got the first element"
        yield np.int64(2)

    dataset = D.range(1).interleave(lambda _: D.from_generator(values), cycle_length=1,
                                    block_length=2, num_parallel_calls=1)
    iterator = iter(dataset)
    assert int(next(iterator)) == 1  # read while the same read task waits for the consumer
    taken.set()
    assert [int(x) for x in iterator] == [2]


def test_each_open_dataset_is_read_at_most_read_ahead_elements_ahead():
    produced = [0, 0]
    lock = threading.Lock()

    def endless(index):
        for value in itertools.count():
            with lock:
                produced[index] += 1
            yield np.int64(value)

    dataset = D.range(2).interleave(
        lambda index: D.from_generator(endless, args=(int(index),)), cycle_length=2,
        num_parallel_calls=2)
    iterator = iter(dataset)
    assert [int(next(iterator)) for _ in range(4)] == [0, 0, 1, 1]
    wait_for(lambda: sum(produced) >= 2 * _READ_AHEAD, what="both Datasets read ahead")
    taken = 2  # per Dataset: a read asks for what the buffer has room for, no more
    with lock:
        assert all(count <= taken + _READ_AHEAD for count in produced), produced
    for _ in range(4 * _READ_AHEAD):
        next(iterator)
    taken += 2 * _READ_AHEAD
    with lock:
        assert all(count <= taken + _READ_AHEAD for count in produced), produced


def test_a_base_exception_in_a_read_reaches_the_consumer():
    def values():
        yield np.int64(1)
        raise KeyboardInterrupt

    dataset = D.range(1).interleave(lambda _: D.from_generator(values), cycle_length=1,
                                    num_parallel_calls=1)
    iterator = iter(dataset)
    assert int(next(iterator)) == 1
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
