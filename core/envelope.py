"""The frame envelope: how every built-in transport (and the zmq plugin) lays out a frame.

One envelope carries a frame's header and the table of its buffers::

    magic 4 bytes | the transport's fields | header_len u32 | count u32 |
    kind u8 * count | length u64 * count | [each place field * count] |
    header | inline bytes

All little-endian and unpadded; the buffer table is stored by column (all kinds,
then all lengths, then each field of the transport's per-buffer place, if any).
A buffer of kind ``INLINE`` follows the header in the envelope itself (in buffer
order); a ``BULK`` one travels by the transport's data path (chunk stream, TCP
bulk port, sealed memory, UCX message, zmq part).
A transport names its magic, its own fixed fields (``struct`` codes: a fetch id, a
slot key, a request id) and, if it needs one, a fixed per-buffer place (where a
bulk buffer lies); everything else, and every check of declared sizes against the
limits below, is here, made before the receiver allocates anything.

The C helper of grpc+verbs (``transports/verbs/_ucp.c``) implements the same
encoding for its layout, reading ``MAX_BUFFERS`` and ``MAX_HEADER_BYTES`` from
this module; ``tests/envelope_vectors.json`` holds frames and malformed envelopes
that both must agree on, byte for byte and error for error.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from clusterwire.errors import InvalidArgumentError, ResourceExhaustedError

INLINE, BULK = 0, 1
#: Buffers one frame may have (grpc+verbs tags a bulk buffer's index in 16 bits).
MAX_BUFFERS = 1 << 16
#: Bytes a frame's header may have.
MAX_HEADER_BYTES = 64 << 20
#: The ``limit`` of ``Layout.decode`` for a reply a client asked for: what it will receive
#: is bounded by what it asked (the size checks of the buffer table still apply).
REPLY_LIMIT = 1 << 42
#: Inline bytes a frame carries at most, by default (``inline_kinds``).
INLINE_BUDGET = 1 << 20
_CACHED_TABLES = 64  # buffer counts with a precompiled table Struct


def inline_kinds(views: Sequence[memoryview], threshold: int,
                 budget: int = INLINE_BUDGET) -> list[int]:
    """Each buffer's kind: INLINE while under ``threshold`` bytes and ``budget`` is not used up.

    The rest are BULK. The C helper of grpc+verbs applies the same rule.
    """
    kinds, used = [], 0
    for view in views:
        nbytes = view.nbytes
        if nbytes < threshold and used + nbytes <= budget:
            kinds.append(INLINE)
            used += nbytes
        else:
            kinds.append(BULK)
    return kinds


def check_declared(count: int, header_len: int) -> None:
    """ResourceExhaustedError if a frame declares more buffers or header bytes than allowed."""
    if count > MAX_BUFFERS:
        raise ResourceExhaustedError(
            f"Frame declares {count} buffers; the limit is {MAX_BUFFERS} buffers per frame.")
    if header_len > MAX_HEADER_BYTES:
        raise ResourceExhaustedError(
            f"Frame declares a {header_len}-byte header; the limit is {MAX_HEADER_BYTES} "
            "header bytes.")


def check_total(total: int, limit: int) -> None:
    """ResourceExhaustedError if a frame's buffers add up to more than ``limit`` bytes."""
    if total > limit:
        raise ResourceExhaustedError(
            f"Frame of {total} bytes exceeds the limit of {limit} bytes (max_message_bytes).")


class Envelope(NamedTuple):
    """A decoded envelope (a tuple: cheap on the per-call path)."""

    #: The transport's own fields, in its layout's order.
    fields: tuple
    header: bytes
    kinds: tuple[int, ...]
    lengths: tuple[int, ...]
    #: Each buffer's place (a tuple of the layout's place fields); empty when the layout has
    #: none or every buffer is INLINE.
    places: tuple
    #: The inline buffers' bytes, concatenated: a view of the message, not a copy.
    inline: memoryview


#: Builds an Envelope from one tuple without NamedTuple's Python-level ``__new__``.
_new_envelope = functools.partial(tuple.__new__, Envelope)


class Layout:
    """One transport's envelope: its magic, its own fields and its per-buffer place.

    ``fields``: ``struct`` codes of the transport's fields (little-endian, unpadded);
    ``place``: one ``struct`` code per place field, each a column of the buffer table.
    ``protocol`` names the transport in error messages.
    """

    def __init__(self, magic: bytes, protocol: str, fields: str = "", place: str = ""):
        if len(magic) != 4:
            raise ValueError(f"an envelope magic is 4 bytes, not {magic!r}")
        self.magic = magic
        self.protocol = protocol
        self.prefix = struct.Struct(f"<4s{fields}II")
        self._prefix_size = self.prefix.size
        self._place = place
        self._entry_size = struct.calcsize(f"<BQ{place}")
        # Frames of up to _CACHED_TABLES buffers: one precompiled Struct call each way.
        self._tables = [self._table(count) for count in range(_CACHED_TABLES + 1)]
        self._columns = [self._table(count, prefix=False) for count in range(_CACHED_TABLES + 1)]

    def _table(self, count: int, prefix: bool = True) -> struct.Struct:
        """The Struct of the prefix (if ``prefix``) and the table of ``count`` buffers."""
        columns = "".join(f"{count}{code}" for code in f"BQ{self._place}")
        return struct.Struct((self.prefix.format if prefix else "<") + columns)

    def max_bytes(self, inline_bytes: int) -> int:
        """The largest envelope whose inline buffers add up to at most ``inline_bytes``."""
        return self._prefix_size + MAX_BUFFERS * self._entry_size + MAX_HEADER_BYTES + inline_bytes

    def encode(self, fields: tuple, header: bytes, views: Sequence[memoryview],
               kinds: Sequence[int] | None = None,
               places: Sequence[tuple] | None = None) -> bytes:
        """An envelope of byte views ``views``; only INLINE buffers' bytes are included.

        ``kinds`` None: every buffer is INLINE. ``places``: each buffer's place, when the
        layout has one (None: zeros).
        """
        inline: Sequence[memoryview] = views
        if kinds is not None and BULK in kinds:
            inline = [view for view, kind in zip(views, kinds, strict=True) if kind == INLINE]
        table = self._pack_table(fields, len(header), [view.nbytes for view in views], kinds,
                                 places)
        return b"".join([table, header, *inline])

    def encode_table(self, fields: tuple, header: bytes, lengths: Sequence[int],
                     kinds: Sequence[int] | None = None,
                     places: Sequence[tuple] | None = None) -> bytes:
        """An envelope's prefix, buffer table and header: all of it but the inline bytes."""
        return self._pack_table(fields, len(header), lengths, kinds, places) + header

    def _pack_table(self, fields: tuple, header_len: int, lengths: Sequence[int],
                    kinds: Sequence[int] | None, places: Sequence[tuple] | None) -> bytes:
        count = len(lengths)
        if count > MAX_BUFFERS or header_len > MAX_HEADER_BYTES:
            check_declared(count, header_len)
        table = self._tables[count] if count <= _CACHED_TABLES else self._table(count)
        if kinds is None:
            kinds = [INLINE] * count
        if not self._place:
            return table.pack(self.magic, *fields, header_len, count, *kinds, *lengths)
        columns: list[int] = []
        for column in range(len(self._place)):
            columns += [0] * count if places is None else [place[column] for place in places]
        return table.pack(self.magic, *fields, header_len, count, *kinds, *lengths, *columns)

    def decode(self, message: Any, limit: int) -> Envelope:
        """Parse and check an envelope (any buffer) before anything it declares is allocated.

        InvalidArgumentError if it is malformed, ResourceExhaustedError if it declares more
        than the limits allow (``limit``: the receiver's max_message_bytes).
        """
        if type(message) is not bytes:  # bytes (what gRPC hands over) are sliced as they are
            message = memoryview(message).cast("B")
        size, prefix_size = len(message), self._prefix_size
        if size < prefix_size:
            raise InvalidArgumentError(
                f"Malformed frame: {size} bytes is shorter than a {self.protocol} prefix "
                f"({prefix_size} bytes).")
        head = self.prefix.unpack_from(message)
        if head[0] != self.magic:
            raise InvalidArgumentError(
                f"Malformed frame: bad magic {bytes(head[0])!r} (not a {self.protocol} peer?).")
        header_len, count = head[-2], head[-1]
        if count > MAX_BUFFERS or header_len > MAX_HEADER_BYTES:
            check_declared(count, header_len)
        start = prefix_size + self._entry_size * count
        end = start + header_len
        if size < end:
            raise InvalidArgumentError(
                f"Malformed frame: {size} bytes, shorter than the {end} its buffer table and "
                "header declare.")
        columns = self._columns[count] if count <= _CACHED_TABLES else self._table(count, False)
        values = columns.unpack_from(message, prefix_size)
        kinds, lengths = values[:count], values[count:2 * count]
        if kinds and max(kinds) > BULK:
            raise InvalidArgumentError(
                f"Malformed frame: buffer kind {max(kinds)} (0 is inline, 1 bulk).")
        total = sum(lengths)
        if total > limit:
            check_total(total, limit)
        expected = total
        if BULK in kinds:
            expected = sum(n for k, n in zip(kinds, lengths, strict=True) if k == INLINE)
        if size - end != expected:
            raise InvalidArgumentError(
                f"Malformed frame: {size - end} inline bytes, declared {expected}.")
        places = ()
        if self._place and BULK in kinds:
            places = tuple(zip(*[values[column * count:(column + 1) * count]
                                 for column in range(2, 2 + len(self._place))], strict=True))
        return _new_envelope((head[1:-2], bytes(message[start:end]), kinds, lengths, places,
                              memoryview(message)[end:]))

    def peek_fields(self, message: Any) -> tuple | None:
        """The transport's fields of a message that may be malformed (None without a prefix)."""
        view = memoryview(message).cast("B")
        if view.nbytes < self.prefix.size or bytes(view[:4]) != self.magic:
            return None
        return self.prefix.unpack_from(view)[1:-2]


def split_inline(envelope: Envelope, copy: bool = True) -> list[memoryview]:
    """The INLINE buffers of ``envelope``, in order: views of one writable copy of its
    inline bytes, or with ``copy=False`` views of the message itself."""
    kinds = envelope.kinds
    if not kinds:
        return []
    inline = memoryview(bytearray(envelope.inline)) if copy else envelope.inline
    if len(kinds) == 1:
        return [inline] if kinds[0] == INLINE else []
    views, offset = [], 0
    for kind, length in zip(kinds, envelope.lengths, strict=True):
        if kind == INLINE:
            views.append(inline[offset:offset + length])
            offset += length
    return views


def bulk_lengths(envelope: Envelope) -> list[int]:
    """The lengths of the BULK buffers of ``envelope``, in order."""
    return [n for k, n in zip(envelope.kinds, envelope.lengths, strict=True) if k == BULK]


def interleave(kinds: Sequence[int], inline: Iterable[Any], bulk: Iterable[Any]) -> list[Any]:
    """A frame's buffers in order, from its INLINE buffers and its BULK ones (each in order)."""
    inline, bulk = iter(inline), iter(bulk)
    return [next(inline) if kind == INLINE else next(bulk) for kind in kinds]
