"""The receive-buffer pool reuses memory only once nothing refers to it."""

from __future__ import annotations

import gc

import numpy as np

from clusterwire.buffers import BufferPool


def test_small_buffers_are_not_pooled():
    pool = BufferPool(min_bytes=1024)
    pool.take(100)
    gc.collect()
    assert pool.held_bytes == 0


def test_a_buffer_returns_when_its_last_view_dies_and_is_reused():
    pool = BufferPool(min_bytes=1024)
    first = pool.take(4096)
    address = first.__array_interface__["data"][0]
    derived = np.frombuffer(memoryview(first), np.float64)  # keeps the buffer alive
    del first
    gc.collect()
    assert pool.held_bytes == 0
    second = pool.take(4096)
    second_address = second.__array_interface__["data"][0]
    assert second_address != address  # the first is still in use: not reused
    del derived, second
    gc.collect()
    assert pool.held_bytes == 2 * 4096
    third = pool.take(4096)
    assert third.__array_interface__["data"][0] in {address, second_address}
    assert pool.held_bytes == 4096


def test_the_pool_holds_at_most_max_bytes():
    pool = BufferPool(max_bytes=8192, min_bytes=1024)
    views = [pool.take(4096) for _ in range(4)]
    del views
    gc.collect()
    assert pool.held_bytes == 8192


def test_slices_of_received_arrays_keep_their_buffer():
    # numpy points a slice at the memory owner, past the view it was cut from: the buffer must
    # not be recycled (and overwritten by the next receive) while such slices are alive.
    pool = BufferPool(min_bytes=1024)
    received = pool.take(4096)
    received[:] = 1
    part = received[8:16]
    tensor_part = np.ndarray((512,), np.int64, memoryview(received).cast("B"))[2:4]
    del received
    gc.collect()
    assert pool.held_bytes == 0
    pool.take(4096)[:] = 2  # the next receive of the same size
    assert part.tolist() == [1] * 8
    assert tensor_part.tolist() == [0x0101010101010101] * 2
    del part, tensor_part
    gc.collect()
    assert pool.held_bytes == 8192
