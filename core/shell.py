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
  and is logged here, so no server paths or internals leak to clients;
* metrics: every request is counted by method and status, and one that came through the
  transport is timed and its bytes counted (``clusterwire.metrics.requests``; the server
  kind names a request's method);
* callers in this process, which reach the shell without the transport
  (``clusterwire.in_process``) and get all of the above too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import fields, replace
from time import perf_counter
from typing import Any

from clusterwire import errors, in_process
from clusterwire.addressing import is_loopback, split_host_port
from clusterwire.envelope import check_total
from clusterwire.metrics import REGISTRY
from clusterwire.metrics import registry as metrics_registry
from clusterwire.metrics.requests import RequestStats
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.service_pb2 import Response
from clusterwire.security import Security
from clusterwire.thread_pool import ElasticPool
from clusterwire.transport import ConnectionFailed, Frame, Handler, ListenOptions, Transport

log = logging.getLogger("clusterwire")

#: After the drain, responses already produced (and announced bulk fetches) get this long.
_FLUSH_GRACE = 1.0
#: After waits are cancelled, how long their answers get to go out.
_CANCEL_ANSWER = 0.5
#: How often an in-process caller waiting for a response checks its client and the server.
_IN_PROCESS_POLL = 0.05


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
    response.status.retry_later = err.retry_later
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
                 send_tracebacks: bool = False,
                 method_of: Callable[[Frame], str] | None = None,
                 served_at_once: frozenset[str] = frozenset()):
        """``method_of(request)`` names a request's method, from a set bounded by the server
        kind (the metrics' label; default: "request"); the handler answers requests of the
        ``served_at_once`` methods without waiting for anything (an in-process caller's
        thread may run them); default: none."""
        self.name = name
        self.protocol = protocol
        self._send_tracebacks = send_tracebacks
        self._handler = handler
        self._cancel_waits = cancel_waits
        self._served_at_once = served_at_once
        self._options = options
        self._max_in_flight = options.max_concurrent_calls
        self._serving = False
        self._ready = True  # False: listening, but not taking work yet (set_ready)
        self._waiting_calls: ElasticPool | None = None  # in-process requests that may wait
        # _handle takes the plain lock (cheap); drain waits on a condition of it.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._draining = False
        self.transport: Transport = get_plugin_manager().transport(protocol)
        self._listener = self.transport.listen(address, self._handle, options)
        self.address = self._listener.address
        self.port = split_host_port(self.address)[1]
        self._method_of: Callable[[Frame], str] = method_of or (lambda _frame: "request")
        self._stats: RequestStats | None = None
        self._stop_reporting = None
        if metrics_registry.ENABLED:
            self._stats = RequestStats(name, protocol, self._lock, lambda: self._in_flight,
                                       lambda: self._serving and self._ready
                                       and not self._draining,
                                       self._listener.connections)
            self._stop_reporting = REGISTRY.add_source(self._stats.samples)

    def start(self) -> None:
        """Start serving (idempotent)."""
        self._listener.start()
        with self._lock:
            self._serving = not self._draining
        if self._serving:
            self.reachable_at(self.address)

    def set_ready(self, ready: bool) -> None:
        """Whether this server takes work now, as its health and readiness report it (before
        or after ``start``): a standby listens, and answers, before its turn comes."""
        self._ready = ready
        self._listener.report_ready(ready)

    def reachable_at(self, address: str) -> None:
        """Serve callers of this process that name this shell by ``address`` directly."""
        in_process.register(self.protocol, address, self)

    def stop(self, grace: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish for ``grace`` s, cancel the waits
        left, then stop the listener (which answers calls still running with
        CancelledError) and free the port."""
        with self._lock:
            self._draining = True
        self._listener.drain()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=grace or 0)
        if self._cancel_waits is not None:
            self._cancel_waits()
            with self._idle:
                self._idle.wait_for(lambda: self._in_flight == 0, timeout=_CANCEL_ANSWER)
        with self._lock:
            self._serving = False
            waiting, self._waiting_calls = self._waiting_calls, None
        in_process.unregister(self)
        if self._stop_reporting is not None:
            self._stop_reporting()
        if waiting is not None:
            waiting.shutdown(wait=False, cancel_futures=True)
        self._listener.stop(_FLUSH_GRACE)

    def in_process_channel(self, security: Security, closing: threading.Event
                           ) -> InProcessChannel:
        """The channel of a caller of this process (``clusterwire.in_process``) that
        ``takes_in_process``; ``closing`` is the caller's client closing."""
        return InProcessChannel(self, security, closing)

    def _serve_for_caller(self, request: Frame, method: str, deadline: float | None) -> Frame:
        with in_process.serving_until(deadline):
            return self._serve(request, method, wire=False)

    def takes_in_process(self, security: Security) -> bool:
        """Whether a caller of this process with ``security`` skips the transport: always
        without TLS; under TLS only with the server's own credentials (the server's own
        process), else the TLS handshake decides, as for any client."""
        own = self._options.security.tls
        return own is None or security.tls == own

    def _wait_for(self, request: Frame, method: str, deadline: float | None,
                  closing: threading.Event) -> Frame:
        """Run ``request`` on the shell's threads; wait until its answer, the deadline, the
        caller's ``closing`` or the server's stop."""
        with self._lock:
            if self._waiting_calls is None and self._serving:
                self._waiting_calls = ElasticPool(self._options.max_workers,
                                                  f"clusterwire-in-process-{self.port}")
            pool = self._waiting_calls
        try:
            if pool is None:
                raise RuntimeError
            future = pool.submit(self._serve_for_caller, request, method, deadline)
        except RuntimeError:  # the shell stopped meanwhile
            raise errors.CancelledError(f"{self.name} stopped.") from None
        answered = threading.Event()
        future.add_done_callback(lambda _future: answered.set())
        while True:
            left = _IN_PROCESS_POLL if deadline is None else deadline - time.monotonic()
            if answered.wait(min(max(left, 0), _IN_PROCESS_POLL)):
                if future.cancelled():  # queued when the shell stopped
                    raise errors.CancelledError(f"{self.name} stopped.")
                return future.result()
            if closing.is_set():
                raise errors.CancelledError("The client was closed.")
            if not self._serving:
                raise errors.CancelledError(f"{self.name} stopped.")
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.DeadlineExceededError(f"{self.name} did not answer in time.")

    def _handle(self, frame: Frame) -> Frame:
        """Serve a request that came through the transport."""
        return self._serve(frame, None, wire=True)

    def _serve(self, frame: Frame, method: str | None, wire: bool) -> Frame:
        """Serve ``frame`` (its ``method`` if known); ``wire``: it came through the
        transport (the metrics time it and count its bytes; an in-process caller's request is
        only counted)."""
        started = perf_counter() if wire else 0.0
        stats = self._stats
        with self._lock:
            refusal = self._admit()
        if refusal is not None:
            response = error_response(refusal)
            if stats is not None:
                method = method or self._method_of(frame)
                with self._lock:
                    if wire:
                        stats.record(method, refusal.error_code, started, frame, response)
                    else:
                        stats.in_process[method][refusal.error_code] += 1
            return response
        code, response = errors.OK, None
        try:
            response = self._handler(frame)
        except errors.OpError as err:
            code, response = err.error_code, error_response(err, self._send_tracebacks)
        except Exception:  # a bug must not take the server down, nor leak its insides
            log.exception("%s: request failed", self.name)
            code, response = errors.INTERNAL, error_response(errors.InternalError(
                f"{self.name} failed on a request; see its log."))
        finally:
            counted = stats is not None and response is not None
            if counted and wire:  # named outside the lock: naming may parse the request
                method = method or self._method_of(frame)
            with self._lock:  # record() reads the clock: a request's time ends here
                self._in_flight -= 1
                if self._draining:
                    self._idle.notify_all()
                if counted:
                    if wire:
                        stats.record(method, code, started, frame, response)
                    else:
                        stats.in_process[method][code] += 1
        return response

    def _admit(self) -> errors.OpError | None:
        """Count a request in, or say why it is refused (the caller holds the lock)."""
        if self._draining:
            return errors.UnavailableError(f"{self.name} is stopping.")
        if self._in_flight >= self._max_in_flight:
            return errors.ResourceExhaustedError(
                f"{self.name} is serving {self._in_flight} requests, its "
                "max_concurrent_calls; retry later or raise the limit.")
        self._in_flight += 1
        return None


class InProcessChannel:
    """A caller of this process's channel to a ``Shell``: the shell's policy (token, limits,
    admission, stop) without the transport. ``call`` serves in the caller's thread (or waits
    for the shell's threads), with no frame in between: it is the in-process path's cost."""

    __slots__ = ("_shell", "_security", "_closing")

    def __init__(self, shell: Shell, security: Security, closing: threading.Event):
        self._shell, self._security, self._closing = shell, security, closing

    def call(self, frame: Frame, timeout: float | None = None) -> Frame:
        """Serve ``frame``; ``closing`` (the caller's client closing) ends a wait with
        CancelledError."""
        shell = self._shell
        if self._closing.is_set():
            raise errors.CancelledError("The client was closed.")
        shell._options.security.check_token(self._security.token)
        if not shell._serving:
            raise ConnectionFailed(f"{shell.name} at {shell.address} is not serving.")
        check_total(frame.payload_bytes, shell._options.max_message_bytes)
        request = Frame(frame.header,
                        in_process.hand_over(frame.buffers, keep=shell.transport.keep))
        deadline = None if timeout is None else time.monotonic() + timeout
        method = shell._method_of(request)
        if method in shell._served_at_once:
            response = shell._serve_for_caller(request, method, deadline)
        else:
            response = shell._wait_for(request, method, deadline, self._closing)
        return Frame(response.header, in_process.hand_over(response.buffers, response.frozen))

    call_relayed = call  # nothing in between to relay through

    def close(self) -> None:
        """Nothing to close: the shell is the server's."""
