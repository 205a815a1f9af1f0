"""A JSON-over-HTTP server on 127.0.0.1 for fake cloud APIs (stdlib only).

``route(method, path, query, body) -> (status, payload)`` answers each request;
every request is recorded in ``requests`` as ``(method, path, {**query, **body})``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

Route = Callable[[str, str, dict, dict], tuple[int, dict]]


class JsonServer:
    """Serves ``route`` on 127.0.0.1:<free port> in a daemon thread until ``stop()``."""

    def __init__(self, route: Route):
        self.route = route
        self.requests: list[tuple[str, str, dict]] = []
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> JsonServer:
        """Bind a free port and serve."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:
                owner._handle(self, "GET")

            def do_POST(self) -> None:
                owner._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(handler.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length)) if length else {}
        self.requests.append((method, parts.path, {**query, **body}))
        status, payload = self.route(method, parts.path, query, body)
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json; charset=UTF-8")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
