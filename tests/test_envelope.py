"""The frame envelope against its shared test vectors: clusterwire.envelope (every built-in
transport's layout) and the C helper of grpc+verbs must produce exactly the recorded bytes
and errors (tests/envelope_vectors.json)."""

from __future__ import annotations

import json
import pathlib

import pytest

from clusterwire import envelope, errors
from clusterwire.envelope import inline_kinds, split_inline
from clusterwire.transports.grpc import framing
from clusterwire.transports.local import wire as local_wire
from clusterwire.transports.verbs import wire as verbs_wire

VECTORS = json.loads((pathlib.Path(__file__).parent / "envelope_vectors.json").read_text())
LAYOUTS = {"grpc": framing.LAYOUT, "grpc+local": local_wire.LAYOUT,
           "grpc+verbs": verbs_wire.LAYOUT}
LIMIT = 1 << 40


def _compiled():
    try:
        from clusterwire.transports.verbs import _ucp
    except ImportError:
        pytest.skip("the C helper of grpc+verbs was not built (no C compiler at install)")
    return _ucp


def _named(kind: str, layout: str | None = None) -> list:
    return [pytest.param(v, id=v["name"]) for v in VECTORS[kind]
            if layout is None or v["layout"] == layout]


def _fields(vector: dict) -> tuple:
    return tuple(bytes.fromhex(f) if isinstance(f, str) else f for f in vector["fields"])


def _buffers(vector: dict) -> list[bytes]:
    return [bytes.fromhex(b) for b in vector["buffers"]]


def _outcome(function, *args):
    """What ``function`` returned, or the name and message of the clusterwire error it raised."""
    try:
        return function(*args)
    except errors.OpError as err:
        return type(err).__name__, err.message


def test_the_limits_are_the_recorded_ones():
    assert VECTORS["limits"] == {"MAX_BUFFERS": envelope.MAX_BUFFERS,
                                 "MAX_HEADER_BYTES": envelope.MAX_HEADER_BYTES}


@pytest.mark.parametrize("vector", _named("frames"))
def test_python_encodes_and_decodes_each_frame(vector):
    layout, buffers = LAYOUTS[vector["layout"]], _buffers(vector)
    views = [memoryview(b) for b in buffers]
    kinds = inline_kinds(views, vector["threshold"], vector["budget"])
    assert kinds == vector["kinds"]
    places = [tuple(p) for p in vector["places"]] if "places" in vector else None
    encoded = layout.encode(_fields(vector), bytes.fromhex(vector["header"]), views, kinds, places)
    assert encoded.hex() == vector["bytes"]
    decoded = layout.decode(encoded, LIMIT)
    assert decoded.fields == _fields(vector)
    assert decoded.header.hex() == vector["header"]
    assert decoded.kinds == tuple(kinds)
    assert decoded.lengths == tuple(len(b) for b in buffers)
    assert decoded.places == (tuple(places) if places else ())
    inline = split_inline(decoded)
    assert [bytes(v) for v in inline] == [b for b, k in zip(buffers, kinds, strict=True)
                                          if k == envelope.INLINE]
    assert not any(view.readonly for view in inline)


@pytest.mark.parametrize("vector", _named("frames", "grpc+verbs"))
def test_the_c_helper_encodes_and_decodes_each_frame(vector):
    compiled, buffers = _compiled(), _buffers(vector)
    status, key = _fields(vector)
    header = bytes.fromhex(vector["header"])
    message, bulk = compiled.encode(header, buffers, vector["threshold"], vector["budget"], key,
                                    status)
    assert message.hex() == vector["bytes"]
    assert bulk == [i for i, kind in enumerate(vector["kinds"]) if kind == envelope.BULK]
    got_status, got_key, got_header, kinds, lengths, inline = compiled.decode(message, LIMIT)
    assert (got_status, got_key, got_header) == (status, key, header)
    assert (list(kinds), list(lengths)) == (vector["kinds"], [len(b) for b in buffers])
    assert [bytes(v) for v in inline] == [b for b, k in zip(buffers, kinds, strict=True)
                                          if k == envelope.INLINE]
    assert not any(view.readonly for view in inline)


@pytest.mark.parametrize("vector", _named("malformed"))
def test_python_refuses_each_malformed_envelope(vector):
    layout = LAYOUTS[vector["layout"]]
    assert _outcome(layout.decode, bytes.fromhex(vector["bytes"]), vector["limit"]) == (
        vector["error"], vector["message"])


@pytest.mark.parametrize("vector", _named("malformed", "grpc+verbs"))
def test_the_c_helper_refuses_each_malformed_envelope(vector):
    compiled = _compiled()
    assert _outcome(compiled.decode, bytes.fromhex(vector["bytes"]), vector["limit"]) == (
        vector["error"], vector["message"])


@pytest.mark.parametrize("vector", _named("oversized"))
def test_both_refuse_to_send_oversized_frames(vector):
    header, buffers = bytes(vector["header_bytes"]), [b""] * vector["buffer_count"]
    expected = (vector["error"], vector["message"])
    assert _outcome(verbs_wire.encode, header, buffers, 0, 0) == expected
    assert _outcome(_compiled().encode, header, buffers, 0, 0, verbs_wire.NO_KEY, 0) == expected


def test_inline_kinds_keep_small_buffers_inline_within_the_budget():
    views = [memoryview(bytes(n)) for n in (1, 10, 3, 3, 100)]
    assert inline_kinds(views, 10, 5) == [0, 1, 0, 1, 1]
    assert inline_kinds(views, 0) == [1] * 5
