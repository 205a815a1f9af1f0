"""The zmq transport's options (plugins.toml ``[options.zmq]``) and socket settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from clusterwire.transport_options import OptionReader

#: pyzmq's own threshold: below it a zero-copy send costs more than copying.
DEFAULT_INLINE_BYTES = zmq.COPY_THRESHOLD


@dataclass(frozen=True)
class Settings:
    """``inline_bytes``: buffers below it are copied into the message's first part, larger
    ones are sent zero-copy as parts of their own. ``heartbeat_seconds``: ZMTP heartbeat
    interval; a connection that answers nothing for three intervals is dropped, so calls
    to a peer that vanished without closing its sockets fail as UnavailableError."""

    inline_bytes: int = DEFAULT_INLINE_BYTES
    heartbeat_seconds: float = 2.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> Settings:
        """Validate plugin options; InvalidArgumentError names an unknown or bad one."""
        reader = OptionReader("zmq", options)
        inline = reader.number("inline_bytes", DEFAULT_INLINE_BYTES, 0, (1 << 31) - 1,
                               integer=True)
        heartbeat = reader.number("heartbeat_seconds", 2.0, 0.01, 3600)
        reader.finish()
        return cls(inline, heartbeat)

    def configure(self, sock: zmq.Socket, ipv6: bool) -> None:
        """Options every socket of the transport gets."""
        interval = int(self.heartbeat_seconds * 1000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(ipv6))
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * interval)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * interval)
