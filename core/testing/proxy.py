"""A TCP proxy for the kits' checks: it slows a connection's request bytes down (a trickled
upload), or makes its connections come from another address of this host (another peer)."""

from __future__ import annotations

import selectors
import socket
import threading
from dataclasses import dataclass


@dataclass
class _Link:
    """One proxied connection: its request bytes not yet passed on, and those passed."""

    client: socket.socket
    upstream: socket.socket
    held: bytearray
    passed: int = 0
    paused: bool = False


class TrickleProxy:
    """A TCP proxy to ``target`` that passes each connection's first ``burst`` request bytes
    at once, then ``step`` bytes per ``tick`` seconds (a slow upload); replies pass at once.
    It connects to ``target`` from ``source`` (an IP address of this host) if given."""

    _HOLD = 64 << 10  # request bytes held per connection before reading from it pauses

    def __init__(self, target: str, burst: int = 2048, step: int = 32, tick: float = 0.01,
                 source: str | None = None):
        host, port = target.rsplit(":", 1)
        self._target = (host.strip("[]"), int(port))
        self._source = None if source is None else (source, 0)
        self._server = socket.create_server((self._target[0], 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._burst, self._step, self._tick = burst, step, tick
        self._links: list[_Link] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="trickle-proxy")
        self._thread.start()

    def trickling(self, uploads: int) -> bool:
        """Whether ``uploads`` uploads are being trickled: every connection is past its
        burst with bytes held back, and as many bursts came in (calls may share one)."""
        links = list(self._links)
        taken = sum(link.passed + len(link.held) for link in links)
        return bool(links) and taken >= uploads * self._burst and all(
            link.passed >= self._burst and link.held for link in links)

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            try:
                while not self._stop.is_set():
                    for key, _ in selector.select(self._tick):
                        if key.fileobj is self._server:
                            self._accept(selector)
                        elif key.data[0] in self._links:
                            self._forward(selector, *key.data)
                    for link in list(self._links):
                        self._pass_on(selector, link)
            finally:
                for link in self._links:
                    link.client.close()
                    link.upstream.close()
                self._server.close()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            client, _ = self._server.accept()
        except OSError:  # reset before it was taken: an exception here would fail a later test
            return
        try:
            upstream = socket.create_connection(self._target, timeout=5,
                                                source_address=self._source)
        except OSError:
            client.close()
            return
        link = _Link(client, upstream, bytearray())
        self._links.append(link)
        selector.register(client, selectors.EVENT_READ, (link, True))
        selector.register(upstream, selectors.EVENT_READ, (link, False))

    def _forward(self, selector: selectors.BaseSelector, link: _Link, request: bool) -> None:
        try:
            data = (link.client if request else link.upstream).recv(65536)
            if data and not request:
                link.client.sendall(data)
        except OSError:
            data = b""
        if not data:
            self._drop(selector, link)
        elif request:
            link.held += data
            if len(link.held) >= self._HOLD:
                selector.unregister(link.client)
                link.paused = True

    def _pass_on(self, selector: selectors.BaseSelector, link: _Link) -> None:
        size = max(self._burst - link.passed, self._step)
        chunk = bytes(link.held[:size])
        if not chunk:
            return
        try:
            link.upstream.sendall(chunk)
        except OSError:
            self._drop(selector, link)
            return
        del link.held[:len(chunk)]
        link.passed += len(chunk)
        if link.paused and len(link.held) < self._HOLD:
            selector.register(link.client, selectors.EVENT_READ, (link, True))
            link.paused = False

    def _drop(self, selector: selectors.BaseSelector, link: _Link) -> None:
        self._links.remove(link)
        for sock in (link.client, link.upstream):
            if not (link.paused and sock is link.client):
                selector.unregister(sock)
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
