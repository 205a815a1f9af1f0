"""The zmq wire format: round trips, the inline threshold, and every malformed shape."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from clusterwire_zmq import wire
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterwire import errors
from clusterwire.envelope import BULK, INLINE, MAX_BUFFERS, MAX_HEADER_BYTES

LIMIT = 1 << 30


def _parts(parts: list) -> list[bytes]:
    """What a receiver gets: every part as its own bytes object."""
    return [bytes(p) for p in parts]


@pytest.mark.parametrize("inline_max", [0, 1, 100, 1 << 20])
def test_round_trip_with_any_inline_threshold(inline_max):
    buffers = [b"", b"abc", np.arange(50, dtype=np.uint8), np.zeros((3, 4), np.float64),
               bytes(range(256)) * 10]
    parts = wire.encode(wire.REQUEST, 7, b"head", wire.byte_views(buffers), inline_max)
    assert len(parts) == 1 + sum(1 for b in buffers if memoryview(b).nbytes >= inline_max)
    message = wire.decode(_parts(parts), LIMIT)
    assert (message.kind, message.request_id, message.status, message.header) == (
        wire.REQUEST, 7, 0, b"head")
    for received, sent in zip(message.buffers, buffers, strict=True):
        assert received.tobytes() == memoryview(sent).cast("B").tobytes()


def test_large_buffers_are_sent_as_the_callers_memory():
    big = np.ones(1 << 20, np.uint8)
    parts = wire.encode(wire.REPLY, 1, b"", wire.byte_views([big]), 65536)
    assert np.shares_memory(np.frombuffer(parts[1], np.uint8), big)


def test_received_inline_buffers_are_views_of_the_first_part():
    first = bytearray(wire.encode(wire.REQUEST, 1, b"h", wire.byte_views([b"xyz"]), 100)[0])
    message = wire.decode([first], LIMIT)
    message.buffers[0][0] = ord("Z")  # writable, and no copy: the part itself changes
    assert bytes(first).endswith(b"Zyz")


def test_errors_welcome_and_request_ids():
    error = wire.decode(wire.encode_error(9, errors.CANCELLED, "stopped"), LIMIT)
    assert (error.kind, error.request_id, error.status, error.header) == (
        wire.REPLY, 9, errors.CANCELLED, b"stopped")
    welcome = wire.decode(wire.encode_welcome(3, 12345), LIMIT)
    assert welcome.kind == wire.WELCOME and wire.welcome_limit(welcome) == 12345
    assert wire.peek_request_id(wire.encode_error(42, 1, "x")[0]) == 42
    assert wire.peek_request_id(b"short") == 0 and wire.peek_request_id(b"X" * 64) == 0
    with pytest.raises(errors.InvalidArgumentError):
        wire.welcome_limit(error)


def _prefix(kind=wire.REQUEST, count=0, header_len=0, magic=wire.MAGIC) -> bytes:
    return struct.pack("<4sB3xQIII", magic, kind, 5, 0, header_len, count)


def _entry(kind: int, length: int) -> bytes:
    return struct.pack("<BQ", kind, length)


@pytest.mark.parametrize("parts,error", [
    ([], errors.InvalidArgumentError),
    ([b""], errors.InvalidArgumentError),
    ([b"CWZ1\x01"], errors.InvalidArgumentError),
    ([_prefix(magic=b"HTTP")], errors.InvalidArgumentError),
    ([_prefix(kind=99)], errors.InvalidArgumentError),
    ([_prefix(count=MAX_BUFFERS + 1)], errors.ResourceExhaustedError),
    ([_prefix(header_len=MAX_HEADER_BYTES + 1)], errors.ResourceExhaustedError),
    ([_prefix(count=2)], errors.InvalidArgumentError),  # buffer table missing
    ([_prefix(header_len=10) + b"abc"], errors.InvalidArgumentError),  # header cut short
    ([_prefix(count=1) + _entry(BULK, LIMIT + 1)], errors.ResourceExhaustedError),
    ([_prefix(count=1) + _entry(BULK, 8)], errors.InvalidArgumentError),  # part missing
    ([_prefix(count=1) + _entry(BULK, 8), b"1234567"], errors.InvalidArgumentError),
    ([_prefix(count=1) + _entry(BULK, 8), b"12345678", b"extra"],
     errors.InvalidArgumentError),
    ([_prefix(count=1) + _entry(INLINE, 8) + b"1234"],
     errors.InvalidArgumentError),  # inline bytes short
    ([_prefix(count=1) + _entry(2, 8)], errors.InvalidArgumentError),  # unknown buffer kind
    ([_prefix(count=0) + b"trailing"], errors.InvalidArgumentError),
])
def test_malformed_messages_are_clusterwire_errors(parts, error):
    with pytest.raises(error):
        wire.decode(parts, LIMIT)


@settings(max_examples=300, deadline=None)
@given(first=st.binary(max_size=120), rest=st.lists(st.binary(max_size=40), max_size=3),
       keep_magic=st.booleans())
def test_random_messages_decode_or_raise_a_clusterwire_error(first, rest, keep_magic):
    if keep_magic:
        first = wire.MAGIC + bytes([first[0] % 5 if first else 1]) + first[1:]
    try:
        message = wire.decode([first, *rest], 1 << 20)
    except (errors.InvalidArgumentError, errors.ResourceExhaustedError):
        return
    assert sum(b.nbytes for b in message.buffers) <= 1 << 20
