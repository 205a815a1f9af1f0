"""A raw ZMTP 3.0 peer over a plain TCP socket, for attacks libzmq's own sockets cannot make.

It speaks the greeting and the PLAIN handshake (RFC 23/ZMTP, 24/ZMTP-PLAIN) as a DEALER
and then writes frames as told: e.g. parts with the MORE flag and never the last one,
which a libzmq socket would hold back until the message is complete.
"""

from __future__ import annotations

import socket
import struct

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def _frame_header(flags: int, size: int) -> bytes:
    if size < 256:
        return struct.pack("!BB", flags, size)
    return struct.pack("!BQ", flags | _LONG, size)


def _command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    return _frame_header(_COMMAND, len(data)) + data


class ZmtpPeer:
    """A connected, authenticated raw ZMTP DEALER."""

    def __init__(self, address: str, username: bytes, password: bytes, timeout: float = 10):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._buffer = b""
        try:
            greeting = (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00"
                        + b"PLAIN".ljust(20, b"\0") + b"\x00" + bytes(31))
            self.sock.sendall(greeting)
            theirs = self._read(64)
            assert theirs[0] == 0xFF and theirs[9] == 0x7F, theirs
            assert theirs[12:17] == b"PLAIN", theirs
            self.sock.sendall(_command(b"HELLO", bytes([len(username)]) + username
                                       + bytes([len(password)]) + password))
            assert self._read_command() == b"WELCOME"
            socket_type = b"\x0bSocket-Type" + struct.pack("!I", 6) + b"DEALER"
            self.sock.sendall(_command(b"INITIATE", socket_type))
            assert self._read_command() == b"READY"
        except BaseException:
            self.sock.close()
            raise

    def _read(self, count: int) -> bytes:
        while len(self._buffer) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the listener closed the connection")
            self._buffer += chunk
        data, self._buffer = self._buffer[:count], self._buffer[count:]
        return data

    def _read_command(self) -> bytes:
        flags, size = self._read(2)
        if flags & _LONG:
            size = struct.unpack("!Q", bytes([size]) + self._read(7))[0]
        assert flags & _COMMAND, f"expected a command, got flags {flags:#x}"
        body = self._read(size)
        return body[1:1 + body[0]]

    def send_part(self, data: bytes | memoryview, more: bool) -> None:
        """One message part (MORE set unless it is the last)."""
        self.sock.sendall(_frame_header(_MORE if more else 0, len(data)))
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()
