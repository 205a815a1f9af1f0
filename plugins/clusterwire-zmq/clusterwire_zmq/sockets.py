"""Multipart send and receive without pyzmq's per-message overhead.

pyzmq's ``send_multipart``/``recv_multipart`` cost about 9 us more per round trip than
single-part calls (type checks per part, a ``RCVMORE`` query per part): a third of a
small call. These send small parts by copy and large ones without, and read the "more"
flag from each received frame.

Flags and options are plain ints here: pyzmq's constants are enums, and every ``|``
or ``&`` on them builds a new enum member in Python (a microsecond or more each).
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_COPY_THRESHOLD = zmq.COPY_THRESHOLD


def readable(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock`` (cheaper than a NOBLOCK receive failing)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def send_parts(sock: zmq.Socket, parts: Sequence, flags: int = 0) -> None:
    """Send one multipart message; parts of ``zmq.COPY_THRESHOLD`` bytes or more zero-copy."""
    last = len(parts) - 1
    more = flags | _SNDMORE
    for index in range(last):
        part = parts[index]
        sock.send(part, more, copy=memoryview(part).nbytes < _COPY_THRESHOLD)
    part = parts[last]
    sock.send(part, flags, copy=memoryview(part).nbytes < _COPY_THRESHOLD)


def recv_parts(sock: zmq.Socket, flags: int = 0, max_parts: int = 0) -> list[zmq.Frame]:
    """Receive one multipart message as frames (no copies).

    With ``max_parts``, a message of more parts gives its first ``max_parts + 1`` only: the
    rest are received and dropped at once, so a message of millions of tiny parts does not
    become millions of frames here.
    """
    frame = sock.recv(flags, copy=False)
    parts = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        if not max_parts or len(parts) <= max_parts:
            parts.append(frame)
    return parts
