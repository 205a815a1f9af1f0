"""Message layouts of the grpc+local transport.

Control message (one gRPC unary call each way): an envelope
(``clusterwire.envelope``) with the fields and per-buffer place::

    magic "CWL1" | client id u64 | transfer id u64
    each buffer's place (two table columns): segment u32, offset u64

A BULK buffer lies in a sealed memfd segment, entry ``segment`` of the
descriptors sent over the peer's Unix socket under the transfer id, at
``offset`` (bulk buffers of one frame are packed into one new segment; a
buffer received earlier is re-sent as its own segment's descriptor, never
copied); an INLINE buffer's place is unused. Unix-socket messages
(SOCK_SEQPACKET, descriptors as SCM_RIGHTS)::

    "CWU1" | op u8 | id u64 | count u32 | payload
        HELLO: id = client id, payload = the cluster token (if any)
        SEGMENTS: id = transfer id, ``count`` descriptors attached
"""

from __future__ import annotations

import struct

from clusterwire.envelope import BULK, Envelope, Layout
from clusterwire.errors import InvalidArgumentError

#: Fields (client id, transfer id); place (segment, offset).
LAYOUT = Layout(b"CWL1", "grpc+local", "QQ", "IQ")
_UNIX = struct.Struct("<4sBQI")
HELLO, SEGMENTS = 1, 2
MAX_FDS_PER_MESSAGE = 250  # below the kernel's SCM_MAX_FD (253)


def segments(envelope: Envelope) -> int:
    """Descriptors the BULK buffers of ``envelope`` refer to (highest index + 1)."""
    if BULK not in envelope.kinds:
        return 0
    return max((segment + 1 for kind, (segment, _) in zip(envelope.kinds, envelope.places,
                                                          strict=True) if kind == BULK),
               default=0)


def encode_unix(op: int, ident: int, count: int, payload: bytes = b"") -> bytes:
    """A Unix-socket message (descriptors travel beside it)."""
    return _UNIX.pack(b"CWU1", op, ident, count) + payload


def decode_unix(message: bytes) -> tuple[int, int, int, bytes]:
    """(op, id, count, payload) of a Unix-socket message."""
    if len(message) < _UNIX.size:
        raise InvalidArgumentError("Malformed unix-socket message.")
    magic, op, ident, count = _UNIX.unpack_from(message)
    if magic != b"CWU1" or op not in (HELLO, SEGMENTS):
        raise InvalidArgumentError("Malformed unix-socket message.")
    return op, ident, count, message[_UNIX.size:]


MAX_UNIX_MESSAGE = _UNIX.size + 4096
