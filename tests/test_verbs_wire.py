"""grpc+verbs control messages: the C helper's codec and wire.py's agree byte for byte on
any input (the recorded vectors are in test_envelope.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterwire import errors
from clusterwire.envelope import BULK, INLINE_BUDGET
from clusterwire.transports.verbs import wire

compiled = pytest.importorskip("clusterwire.transports.verbs._ucp",
                               reason="the C helper was not built (no C compiler at install)")

KEY = bytes(range(1, 9))
FRAMES = [
    (b"", []),
    (b"header", [b"12345678"]),
    (b"h", [b"", np.arange(10, dtype=np.float64), bytearray(b"abc")]),
    (b"x" * 1000, [np.zeros((3, 4), np.int32), memoryview(b"q" * 70_000), b"tail"]),
    (b"many", [bytes([i]) * i for i in range(40)]),
]


def outcome(function, *args):
    """What a codec function returned, or the class and message of what it raised."""
    try:
        return function(*args)
    except errors.OpError as err:
        return type(err), str(err)


def as_plain(decoded):
    status, key, header, kinds, lengths, inline = decoded
    return status, bytes(key), bytes(header), tuple(kinds), tuple(lengths), \
        [bytes(view) for view in inline]


@pytest.mark.parametrize("header, buffers", FRAMES)
@pytest.mark.parametrize("threshold, budget", [(64 << 10, INLINE_BUDGET), (4, 100), (0, 0)])
def test_both_encode_the_same_bytes(header, buffers, threshold, budget):
    ours = compiled.encode(header, buffers, threshold, budget, KEY, 7)
    theirs = wire.encode(header, buffers, threshold, budget, KEY, 7)
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]


@pytest.mark.parametrize("header, buffers", FRAMES)
def test_both_decode_to_writable_copies_of_the_inline_buffers(header, buffers):
    message, bulk = wire.encode(header, buffers, 64 << 10, INLINE_BUDGET, KEY, 0)
    ours, theirs = compiled.decode(message, 1 << 30), wire.decode(message, 1 << 30)
    assert as_plain(ours) == as_plain(theirs)
    status, key, decoded_header, kinds, lengths, inline = ours
    assert (status, key, decoded_header) == (0, KEY, header)
    assert [i for i, kind in enumerate(kinds) if kind == BULK] == bulk
    assert lengths == tuple(memoryview(b).nbytes for b in buffers)
    for view in inline:
        assert not view.readonly  # copies: the receiver may write into them


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 1 << 20))
def test_both_agree_on_any_bytes(message, limit):
    ours, theirs = outcome(compiled.decode, message, limit), outcome(wire.decode, message, limit)
    if isinstance(theirs, wire.Control):
        assert as_plain(ours) == as_plain(theirs)
    else:
        assert ours == theirs


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.lists(st.binary(max_size=300), max_size=12),
       st.integers(0, 400), st.integers(0, 2000))
def test_both_agree_on_any_frame(header, buffers, threshold, budget):
    ours = compiled.encode(header, buffers, threshold, budget, KEY, 0)
    assert ours == wire.encode(header, buffers, threshold, budget, KEY, 0)
    assert as_plain(compiled.decode(ours[0], 1 << 20)) == as_plain(wire.decode(ours[0], 1 << 20))
