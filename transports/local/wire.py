"""Message layouts of the grpc+local transport (the one place its wire format is written down).

**Control message**: an envelope (``clusterwire.envelope``) with these fields and
per-buffer place::

    magic "CWL1" | client id u64 | transfer id u64
    each buffer's place (two table columns): segment u32, offset u64

A BULK buffer lies in a sealed memfd segment, entry ``segment`` of the
descriptors that travel with the message (below), at ``offset`` (bulk buffers of
one frame are packed into one new segment; a buffer received earlier is re-sent
as its own segment's descriptor, never copied); an INLINE buffer's place is unused.

**Unix-socket messages** (SOCK_SEQPACKET, one message per packet, descriptors as
SCM_RIGHTS; the listener's abstract name is ``"\\0clusterwire-local:" + host:port``)::

    "CWU1" | op u8 | id u64 | count u32 | payload

A connection's first message says what it is for:

* ``HELLO``: a *segment connection* (the calls travel in gRPC unary calls, as under
  TLS): id = client id, payload = the cluster token (if any). Only ``SEGMENTS``
  messages follow (id = transfer id, ``count`` descriptors attached); a control
  message whose transfer id names them takes them.
* ``CALLS``: a *call connection* (no TLS): id = client id, payload = the token. The
  listener answers ``READY`` (admitted) or ``ERROR`` (then closes it). Then the
  client sends one call at a time and the listener answers it on the same connection:

      request:  [SEGMENTS]* ("CWL1" control message | INDIRECT)   client id 0, transfer id = call id
      reply:    [SEGMENTS]* ("CWL1" control message | INDIRECT)   transfer id = the call's id
                or ERROR (id = the call's id)

  A message's descriptors are those of the SEGMENTS messages before it (same id, in
  order; only needed past ``MAX_FDS_PER_MESSAGE``) followed by its own. A reply's bulk
  buffers may lie in a *reusable* segment of the connection's pool (``pool``: sealed
  against future writes; the listener refills it once released): before a later call the
  client sends ``RELEASE`` (id 0, no descriptors, payload = the inodes u64 of the
  segments it no longer maps, at most ``MAX_RELEASES``); the listener reads it on. A control
  message longer than ``MAX_PACKET`` travels as ``INDIRECT``: payload = its length
  u64, and its first attached descriptor is a sealed segment holding it.
  ``ERROR``: payload = a clusterwire error code u32 and a UTF-8 message. The
  listener answers ``UNAVAILABLE`` only for a call it did not run (it is stopping),
  ``CANCELLED`` for a call still running when its grace ran out; malformed control
  messages and frames over ``max_message_bytes`` get ``INVALID_ARGUMENT`` /
  ``RESOURCE_EXHAUSTED``. A message that is not this protocol (bad magic or op, a
  truncated packet or descriptor list, descriptors a message did not declare) closes
  that connection.
"""

from __future__ import annotations

import struct

from clusterwire.envelope import BULK, Envelope, Layout
from clusterwire.errors import InvalidArgumentError

#: Fields (client id, transfer id); place (segment, offset).
LAYOUT = Layout(b"CWL1", "grpc+local", "QQ", "IQ")
_UNIX = struct.Struct("<4sBQI")
_ERROR = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
HELLO, SEGMENTS, CALLS, READY, ERROR, INDIRECT, RELEASE = 1, 2, 3, 4, 5, 6, 7
_OPS = frozenset((HELLO, SEGMENTS, CALLS, READY, ERROR, INDIRECT, RELEASE))
MAX_FDS_PER_MESSAGE = 250  # below the kernel's SCM_MAX_FD (253)
#: The largest message on a call connection (larger control messages travel INDIRECT); far
#: below the socket buffers (SO_SNDBUF, 208 KiB by default), which bound a SEQPACKET message.
MAX_PACKET = 64 << 10
UNIX_MAGIC = b"CWU1"
CONTROL_MAGIC = LAYOUT.magic
_MAX_ERROR_TEXT = 4000


def segments(envelope: Envelope) -> int:
    """Descriptors the BULK buffers of ``envelope`` refer to (highest index + 1)."""
    if BULK not in envelope.kinds:
        return 0
    return max((segment + 1 for kind, (segment, _) in zip(envelope.kinds, envelope.places,
                                                          strict=True) if kind == BULK),
               default=0)


def encode_unix(op: int, ident: int, count: int, payload: bytes = b"") -> bytes:
    """A Unix-socket message (descriptors travel beside it)."""
    return _UNIX.pack(UNIX_MAGIC, op, ident, count) + payload


def decode_unix(message: bytes) -> tuple[int, int, int, bytes]:
    """(op, id, count, payload) of a Unix-socket message."""
    if len(message) < _UNIX.size:
        raise InvalidArgumentError("Malformed unix-socket message.")
    magic, op, ident, count = _UNIX.unpack_from(message)
    if magic != UNIX_MAGIC or op not in _OPS:
        raise InvalidArgumentError("Malformed unix-socket message.")
    return op, ident, count, message[_UNIX.size:]


def encode_error(ident: int, code: int, text: str) -> bytes:
    """An ERROR message: ``code`` (a clusterwire error code) and ``text``."""
    return encode_unix(ERROR, ident, 0, _ERROR.pack(code)
                       + text.encode("utf-8", "replace")[:_MAX_ERROR_TEXT])


def decode_error(payload: bytes) -> tuple[int, str]:
    """(code, text) of an ERROR message's payload."""
    if len(payload) < _ERROR.size:
        raise InvalidArgumentError("Malformed unix-socket error message.")
    return _ERROR.unpack_from(payload)[0], bytes(payload[_ERROR.size:]).decode("utf-8",
                                                                              "replace")


def encode_indirect(ident: int, count: int, length: int) -> bytes:
    """An INDIRECT message: a ``length``-byte control message lies in the first of the
    ``count`` descriptors attached."""
    return encode_unix(INDIRECT, ident, count, _LENGTH.pack(length))


def encode_release(inodes: list[int]) -> bytes:
    """A RELEASE message naming ``inodes`` (at most ``MAX_RELEASES``)."""
    return encode_unix(RELEASE, 0, 0, struct.pack(f"<{len(inodes)}Q", *inodes))


def decode_release(payload: bytes) -> list[int]:
    """The inodes a RELEASE message's payload names."""
    if len(payload) % _LENGTH.size or not payload:
        raise InvalidArgumentError("Malformed unix-socket release message.")
    return list(struct.unpack(f"<{len(payload) // _LENGTH.size}Q", payload))


def indirect_length(payload: bytes) -> int:
    """The control message length an INDIRECT message's payload declares."""
    if len(payload) != _LENGTH.size:
        raise InvalidArgumentError("Malformed unix-socket indirect message.")
    return _LENGTH.unpack(payload)[0]


MAX_UNIX_MESSAGE = _UNIX.size + 4096
#: The most inodes one RELEASE message names (its payload fits ``MAX_UNIX_MESSAGE``).
MAX_RELEASES = 4096 // _LENGTH.size
