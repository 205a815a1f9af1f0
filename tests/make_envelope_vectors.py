"""Regenerates tests/envelope_vectors.json: ``python tests/make_envelope_vectors.py``.

The vectors are the specification that both the Python envelope and the C helper of
grpc+verbs are tested against (test_envelope.py). They are written from the Python side, so
after regenerating, read the diff byte by byte before keeping it.
"""

from __future__ import annotations

import json
import pathlib
import struct

from clusterwire import envelope, errors
from clusterwire.envelope import inline_kinds
from clusterwire.transports.grpc import framing
from clusterwire.transports.local import wire as local_wire
from clusterwire.transports.verbs import wire as verbs_wire

LAYOUTS = {"grpc": framing.LAYOUT, "grpc+local": local_wire.LAYOUT,
           "grpc+verbs": verbs_wire.LAYOUT}
KEY = bytes(range(1, 9)).hex()
VERBS = "grpc+verbs"


def frame(name: str, layout: str, fields: list, header: str, buffers: list[str],
          threshold: int = 1 << 16, budget: int = 1 << 20, places: list | None = None) -> dict:
    """A frame (hex header and buffers) and its envelope's bytes."""
    views = [memoryview(bytes.fromhex(b)) for b in buffers]
    kinds = inline_kinds(views, threshold, budget)
    values = tuple(bytes.fromhex(f) if isinstance(f, str) else f for f in fields)
    data = LAYOUTS[layout].encode(values, bytes.fromhex(header), views, kinds,
                                  [tuple(p) for p in places] if places else None)
    vector = {"name": name, "layout": layout, "fields": fields, "header": header,
              "buffers": buffers, "threshold": threshold, "budget": budget}
    if places:
        vector["places"] = places
    return {**vector, "kinds": kinds, "bytes": data.hex()}


def verbs_prefix(header_len: int = 0, count: int = 0, magic: bytes = b"CWV1") -> bytes:
    return magic + struct.pack("<I8sII", 0, bytes.fromhex(KEY), header_len, count)


def table(kinds: list[int], lengths: list[int]) -> bytes:
    return bytes(kinds) + struct.pack(f"<{len(lengths)}Q", *lengths)


def malformed(name: str, layout: str, data: bytes, limit: int = 1000) -> dict:
    """A malformed envelope and the error decoding it raises."""
    try:
        LAYOUTS[layout].decode(data, limit)
    except errors.OpError as err:
        return {"name": name, "layout": layout, "bytes": data.hex(), "limit": limit,
                "error": type(err).__name__, "message": err.message}
    raise AssertionError(f"{name}: decoded")


def oversized(name: str, header_bytes: int, count: int) -> dict:
    """A frame too large to send and the error encoding it raises."""
    try:
        verbs_wire.encode(bytes(header_bytes), [b""] * count, 0, 0)
    except errors.OpError as err:
        return {"name": name, "layout": VERBS, "header_bytes": header_bytes,
                "buffer_count": count, "error": type(err).__name__, "message": err.message}
    raise AssertionError(f"{name}: encoded")


def main() -> None:
    frames = [
        frame("empty frame", VERBS, [0, KEY], "", []),
        frame("one 8-byte buffer", VERBS, [0, KEY], b"header".hex(), ["0102030405060708"]),
        frame("error status, message as header", VERBS, [5, "00" * 8], b"stopped".hex(), []),
        frame("empty, inline and bulk buffers", VERBS, [0, KEY], "68",
              ["", "616263", "0011223344"], threshold=4, budget=100),
        frame("inline budget used up", VERBS, [0, KEY], "", ["aa", "bbbb", "cc", "dd"],
              threshold=4, budget=3),
        frame("grpc inline", "grpc", [0, 0], "6869", ["7878", ""]),
        frame("grpc bulk announce", "grpc", [8123, 2**63 - 1], "6869", ["7878", "7979"],
              threshold=0),
        frame("grpc+local segments", "grpc+local", [2**63 + 5, 42], "", ["01", "0203040506"],
              threshold=2, places=[[0, 0], [3, 4096]]),
    ]
    bad = [
        malformed("too short", VERBS, b"CWV1"),
        malformed("bad magic", VERBS, verbs_prefix(magic=b"XXXX")),
        malformed("too many buffers", VERBS, verbs_prefix(count=(1 << 16) + 1)),
        malformed("huge header", VERBS, verbs_prefix(header_len=(64 << 20) + 1)),
        malformed("too many buffers and a huge header", VERBS,
                  verbs_prefix(header_len=(64 << 20) + 1, count=(1 << 16) + 1)),
        malformed("header cut short", VERBS, verbs_prefix(header_len=10) + b"abc"),
        malformed("buffer table cut short", VERBS, verbs_prefix(count=2) + table([0, 0], [1])),
        malformed("bad kind", VERBS, verbs_prefix(count=2) + table([0, 7], [1, 1]) + b"x"),
        malformed("over the limit", VERBS, verbs_prefix(count=1) + table([1], [2000])),
        malformed("over the limit, inline", VERBS,
                  verbs_prefix(count=1) + table([0], [1001]) + bytes(1001)),
        malformed("lengths past 64 bits", VERBS,
                  verbs_prefix(count=2) + table([1, 1], [2**64 - 1, 5])),
        malformed("missing inline bytes", VERBS, verbs_prefix(count=1) + table([0], [5]) + b"abc"),
        malformed("extra inline bytes", VERBS, verbs_prefix(count=1) + table([0], [2]) + b"abc"),
        malformed("inline bytes after bulk buffers", VERBS,
                  verbs_prefix(count=1) + table([1], [2]) + b"ab"),
        malformed("grpc: a verbs envelope", "grpc", verbs_prefix()),
        malformed("grpc+local: bad kind", "grpc+local", b"CWL1" + bytes(16)
                  + struct.pack("<II", 0, 1) + table([2], [0]) + struct.pack("<IQ", 0, 0)),
    ]
    too_large = [oversized("too many buffers to send", 0, (1 << 16) + 1),
                 oversized("too large a header to send", (64 << 20) + 1, 0)]
    document = {
        "about": "Frames and their exact envelope bytes, malformed envelopes and the error "
                 "each must raise, frames too large to send: clusterwire.envelope and the C "
                 "helper of grpc+verbs (transports/verbs/_ucp.c) must both agree with them "
                 "(tests/test_envelope.py). Bytes and byte fields are hex; buffer kinds follow "
                 "envelope.inline_kinds(threshold, budget).",
        "limits": {"MAX_BUFFERS": envelope.MAX_BUFFERS,
                   "MAX_HEADER_BYTES": envelope.MAX_HEADER_BYTES},
        "frames": frames, "malformed": bad, "oversized": too_large,
    }
    path = pathlib.Path(__file__).parent / "envelope_vectors.json"
    path.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
