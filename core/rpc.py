"""Client-side request plumbing shared by Session and server-to-server forwarding.

``RequestClient`` encodes a ``Request`` header plus buffers, sends it over the
protocol's transport with a deadline, retries while the peer is unreachable
(exponential backoff with jitter), and turns the response status into the
matching clusterwire error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError

from clusterwire import addressing, codec, errors, in_process
from clusterwire.backoff import UNREACHABLE, jittered
from clusterwire.durations import format_duration
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.service_pb2 import Request, Response
from clusterwire.security import Security
from clusterwire.transport import Buffer, Channel, ConnectionFailed, Frame, HandshakeFailed

# Methods that are safe to send twice when a connection broke after sending.
IDEMPOTENT = frozenset({"status", "put", "get", "delete", "list", "barrier", "barrier_arrive",
                        "barrier_release", "barrier_withdraw", "heartbeat"})

DEFAULT_TIMEOUT = 30.0
#: A retry loop with more time than this left says at once that the task is unreachable.
_QUIET_RETRY_S = 1.0
#: Unreachable addresses remembered (the oldest forgotten first): a client told to probe
#: addresses it did not choose keeps a bounded table.
_MAX_UNREACHABLE = 4096
_LOG = logging.getLogger("clusterwire")
def raise_for_status(response: Response) -> None:
    """Raise the clusterwire error a non-OK response status stands for."""
    status = response.status
    if status.code == errors.OK:
        return
    if status.remote_type:
        raise errors.RemoteFunctionError(status.message, status.remote_type,
                                         status.remote_traceback)
    raise errors.error_from_code(status.code, status.message, status.retry_later)


def parse_response(frame: Frame) -> Response:
    """The Response header of ``frame``; InternalError if the peer sent garbage."""
    try:
        return Response.FromString(frame.header)
    except DecodeError as err:
        raise errors.InternalError(f"Peer sent a malformed response header: {err}") from None


# OK responses repeat too (a get of the same tensor, a call returning the same shapes):
# each distinct header is parsed once into the plan that rebuilds its value.
_value_plans: dict[bytes, codec.Plan] = {}


def response_value(frame: Frame) -> Any:
    """The value an OK response frame carries; the error a failed one stands for."""
    header = frame.header if type(frame.header) is bytes else bytes(frame.header)
    plan = _value_plans.get(header)
    if plan is None:
        response = parse_response(frame)
        raise_for_status(response)
        plan = codec.decoder(response.value)
        if len(header) <= codec.PLAN_KEY_MAX:
            codec.remember(_value_plans, header, plan)
    return plan(frame.buffers)


#: Channels a client keeps open at once by default (a task's to the peers it calls): past
#: it the least recently used one is closed once no call uses it, and opened again when a
#: request needs it, so a task of a large job holds a bounded number of connections.
MAX_CHANNELS = 256


class _Pooled:
    """A client's channel to one address, the calls using it now, and whether it left the
    pool (then it closes when the last of them ends)."""

    __slots__ = ("channel", "users", "evicted", "shell")

    def __init__(self, channel: Channel, shell: in_process.InProcessShell | None = None):
        self.channel, self.users, self.evicted = channel, 0, False
        self.shell = shell  # an in-process channel's server (such a channel is never closed)


class RequestClient:
    """Sends requests to addresses over one protocol, reusing one channel per address, at
    most ``max_channels`` open at once (least recently used closed first).

    A server of this process is reached without the transport (``clusterwire.in_process``)
    unless ``in_process`` is False. ``peer`` names what serves at the addresses in the
    warning that one is unreachable and in the UnavailableError ("Task at HOST:PORT ...", or
    "The tf.data service dispatcher at HOST:PORT ...").
    """

    def __init__(self, protocol: str, timeout: float = DEFAULT_TIMEOUT,
                 security: Security | None = None, in_process: bool = True,
                 peer: str = "task", max_channels: int = MAX_CHANNELS):
        if isinstance(max_channels, bool) or not isinstance(max_channels, int) \
                or max_channels < 1:
            raise errors.InvalidArgumentError(
                f"max_channels must be an int >= 1, got {max_channels!r}.")
        self.protocol = protocol
        self._max_channels = max_channels
        self.peer = peer
        self._subject = "Task" if peer == "task" else f"The {peer}"
        self.timeout = timeout
        self.security = security or Security()
        self.in_process = in_process
        self._transport = get_plugin_manager().transport(protocol)
        self._channels: OrderedDict[str, _Pooled] = OrderedDict()  # least recently used first
        self._in_process: dict[str, _Pooled] = {}  # address -> the channel to its shell here
        self._lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # wakes a retry's backoff
        # Address -> (time.time(), error) of its last failure not followed by a success.
        self._unreachable: dict[str, tuple[float, str]] = {}
        #: Attempts that found their address unreachable.
        self.failures = 0

    def _acquire(self, address: str) -> _Pooled:
        """The channel to ``address``: a server of this process's own (unless
        ``in_process`` is False), else the transport's (opened if needed), counted as used
        until ``_release``."""
        shell = in_process.lookup(self.protocol, address) if self.in_process else None
        if shell is not None:
            local = self._in_process.get(address)
            if local is not None and local.shell is shell:  # it took this client's calls
                return local
            if shell.takes_in_process(self.security):
                local = _Pooled(shell.in_process_channel(self.security, self._closing),
                                shell)
                with self._lock:
                    self._in_process[address] = local
                    while len(self._in_process) > self._max_channels:
                        del self._in_process[next(iter(self._in_process))]
                return local
        closing: list[_Pooled] = []
        with self._lock:
            if self._closed:
                raise errors.CancelledError("This client was closed.")
            pooled = self._channels.get(address)
            if pooled is None:
                addressing.check_dialable(address)
                pooled = self._channels[address] = _Pooled(
                    self._transport.connect(address, self.security))
                while len(self._channels) > self._max_channels:
                    _, oldest = self._channels.popitem(last=False)
                    oldest.evicted = True
                    if not oldest.users:
                        closing.append(oldest)
            else:
                self._channels.move_to_end(address)
            pooled.users += 1
        for evicted in closing:
            evicted.channel.close()
        return pooled

    def _release(self, pooled: _Pooled) -> None:
        with self._lock:
            pooled.users -= 1
            close = pooled.evicted and not pooled.users
        if close:
            pooled.channel.close()

    def send(self, address: str, request: Request, buffers: Sequence[Buffer] = (),
             timeout: float | None = None, *,
             retry: bool = True) -> tuple[Response, Sequence[Any]]:
        """Send ``request`` to ``address``; return the OK response and its buffers."""
        frame = self.send_frame(address, Frame(request.SerializeToString(), buffers),
                                request.method, timeout, retry=retry)
        response = parse_response(frame)
        raise_for_status(response)
        return response, frame.buffers

    def send_frame(self, address: str, frame: Frame, method: str,
                   timeout: float | None = None, *, idempotent: bool | None = None,
                   attempt_timeout: float | None = None, relay: bool = False,
                   retry: bool = True) -> Frame:
        """Send a ready frame, retrying while ``address`` is unreachable, until the deadline.

        A request is sent again after a broken connection only if it is ``idempotent``
        (default: by its method); one never sent is always retried. Each attempt gets the
        time left, or at most ``attempt_timeout``. ``close()`` ends the retrying with
        CancelledError. With ``relay``, the response is only passed on through a listener
        of this protocol (``Channel.call_relayed``). Without ``retry``, an unreachable
        address is an UnavailableError at once (a probe of whether something serves there).
        """
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        if idempotent is None:
            idempotent = method in IDEMPOTENT
        delay = UNREACHABLE.start_s
        unreachable = ""  # why the last attempt found ``address`` unreachable
        while True:
            remaining = deadline - time.monotonic()
            if attempt_timeout is not None:
                remaining = min(remaining, attempt_timeout)
            try:
                pooled = self._acquire(address)
                try:
                    send = pooled.channel.call_relayed if relay else pooled.channel.call
                    reply = send(frame, timeout=max(remaining, 0.001))
                finally:
                    if pooled.shell is None:  # an in-process channel is not pooled
                        self._release(pooled)
                if self._unreachable:
                    self._reached(address)
                return reply
            except errors.UnavailableError as err:
                self.note_unreachable(address, err.message)
                unreachable = err.message
                retryable = retry and not isinstance(err, HandshakeFailed) and (
                    isinstance(err, ConnectionFailed) or idempotent)
                remaining = deadline - time.monotonic()
                if not retryable:
                    raise errors.UnavailableError(
                        f"{self._subject} at {address} ({self.protocol}) is unavailable: "
                        f"{err.message}"
                    ) from None
                if remaining <= 0:
                    raise self._unavailable_after(address, budget, err.message) from None
                if delay == UNREACHABLE.start_s and remaining > _QUIET_RETRY_S:
                    _LOG.warning("clusterwire: the %s at %s (%s) is unreachable (%s); retrying "
                                 "until the deadline, %s from now.", self.peer, address,
                                 self.protocol, err.message, format_duration(remaining))
                if self._closing.wait(min(jittered(delay), remaining)):
                    raise errors.CancelledError("This client was closed.") from None
                delay = UNREACHABLE.after(delay)
            except errors.DeadlineExceededError as err:
                if unreachable and time.monotonic() >= deadline:
                    # The last attempt only got what was left of the window (a loaded
                    # machine can leave it a millisecond): the address is still unreachable.
                    raise self._unavailable_after(address, budget, unreachable) from None
                raise errors.DeadlineExceededError(
                    f"Request {method!r} to {address} ({self.protocol}, deadline "
                    f"{budget:.3g} s): {err.message}") from None

    def _unavailable_after(self, address: str, budget: float, why: str
                           ) -> errors.UnavailableError:
        return errors.UnavailableError(
            f"{self._subject} at {address} ({self.protocol}) is unavailable after "
            f"{format_duration(budget)}: {why}")

    def note_unreachable(self, address: str, error: str) -> None:
        """``address`` was found unreachable now (also by a caller that knows a deadline
        means it: a request answered at once that got no answer)."""
        with self._lock:
            self._unreachable[address] = (time.time(), error)
            if len(self._unreachable) > _MAX_UNREACHABLE:
                del self._unreachable[next(iter(self._unreachable))]
            self.failures += 1

    def _reached(self, address: str) -> None:
        with self._lock:
            self._unreachable.pop(address, None)

    def unreachable(self, within: float) -> dict[str, tuple[float, str]]:
        """The addresses whose last attempt, less than ``within`` s ago, found them
        unreachable: address -> (when, as ``time.time()``; the error)."""
        since = time.time() - within
        with self._lock:
            return {a: seen for a, seen in self._unreachable.items() if seen[0] >= since}

    def drop(self, address: str) -> None:
        """Close the channel to ``address``, if one is open (a later request opens one)."""
        with self._lock:
            pooled = self._channels.pop(address, None)
        if pooled is not None:  # closed now: its calls in flight end with CancelledError
            pooled.channel.close()

    def close(self) -> None:
        """Close every channel (idempotent)."""
        self._closing.set()
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), OrderedDict()
            self._in_process.clear()
        for pooled in channels:
            pooled.channel.close()
