"""A parallel interleave's read-ahead: elements reach the consumer as they are read, each
open Dataset is read at most ``_READ_AHEAD`` elements ahead of the consumer, on one thread
while its reads do not wait, the read threads hold about ``_READ_AHEAD_BYTES`` of elements
ahead over their Datasets, and reads that wait do not hold up the others."""

from __future__ import annotations

import itertools
import random
import threading

import numpy as np
import pytest
from conftest import wait_for

from clusterwire import data
from clusterwire.data.ops.nested import _READ_AHEAD, _READ_AHEAD_BYTES

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


def test_each_open_dataset_is_read_on_one_thread_of_num_parallel_calls():
    readers: dict[int, set[int]] = {}
    lock = threading.Lock()

    def values(index):
        for value in range(20):
            with lock:
                readers.setdefault(index, set()).add(threading.get_ident())
            yield np.int64(index * 100 + value)

    dataset = D.range(6).interleave(
        lambda index: D.from_generator(values, args=(int(index),)), cycle_length=3,
        num_parallel_calls=2)
    got = [int(x) for x in dataset]
    # TF's order: 3 Datasets open at once, one element each in turn, then the next 3.
    assert got == [i * 100 + v for group in ((0, 1, 2), (3, 4, 5)) for v in range(20)
                   for i in group]
    assert all(len(threads) == 1 for threads in readers.values()), readers
    assert len(set().union(*readers.values())) == 2


def test_a_read_thread_holds_about_read_ahead_bytes_ahead_over_its_datasets():
    size = _READ_AHEAD_BYTES // 4
    produced = [0, 0]
    lock = threading.Lock()

    def endless(index):
        while True:
            with lock:
                produced[index] += 1
            yield b"x" * size

    # One thread reads both Datasets: together it holds _READ_AHEAD_BYTES, and a read that
    # starts below it gives one more element.
    dataset = D.range(2).interleave(
        lambda index: D.from_generator(endless, args=(int(index),)), cycle_length=2,
        num_parallel_calls=1)
    iterator = iter(dataset)
    held = _READ_AHEAD_BYTES // size + 1
    for taken in range(1, 4 * held):
        assert len(next(iterator)) == size
        wait_for(lambda t=taken: sum(produced) >= t + held - 1, what="the read ahead")
        with lock:
            assert sum(produced) <= taken + held, (taken, produced)


def test_num_parallel_calls_above_cycle_length_reads_on_a_thread_per_open_dataset():
    def interleave_threads():
        return {t for t in threading.enumerate() if t.name.startswith("clusterwire-interleave")}

    before = interleave_threads()
    iterator = iter(D.range(4).interleave(lambda x: D.from_tensors(x).repeat(3), cycle_length=2,
                                          num_parallel_calls=8))
    assert int(next(iterator)) == 0
    assert len(interleave_threads() - before) == 2
    assert [int(x) for x in iterator] == [1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]


def test_num_parallel_calls_datasets_that_wait_for_each_other_are_all_read_at_once():
    """8 Datasets whose first element waits for all 8 readers: read on a thread per CPU
    while reads only need the CPU, the reads that wait hand the other Datasets to spare
    threads, so all 8 are read at once (as TF's 8 parallel calls) and none twice at once
    (a generator read by two threads at once raises)."""
    barrier = threading.Barrier(8, timeout=20)

    def values(index):
        barrier.wait()
        yield np.int64(index)
        yield np.int64(index + 10)

    def interleave_threads():
        return {t for t in threading.enumerate() if t.name.startswith("clusterwire-interleave")}

    before = interleave_threads()
    dataset = D.range(8).interleave(lambda x: D.from_generator(values, args=(int(x),)),
                                    cycle_length=8, num_parallel_calls=8)
    assert [int(x) for x in dataset] == [*range(8), *range(10, 18)]
    wait_for(lambda: not interleave_threads() - before, what="the lanes and spares to end")


def _elements_and_errors(dataset):
    out, iterator = [], iter(dataset)
    while True:
        try:
            element = next(iterator)
        except StopIteration:
            return out
        except ValueError as error:
            out.append(str(error))
            continue
        out.append(np.asarray(element).tobytes())


def _varied(seed):
    rng = random.Random(int(seed))
    fail = rng.randint(0, 14)
    for index in range(rng.randint(0, 10)):
        if index == fail:
            raise ValueError(f"Dataset {int(seed)} fails at {index}")
        yield bytes([int(seed) % 256]) * rng.choice([0, 1, 1000, 100_000]) + bytes([index])


def test_parallel_reads_give_the_sequential_interleaves_elements_and_errors_in_order():
    rng = random.Random(7)
    for _ in range(40):
        first, count = rng.randint(0, 10**6), rng.randint(0, 10)
        cycle, block = rng.randint(1, 8), rng.randint(1, 3)

        def interleave(calls, first=first, count=count, cycle=cycle, block=block):
            return D.range(first, first + count).interleave(
                lambda seed: D.from_generator(_varied, args=(seed,)), cycle_length=cycle,
                block_length=block, num_parallel_calls=calls)
        expected = _elements_and_errors(interleave(None))
        for calls in (1, 2, 3, 8):
            assert _elements_and_errors(interleave(calls)) == expected, (cycle, block, calls)
