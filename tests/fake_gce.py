"""A local Compute Engine v1 endpoint: the two REST methods GCEClusterResolver calls.

``POST /compute/v1/projects/P/zones/Z/instanceGroups/G/listInstances`` (body
``instanceState`` RUNNING or ALL; ``maxResults``/``pageToken`` paging, at most
``page_size`` items per page; ``orderBy=name``) and ``GET
/compute/v1/projects/P/zones/Z/instances/NAME``, with Google-style JSON errors.
Binds 127.0.0.1 on a free port; records each request; ``fail_with`` makes
matching requests answer an error status. Stdlib only.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_LIST = re.compile(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/instanceGroups/([^/]+)"
                   r"/listInstances$")
_GET = re.compile(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances/([^/]+)$")
_REASONS = {401: "required", 403: "forbidden", 404: "notFound", 429: "rateLimitExceeded",
            500: "backendError", 503: "backendError"}


@dataclass
class Instance:
    """One VM: its status (RUNNING, STOPPED, ...) and internal IP."""

    status: str
    ip: str


@dataclass
class FakeCompute:
    """Project/zone/group state plus the HTTP server that serves it."""

    page_size: int = 500
    groups: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)
    instances: dict[tuple[str, str, str], Instance] = field(default_factory=dict)
    requests: list[tuple[str, str, dict]] = field(default_factory=list)
    fail_with: dict[str, int] = field(default_factory=dict)  # path substring -> HTTP status

    def add_group(self, project: str, zone: str, group: str,
                  members: dict[str, tuple[str, str]]) -> None:
        """Create ``group`` with ``{name: (status, ip)}`` members (listed in this order)."""
        self.groups[project, zone, group] = list(members)
        for name, (status, ip) in members.items():
            self.instances[project, zone, name] = Instance(status, ip)

    def start(self) -> FakeCompute:
        """Serve on 127.0.0.1:<free port> in a daemon thread."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def api_endpoint(self) -> str:
        """The ``client_options`` api_endpoint for google-api-python-client."""
        return self.url + "/compute/v1/"

    def stop(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(handler.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length) or b"{}") if length else {}
        self.requests.append((method, parts.path, {**query, **body}))
        for fragment, status in self.fail_with.items():
            if fragment in parts.path:
                return self._reply(handler, status, _error(status, f"injected {status}"))
        listing, getting = _LIST.match(parts.path), _GET.match(parts.path)
        if method == "POST" and listing:
            return self._list(handler, listing.groups(), query, body)
        if method == "GET" and getting:
            instance = self.instances.get(getting.groups())
            if instance is None:
                return self._reply(handler, 404, _error(404, f"The resource '{parts.path}' "
                                                             "was not found"))
            project, zone, name = getting.groups()
            return self._reply(handler, 200, {
                "kind": "compute#instance", "name": name, "status": instance.status,
                "zone": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}",
                "networkInterfaces": [{"name": "nic0", "networkIP": instance.ip}]})
        return self._reply(handler, 404, _error(404, f"No such method: {method} {parts.path}"))

    def _list(self, handler, key: tuple[str, str, str], query: dict, body: dict) -> None:
        if key not in self.groups:
            return self._reply(handler, 404, _error(
                404, f"The resource 'projects/{key[0]}/zones/{key[1]}/instanceGroups/{key[2]}' "
                     "was not found"))
        project, zone, _ = key
        names = self.groups[key]
        if body.get("instanceState", "ALL") == "RUNNING":
            names = [n for n in names if self.instances[project, zone, n].status == "RUNNING"]
        if query.get("orderBy") == "name":
            names = sorted(names)
        start = int(query.get("pageToken") or 0)
        size = min(int(query.get("maxResults") or 500), self.page_size)
        page = names[start:start + size]
        prefix = f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/instances"
        reply: dict = {"kind": "compute#instanceGroupsListInstances"}
        if page:  # like the real API, an empty list has no "items" key
            reply["items"] = [{"instance": f"{prefix}/{n}",
                               "status": self.instances[project, zone, n].status} for n in page]
        if start + size < len(names):
            reply["nextPageToken"] = str(start + size)
        return self._reply(handler, 200, reply)

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json; charset=UTF-8")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


def _error(status: int, message: str) -> dict:
    reason = _REASONS.get(status, "invalid")
    return {"error": {"code": status, "message": message,
                      "errors": [{"message": message, "domain": "global", "reason": reason}]}}
