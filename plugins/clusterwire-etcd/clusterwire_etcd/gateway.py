"""etcd's v3 JSON gateway over HTTP, with the standard library.

etcd serves its gRPC API as JSON on its client URL (``POST /v3/kv/range`` and so on, keys and
values base64). Every answer is untrusted: its size is bounded before it is parsed, and
errors become clusterwire errors naming the URL and what to do.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from clusterwire import errors

#: The largest answer read from etcd (a range of MAX_TASKS entries fits many times over).
MAX_RESPONSE_BYTES = 4 << 20
#: The longest line of a watch stream (one batch of events).
MAX_WATCH_LINE_BYTES = 1 << 20


def b64(data: str | bytes) -> str:
    """``data`` (str as UTF-8) in base64, as the gateway takes keys and values."""
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def unb64(text: str, what: str) -> bytes:
    """The bytes of a base64 field of an answer; InvalidArgumentError naming ``what``."""
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise errors.InvalidArgumentError(f"{what}: not base64: {text!r:.80}") from None


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdGateway:
    """Requests to one etcd client URL (``http://host:port``) through its JSON gateway.

    ``timeout`` (seconds) bounds each request. Connection failures are UnavailableError,
    etcd's own errors the clusterwire error of their gRPC code.
    """

    def __init__(self, endpoint: str, timeout: float = 5.0):
        if not isinstance(endpoint, str):
            raise errors.InvalidArgumentError(
                f"etcd endpoint must be a string such as 'http://127.0.0.1:2379', "
                f"got {endpoint!r}.")
        parsed = urllib.parse.urlsplit(endpoint)
        if parsed.scheme != "http" or not parsed.hostname or parsed.path not in ("", "/"):
            raise errors.InvalidArgumentError(
                f"etcd endpoint {endpoint!r} is not an etcd client URL: give "
                "'http://host:port' (etcd's --advertise-client-urls; https is not supported).")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise errors.InvalidArgumentError(
                f"timeout must be a number of seconds > 0, got {timeout!r}.")
        self.endpoint = endpoint.rstrip("/")
        self._host, self._port = parsed.hostname, parsed.port or 2379
        self._timeout = float(timeout)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` (e.g. ``/v3/kv/range``); the answer as a dict."""
        url = self.endpoint + path
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as reply:
                data = reply.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as err:
            with err:
                raise self._error(url, err.code, err.read(MAX_RESPONSE_BYTES)) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            reason = getattr(err, "reason", err)
            raise errors.UnavailableError(
                f"No etcd answers at {self.endpoint} ({reason}). Start etcd there, or give "
                "the client URL it serves (its --advertise-client-urls).") from None
        if len(data) > MAX_RESPONSE_BYTES:
            raise errors.ResourceExhaustedError(
                f"etcd at {url} answered more than {MAX_RESPONSE_BYTES} bytes; refused.")
        return self._json(url, data)

    def stream(self, path: str, body: dict[str, Any],
               opened: list[socket.socket]) -> Iterator[dict[str, Any]]:
        """POST ``body`` to a streaming ``path`` (``/v3/watch``) and yield each JSON message.

        The connection's socket is appended to ``opened`` so that another thread can end the
        stream by shutting it down (the iterator then ends).
        """
        connection = http.client.HTTPConnection(self._host, self._port, timeout=None)
        try:
            connection.connect()
            opened.append(connection.sock)
            connection.request("POST", path, json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status != 200:
                raise self._error(self.endpoint + path, reply.status,
                                  reply.read(MAX_RESPONSE_BYTES))
            while True:
                line = reply.readline(MAX_WATCH_LINE_BYTES + 1)
                if not line:
                    return
                if len(line) > MAX_WATCH_LINE_BYTES:
                    raise errors.ResourceExhaustedError(
                        f"etcd at {self.endpoint}{path} sent a message over "
                        f"{MAX_WATCH_LINE_BYTES} bytes; refused.")
                if line.strip():
                    yield self._json(self.endpoint + path, line)
        except (OSError, http.client.HTTPException) as err:
            raise errors.UnavailableError(
                f"The etcd watch at {self.endpoint}{path} ended: {err}") from None
        finally:
            with contextlib.suppress(OSError):
                connection.close()

    def _json(self, url: str, data: bytes) -> dict[str, Any]:
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise errors.UnavailableError(
                f"{url} did not answer as etcd's JSON gateway does ({data[:80]!r}); is it "
                "etcd's client URL (etcd >= 3.4)?")
        if "error" in answer:
            error = answer["error"]
            raise errors.error_from_code(
                int(error.get("grpc_code", error.get("code", 2))) if isinstance(error, dict)
                else 2, f"etcd at {url}: {error}")
        return answer

    def _error(self, url: str, status: int, data: bytes) -> errors.OpError:
        try:
            answer = json.loads(data)
            code, message = int(answer["code"]), str(answer.get("message", ""))
        except (ValueError, KeyError, TypeError):
            return errors.UnavailableError(
                f"{url} answered HTTP {status} ({data[:80]!r}), not as etcd's JSON gateway "
                "does; is it etcd's client URL (etcd >= 3.4)?")
        return errors.error_from_code(code, f"etcd at {url}: {message}")
