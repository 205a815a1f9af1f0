"""A local Compute Engine v1 endpoint: the two REST methods GCEClusterResolver calls.

``POST /compute/v1/projects/P/zones/Z/instanceGroups/G/listInstances`` (body
``instanceState`` RUNNING or ALL; ``maxResults``/``pageToken`` paging, at most
``page_size`` items per page; ``orderBy=name``) and ``GET
/compute/v1/projects/P/zones/Z/instances/NAME``, with Google-style JSON errors.
``fail_with`` makes matching requests answer an error status.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fake_http import JsonServer

_LIST = re.compile(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/instanceGroups/([^/]+)"
                   r"/listInstances$")
_GET = re.compile(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances/([^/]+)$")
_REASONS = {401: "required", 403: "forbidden", 404: "notFound", 429: "rateLimitExceeded",
            500: "backendError", 503: "backendError"}
_SELF = "https://www.googleapis.com/compute/v1/projects/{}/zones/{}"


@dataclass
class Instance:
    """One VM: its status (RUNNING, STOPPED, ...) and internal IP."""

    status: str
    ip: str


@dataclass
class FakeCompute:
    """Project/zone/group state, served by a JsonServer on 127.0.0.1."""

    page_size: int = 500
    groups: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)
    instances: dict[tuple[str, str, str], Instance] = field(default_factory=dict)
    fail_with: dict[str, int] = field(default_factory=dict)  # path substring -> HTTP status

    def __post_init__(self) -> None:
        self.server = JsonServer(self._route)
        self.requests = self.server.requests

    def add_group(self, project: str, zone: str, group: str,
                  members: dict[str, tuple[str, str]]) -> None:
        """Create ``group`` with ``{name: (status, ip)}`` members (listed in this order)."""
        self.groups[project, zone, group] = list(members)
        for name, (status, ip) in members.items():
            self.instances[project, zone, name] = Instance(status, ip)

    def start(self) -> FakeCompute:
        """Serve on a free port of 127.0.0.1."""
        self.server.start()
        return self

    def stop(self) -> None:
        """Stop serving and free the port."""
        self.server.stop()

    @property
    def api_endpoint(self) -> str:
        """The ``client_options`` api_endpoint for google-api-python-client."""
        return self.server.url + "/compute/v1/"

    def _route(self, method: str, path: str, query: dict, body: dict) -> tuple[int, dict]:
        for fragment, status in self.fail_with.items():
            if fragment in path:
                return status, _error(status, f"injected {status}")
        listing, getting = _LIST.match(path), _GET.match(path)
        if method == "POST" and listing:
            return self._list(listing.groups(), query, body)
        if method == "GET" and getting:
            instance = self.instances.get(getting.groups())
            if instance is None:
                return 404, _error(404, f"The resource '{path}' was not found")
            project, zone, name = getting.groups()
            return 200, {"kind": "compute#instance", "name": name, "status": instance.status,
                         "zone": _SELF.format(project, zone),
                         "networkInterfaces": [{"name": "nic0", "networkIP": instance.ip}]}
        return 404, _error(404, f"No such method: {method} {path}")

    def _list(self, key: tuple[str, str, str], query: dict, body: dict) -> tuple[int, dict]:
        if key not in self.groups:
            return 404, _error(404, f"The resource 'projects/{key[0]}/zones/{key[1]}/"
                                    f"instanceGroups/{key[2]}' was not found")
        project, zone, _ = key
        names = self.groups[key]
        if body.get("instanceState", "ALL") == "RUNNING":
            names = [n for n in names if self.instances[project, zone, n].status == "RUNNING"]
        if query.get("orderBy") == "name":
            names = sorted(names)
        start = int(query.get("pageToken") or 0)
        size = min(int(query.get("maxResults") or 500), self.page_size)
        page = names[start:start + size]
        reply: dict = {"kind": "compute#instanceGroupsListInstances"}
        if page:  # like the real API, an empty list has no "items" key
            reply["items"] = [{"instance": f"{_SELF.format(project, zone)}/instances/{n}",
                               "status": self.instances[project, zone, n].status} for n in page]
        if start + size < len(names):
            reply["nextPageToken"] = str(start + size)
        return 200, reply


def _error(status: int, message: str) -> dict:
    reason = _REASONS.get(status, "invalid")
    return {"error": {"code": status, "message": message,
                      "errors": [{"message": message, "domain": "global", "reason": reason}]}}
