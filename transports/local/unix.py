"""Unix SOCK_SEQPACKET sockets of grpc+local: the listener's name, messages with descriptors.

Sending and reading the messages of a call connection (``wire``: SEGMENTS before a
message whose descriptors do not fit one packet, INDIRECT for a control message past the
packet limit), receive timeouts, readiness waits and shutdown. Every function works on
a blocking socket and never leaves a received descriptor open when it raises.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.transports._grpc_common.call_pool import set_receive_timeout
from clusterwire.transports._grpc_common.call_pool import timeval as _timeval
from clusterwire.transports.local import sealed, wire

#: The most descriptors held for one connection (received, not yet claimed).
MAX_HELD_FDS = 65536
#: What ``read_message`` returns as the op of a control message (no op of the wire's).
CONTROL = 0
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_ANCILLARY = socket.CMSG_SPACE(wire.MAX_FDS_PER_MESSAGE * 4)
_RECV_FLAGS = socket.MSG_CMSG_CLOEXEC
#: Socket buffer wanted on call connections: a SEQPACKET message must fit the sender's.
_SOCKET_BUFFER = 4 * wire.MAX_PACKET


class Garbage(Exception):
    """A message that is not this protocol: the connection it came on is closed."""


class Closed(Exception):
    """The peer closed the connection (end of file)."""


def socket_name(address: str) -> str:
    """The abstract Unix name of the grpc+local listener at ``address`` (host:port; see
    ``wire``)."""
    return f"\0clusterwire-local:{address}"


def another_host(address: str) -> errors.FailedPreconditionError | None:
    """The error for a listener at ``address`` that cannot be on this host (None when it may
    be): its host resolves, and to no address that can be bound here.

    The abstract Unix names grpc+local listens on exist only in the network namespace of
    their listener, so a task of another host is refused like one that has not started yet;
    retrying until the deadline could not help it, and would hide why.
    """
    host, _ = split_host_port(address)
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in found:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:
                    continue
            return None
    return errors.FailedPreconditionError(
        f"grpc+local connects only tasks of the same host, and {host} (of {address}) is not "
        "an address of this host: use a protocol that crosses hosts (grpc, grpc+verbs) for "
        "this cluster.")


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix connection."""
    credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(credentials)[1]


def peer_process(conn: socket.socket) -> tuple[int, int] | None:
    """The process at the other end of a Unix connection as (pid, start time in clock ticks
    since boot), which no later process of a reused pid shares; None if it cannot be told
    (its pid is not visible here, or it has exited)."""
    pid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[0]
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return pid, int(stat.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def peer_name(conn: socket.socket) -> str:
    """The peer of a Unix connection as grpc+local tells peers apart (``Frame.peer``, the
    pending and authenticated connections' fair shares): "uid:N" of its process's user."""
    return f"uid:{peer_uid(conn)}"


def shutdown(sock: socket.socket) -> None:
    """Shut down and close ``sock``; shutdown wakes threads blocked on it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def hung_up(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` has closed its end (or ``sock`` is closed), at once: a
    connection's own thread may not have run since on a busy host."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLRDHUP)
    except ValueError:  # closed here
        return True
    return any(events & (select.POLLHUP | select.POLLRDHUP) for _, events in poller.poll(0))


def close_all(fds: Sequence[int]) -> None:
    """Close every descriptor of ``fds``."""
    for fd in fds:
        os.close(fd)


def packet_limit(sock: socket.socket) -> int:
    """The longest message ``sock`` sends as one packet (its send buffer bounds it)."""
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < _SOCKET_BUFFER:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return max(min(wire.MAX_PACKET, buffer - 1024), 1024)


def connect(sock: socket.socket, path: str, seconds: float | None) -> None:
    """Connect a blocking ``sock`` to ``path``, waiting up to ``seconds`` (None: no limit)
    for room in the listener's accept queue; TimeoutError if none came.

    A kernel timeout (SO_SNDTIMEO, which a Unix connect honours): a socket with a Python
    timeout is non-blocking underneath, and its connect fails at once (EAGAIN) while the
    queue is full, e.g. of a flood of silent connections the listener has yet to close.
    """
    if seconds is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
    try:
        sock.connect(path)
    except BlockingIOError:  # the time ran out with the queue still full
        raise TimeoutError(f"no room in the accept queue of {path!r}") from None
    finally:
        if seconds is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0))


def ready(sock: socket.socket, timeout: float | None, events: int = select.POLLIN) -> bool:
    """Whether ``sock`` is ready for ``events`` (to read) within ``timeout`` seconds (None:
    no limit)."""
    poller = select.poll()
    poller.register(sock, events)
    return bool(poller.poll(None if timeout is None else max(int(timeout * 1000), 1)))


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors of a received message's ancillary data (SCM_RIGHTS)."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", data[:len(data) - len(data) % 4])
    return fds


def _receive(sock: socket.socket, deadline: float | None = None,
             received: Any = None) -> tuple[bytes, list[int]]:
    """One message and its descriptors (close-on-exec), on a blocking socket.

    ``Closed`` at end of file; ``ConnectionResetError`` if the peer closed with our last
    message unread (whatever it sent before that is returned first); ``Garbage`` if the
    message or its descriptors were truncated. A client's connection has a receive timeout
    (``_grpc_common.call_pool.PooledConnection.arm``): when it expires before ``deadline``,
    the wait goes on; after it, ``TimeoutError``. ``received``: what a first ``recvmsg`` returned or
    raised.
    """
    while True:
        if received is None:
            try:
                received = sock.recvmsg(wire.MAX_PACKET, _ANCILLARY, _RECV_FLAGS)
            except (BlockingIOError, ConnectionResetError) as err:
                received = err
        if isinstance(received, BlockingIOError):  # the receive timeout expired
            left = None if deadline is None else deadline - time.monotonic()
            if left is None or left <= 0:
                raise TimeoutError("timed out")
            set_receive_timeout(sock, left)
            received = None
            continue
        if isinstance(received, ConnectionResetError):
            # Linux reports the reset before the messages still queued: read those first.
            received = sock.recvmsg(wire.MAX_PACKET, _ANCILLARY,
                                    _RECV_FLAGS | socket.MSG_DONTWAIT)
            if not received[0]:
                close_all(_descriptors(received[1]))
                raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        break
    message, ancillary, flags, _ = received
    fds = _descriptors(ancillary) if ancillary else []
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_all(fds)
        raise Garbage("truncated message")
    if not message:
        close_all(fds)
        raise Closed
    return message, fds


def read_message(sock: socket.socket, deadline: float | None = None,
                 idle_timeout: float | None = None,
                 on_release: Callable[[list[int]], None] | None = None
                 ) -> tuple[int, int, Any, list[int]]:
    """Read one message of a call connection, with the SEGMENTS messages before it (and,
    with ``on_release``, the listener's side, the RELEASE messages: given to it).

    Returns (op, id, body, descriptors): op READY; ERROR with body (code, text); or
    ``CONTROL``, body the control message (bytes, or a view of the sealed segment an
    INDIRECT message names; id 0 for a plain one: its envelope has it). The caller owns
    the descriptors. Raises ``Garbage`` (anything else, or ``idle_timeout`` seconds
    without the rest of a call whose segments came), ``Closed``, ``TimeoutError`` (past
    ``deadline``) and ``OSError``, closing what it received.
    """
    # The common message first, in as few steps as it takes: a control message alone.
    try:
        received = sock.recvmsg(wire.MAX_PACKET, _ANCILLARY, _RECV_FLAGS)
    except (BlockingIOError, ConnectionResetError) as err:
        received = err
    else:
        if not received[1] and not received[2] and received[0][:4] == wire.CONTROL_MAGIC:
            return CONTROL, 0, received[0], []
    held: list[int] = []
    try:
        while True:
            if received is None and held and idle_timeout is not None and not ready(
                    sock, idle_timeout):
                raise Garbage("a call's segments came, then nothing")
            message, fds = _receive(sock, deadline, received)
            received = None
            if fds:
                held += fds
            if message[:4] == wire.CONTROL_MAGIC:
                return CONTROL, 0, message, held
            try:
                op, ident, count, payload = wire.decode_unix(message)
            except errors.InvalidArgumentError:
                raise Garbage("not a grpc+local message") from None
            if count != len(fds) or len(held) > MAX_HELD_FDS:
                raise Garbage("descriptors other than declared")
            if op == wire.SEGMENTS:
                continue
            if op == wire.RELEASE and on_release is not None and not fds:
                try:
                    on_release(wire.decode_release(payload))
                except errors.InvalidArgumentError:
                    raise Garbage("malformed release message") from None
                continue
            if op == wire.INDIRECT and fds:
                try:
                    length = wire.indirect_length(payload)
                    held.remove(fds[0])
                    segment = sealed.open_segment(fds[0])  # owns (and closes) the descriptor
                except errors.InvalidArgumentError as err:
                    raise Garbage(err.message) from None
                if length > segment.nbytes:
                    raise Garbage("an indirect message longer than its segment")
                return CONTROL, ident, memoryview(segment)[:length], held
            if op == wire.ERROR and not held:
                try:
                    return op, ident, wire.decode_error(payload), held
                except errors.InvalidArgumentError:
                    raise Garbage("malformed error message") from None
            if op == wire.READY and not held:
                return op, ident, None, held
            raise Garbage(f"unexpected message (op {op})")
    except BaseException:
        close_all(held)
        raise


def _send_one(sock: socket.socket, message: bytes, fds: list[int],
              deadline: float | None | bool) -> None:
    """Send one message without blocking; ``deadline`` False: BlockingIOError if there is
    no room, else wait for room until ``deadline`` (None: for as long as it takes)."""
    while True:
        try:
            if fds:
                socket.send_fds(sock, [message], fds, socket.MSG_DONTWAIT)
            else:
                sock.send(message, socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            if deadline is False:
                raise
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not ready(sock, left, select.POLLOUT)):
                raise TimeoutError("no room to send") from None
            if left is None:
                ready(sock, None, select.POLLOUT)


def send_message(sock: socket.socket, ident: int, message: bytes, fds: Sequence[int],
                 limit: int, deadline: float | None | bool = False) -> None:
    """Send a control message and its descriptors on a call connection (the caller keeps
    its copies of the descriptors): SEGMENTS messages first for those past one message's
    share, and the message itself in a sealed segment (INDIRECT) past ``limit`` (the
    socket's ``packet_limit``). ``deadline``: as for ``_send_one`` (the listener never
    waits: False)."""
    if not fds and len(message) <= limit:  # the common case, in one step
        try:
            sock.send(message, socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            pass
    indirect = len(message) > limit
    room = wire.MAX_FDS_PER_MESSAGE - indirect
    split = max(len(fds) - room, 0)
    for start in range(0, split, wire.MAX_FDS_PER_MESSAGE):
        part = list(fds[start:min(start + wire.MAX_FDS_PER_MESSAGE, split)])
        _send_one(sock, wire.encode_unix(wire.SEGMENTS, ident, len(part)), part, deadline)
    own = list(fds[split:])
    if not indirect:
        _send_one(sock, message, own, deadline)
        return
    fd, _ = sealed.create_packed([memoryview(message)])
    try:
        _send_one(sock, wire.encode_indirect(ident, len(own) + 1, len(message)), [fd, *own],
                  deadline)
    finally:
        os.close(fd)


def send_releases(sock: socket.socket, inodes: Sequence[int],
                  deadline: float | None) -> None:
    """Send RELEASE messages naming ``inodes`` (reusable segments no longer mapped here),
    waiting for room until ``deadline`` as ``_send_one``."""
    for start in range(0, len(inodes), wire.MAX_RELEASES):
        _send_one(sock, wire.encode_release(list(inodes[start:start + wire.MAX_RELEASES])),
                  [], deadline)


def send_error(sock: socket.socket, ident: int, code: int, text: str) -> None:
    """Send an ERROR message, best effort: never blocks, ignores a failed send."""
    with contextlib.suppress(OSError):
        sock.send(wire.encode_error(ident, code, text), socket.MSG_DONTWAIT)
