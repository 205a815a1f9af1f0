"""The "zmq" transport: frames over ZeroMQ, ROUTER listeners and DEALER channels."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import zmq

from clusterwire.security import Security
from clusterwire.transport import Channel, Handler, Listener, ListenOptions, Transport
from clusterwire_zmq.channel import ZmqChannel
from clusterwire_zmq.listener import ZmqListener
from clusterwire_zmq.options import Settings


class ZmqTransport(Transport):
    """One per process: listeners own their zmq context, channels share one."""

    protocol = "zmq"

    def __init__(self, options: Mapping[str, Any] | None = None):
        self.settings = Settings.from_options(options)
        self._lock = threading.Lock()
        self._context: zmq.Context | None = None

    def _client_context(self) -> zmq.Context:
        with self._lock:
            if self._context is None:
                self._context = zmq.Context(io_threads=1)
            return self._context

    def listen(self, address: str, handler: Handler, options: ListenOptions) -> Listener:
        return ZmqListener(address, handler, options, self.settings)

    def connect(self, address: str, security: Security | None = None) -> Channel:
        return ZmqChannel(self._client_context(), address, self.settings, security)

    def info(self) -> dict[str, str]:
        return {
            "control": f"zmq ROUTER/DEALER (libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__})",
            "data": f"zero-copy zmq frames for buffers >= {self.settings.inline_bytes} B",
            "security": "cluster token checked by ZAP at connect (PLAIN); no TLS",
        }
