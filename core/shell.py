"""The listener shell every clusterwire server serves through.

A task's ``Server`` (the cluster service), a ``DispatchServer`` and a ``WorkerServer`` each
plug one frame handler into a ``Shell``. The shell owns what every server kind shares, so a
new server, port or request type gets it for free:

* the listener of the chosen protocol, built with one set of ``ListenOptions`` (limits and
  security: the transport authenticates a request before the shell sees it);
* admission: at most ``max_concurrent_calls`` requests run at once, more are
  ``ResourceExhaustedError``;
* drain on stop: new requests are ``UnavailableError``, requests in flight get ``grace``
  seconds, then the handler's waits are cancelled (``CancelledError`` at their callers) and
  the listener stops, freeing the port;
* errors: a handler's ``OpError`` becomes the response status (a remote function's
  traceback only with ``send_tracebacks``); any other exception becomes ``InternalError``
  and is logged here, so no server paths or internals leak to clients.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from clusterwire import errors
from clusterwire.addressing import is_loopback, split_host_port
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.service_pb2 import Response
from clusterwire.transport import Frame, Handler, ListenOptions, Transport

log = logging.getLogger("clusterwire")

#: After the drain, responses already produced (and announced bulk fetches) get this long.
_FLUSH_GRACE = 1.0
#: After waits are cancelled, how long their answers get to go out.
_CANCEL_ANSWER = 0.5


def error_response(err: errors.OpError, send_traceback: bool = False) -> Frame:
    """A response frame carrying ``err`` as its status; a remote function's traceback (which
    names server paths) only with ``send_traceback``.

    Both ``Response`` and ``DataResponse`` read it: their ``status`` is field 1.
    """
    response = Response()
    if isinstance(err, errors.RemoteFunctionError):
        response.status.remote_type = err.remote_type
        if send_traceback:
            response.status.remote_traceback = err.remote_traceback
    response.status.code, response.status.message = err.error_code, err.message
    return Frame(response.SerializeToString(), [])


def listen_options(**overrides: Any) -> ListenOptions:
    """``ListenOptions`` with the non-empty ``overrides`` (0, None, "" keep the default).

    The defaults of ``ListenOptions`` are the one table of server limits.
    """
    known = {f.name for f in fields(ListenOptions)}
    unknown = set(overrides) - known
    if unknown:
        raise errors.InvalidArgumentError(
            f"Unknown listen option(s) {sorted(unknown)}; known: {', '.join(sorted(known))}.")
    return replace(ListenOptions(), **{k: v for k, v in overrides.items() if v})


def warn_if_exposed(host: str, options: ListenOptions, what: str) -> None:
    """Log a warning when ``what`` listens beyond loopback without TLS or a token, or sends a
    token in the clear."""
    if is_loopback(host):
        return
    security = options.security
    if not security.secure:
        log.warning("clusterwire: WARNING: %s listens on %s without TLS or a cluster token: "
                    "anyone who reaches the port can use it. Set auth_token_file and "
                    "tls_cert_file/tls_key_file (see clusterwire.security).", what, host or "*")
    elif security.tls is None:
        log.warning("clusterwire: WARNING: %s listens on %s with a cluster token but without "
                    "TLS: the token travels in the clear. Set tls_cert_file and tls_key_file.",
                    what, host or "*")


class Shell:
    """Serves one handler on one listener with admission, drain and error mapping."""

    def __init__(self, protocol: str, address: str, handler: Handler, name: str,
                 options: ListenOptions, cancel_waits: Callable[[], None] | None = None,
                 send_tracebacks: bool = False):
        self.name = name
        self._send_tracebacks = send_tracebacks
        self._handler = handler
        self._cancel_waits = cancel_waits
        self._max_in_flight = options.max_concurrent_calls
        # _handle takes the plain lock (cheap); drain waits on a condition of it.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._draining = False
        self.transport: Transport = get_plugin_manager().transport(protocol)
        self._listener = self.transport.listen(address, self._handle, options)
        self.address = self._listener.address
        self.port = split_host_port(self.address)[1]

    def start(self) -> None:
        """Start serving (idempotent)."""
        self._listener.start()

    def stop(self, grace: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish for ``grace`` s, cancel the waits
        left, then stop the listener (which answers calls still running with
        CancelledError) and free the port."""
        with self._idle:
            self._draining = True
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=grace or 0)
        if self._cancel_waits is not None:
            self._cancel_waits()
            with self._idle:
                self._idle.wait_for(lambda: self._in_flight == 0, timeout=_CANCEL_ANSWER)
        self._listener.stop(_FLUSH_GRACE)

    def _handle(self, frame: Frame) -> Frame:
        with self._lock:
            if self._draining:
                return error_response(errors.UnavailableError(f"{self.name} is stopping."))
            if self._in_flight >= self._max_in_flight:
                return error_response(errors.ResourceExhaustedError(
                    f"{self.name} is serving {self._in_flight} requests, its "
                    "max_concurrent_calls; retry later or raise the limit."))
            self._in_flight += 1
        try:
            return self._handler(frame)
        except errors.OpError as err:
            return error_response(err, self._send_tracebacks)
        except Exception:  # a bug must not take the server down, nor leak its insides
            log.exception("%s: request failed", self.name)
            return error_response(errors.InternalError(
                f"{self.name} failed on a request; see its log."))
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._draining:
                    self._idle.notify_all()
