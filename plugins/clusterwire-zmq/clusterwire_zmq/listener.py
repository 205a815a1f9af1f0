"""The zmq listener: a ROUTER socket served by a small pool of worker threads.

One thread at a time, the leader, waits on the socket. The request it receives it serves
inline, handler and reply, and then leads again (or, when another thread leads meanwhile,
serves what is queued and parks): a sequence of small calls is served by one thread, as a
bare pyzmq server serves them, with no other thread woken. Two threads (or more) waiting
on the socket cost more than they save: a request arriving as the last one's thread went
back to the socket woke both, and they traded the GIL and the socket's lock.

A call must not hold the other requests back, so another thread leads while it runs:
at once when its handler waits on other requests (``clusterwire.thread_pool.parked``),
and after ``STANDBY_SECONDS`` otherwise: an idle thread, the standby, wakes that often
while calls are served and takes the socket when one and the same call has kept it
leaderless for a whole interval (it sleeps until the next call once one interval passed
without any). At most ``max_workers`` threads work at once (parked waits do not count).
"""

from __future__ import annotations

import itertools
import select
import threading

import zmq

from clusterwire import errors
from clusterwire.addressing import join_host_port
from clusterwire.thread_pool import serve_parking
from clusterwire.transport import Frame, Handler, Listener, ListenOptions
from clusterwire_zmq import wire
from clusterwire_zmq.auth import TokenGate, refuse_tls
from clusterwire_zmq.endpoints import bind_endpoint, bound_ip, bound_port
from clusterwire_zmq.guard import ConnectionGuard
from clusterwire_zmq.options import Settings
from clusterwire_zmq.router import SharedRouter

#: How long a call may keep the socket without a leader before the standby takes it.
STANDBY_SECONDS = 0.005
#: How long replies already queued (and the CANCELLED answers of a stop) may take to flush.
_FLUSH_MS = 1000


class ZmqListener(Listener):
    """Serves ``handler`` on a ROUTER socket bound to ``address``."""

    def __init__(self, address: str, handler: Handler, options: ListenOptions,
                 settings: Settings):
        refuse_tls(options.security)
        endpoint, host, ipv6 = bind_endpoint(address)
        # A context per listener: terminating it closes the listening socket before stop()
        # returns, so the port is free at once (a socket's close alone is asynchronous).
        self._context = zmq.Context(io_threads=1)
        self._gate = TokenGate(self._context, options.security)
        sock = self._context.socket(zmq.ROUTER)
        self._guard = ConnectionGuard(self._context, sock, options)
        try:
            settings.configure(sock, ipv6)
            TokenGate.configure_server(sock)
            # libzmq drops a peer sending a larger part before allocating it. It hands a
            # multipart message over only once every part arrived and bounds neither their
            # number nor their sum, so it buffers a whole message (of parts each within this
            # bound, however many) before anything here can look at it: the guard shuts
            # down a connection whose unfinished message grows past its byte budget
            # (budget.py); the router keeps at most wire.MAX_PARTS of a message's parts and
            # _serve refuses it unread when they are too many or too large. Only a token
            # holder gets a message through, and this plugin's channels never send a frame
            # over the limit WELCOME announced.
            sock.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes + wire.PART0_OVERHEAD)
            sock.bind(endpoint)
            port = bound_port(sock.getsockopt(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as err:
            sock.disable_monitor()
            sock.close(linger=0)
            self._guard.close()
            self._gate.close()
            self._context.term()
            raise errors.UnavailableError(
                f"Could not bind {address} ({err.strerror}). Choose a free port, or port 0 to "
                "let the system pick one, and a host name of this machine.") from None
        self._address = join_host_port(host, port)
        self._guard.watch(bound_ip(endpoint), port)
        self._max_parts = 1 + wire.MAX_PARTS  # the routing id first
        self._router = SharedRouter(sock, self._max_parts)
        self._handler = handler
        self._limit = options.max_message_bytes
        self._max_calls = options.max_concurrent_calls
        self._max_connections = options.max_connections
        self._max_workers = max(1, options.max_workers)
        self._inline_max = settings.inline_bytes
        self._lock = threading.Lock()
        self._calls_changed = threading.Condition(self._lock)
        self._wakeup = threading.Condition(self._lock)  # parked threads but the standby
        self._standby_wakeup = threading.Condition(self._lock)
        # In-flight calls: token -> [routing id, request id, cancelled by stop()].
        self._calls: dict[int, list] = {}
        self._tokens = itertools.count()
        self._threads = self._parked = self._wakeups = 0
        self._waiting = 0  # workers in a handler's parked() wait: not counted as working
        self._leading = False  # a thread waits on the socket, or is on its way there
        self._handoffs = 0  # how often the leader left the socket to serve a request
        self._standby = False  # a parked thread is the standby
        self._standby_asleep = False  # ... and waits for the next handoff, not on a timer
        self._standby_leads = False  # ... and is to lead
        self._started = self._stopping = False
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        return self._address

    def start(self) -> None:
        with self._lock:
            if self._started or self._stopping:
                return
            self._started = True
            self._leading = True
            self._start_thread(lead=True)
            if self._max_workers > 1:
                self._start_thread(lead=False)

    def stop(self, grace: float | None = None) -> None:
        with self._lock:
            stopping, self._stopping = self._stopping, True
            self._wakeup.notify_all()
            self._standby_wakeup.notify_all()
        if stopping:
            self._stopped.wait()
            return
        self._router.interrupt()
        with self._lock:
            self._calls_changed.wait_for(lambda: not self._calls, timeout=grace or 0)
            for call in self._calls.values():
                ident, request_id, call[2] = call[0], call[1], True
                self._router.send([ident, *wire.encode_error(
                    request_id, errors.CANCELLED,
                    f"The zmq listener at {self._address} stopped before the call finished.")])
        self._router.close(_FLUSH_MS)
        self._guard.close()
        self._gate.close()
        self._context.term()
        self._stopped.set()

    # -- workers (every method below runs under or takes self._lock as noted) ------------

    def connections(self) -> int:
        return self._guard.admitted()

    def _start_thread(self, lead: bool) -> None:
        """Under the lock: one more worker, to lead or to park."""
        self._threads += 1
        threading.Thread(target=self._work, args=(lead,), name="clusterwire-zmq",
                         daemon=True).start()

    def _working(self) -> int:
        """Under the lock: threads serving or leading (not parked, not in a parked() wait)."""
        return self._threads - self._waiting - self._parked

    def _promote(self) -> None:
        """Under the lock, with no leader: make a parked thread (or a new one) lead."""
        if self._parked > self._wakeups + self._standby:
            self._wakeups += 1
            self._wakeup.notify()
        elif self._standby and not self._standby_leads:
            self._standby_leads = True
            self._standby_wakeup.notify()
        elif self._threads - self._waiting < self._max_workers:
            self._start_thread(lead=True)
        else:
            return  # every worker is busy: requests wait in the socket's queue
        self._leading = True

    def park(self) -> None:
        """A handler waits on other requests (clusterwire.thread_pool.parked): let another
        worker lead meanwhile, beyond max_workers if need be."""
        with self._lock:
            self._waiting += 1
            if not self._leading and not self._stopping:
                self._promote()

    def unpark(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _work(self, lead: bool) -> None:
        serve_parking(self)
        poller = self._router.poller()
        try:
            if poller is not None:  # None: the listener stopped before this thread began
                with poller:
                    if lead or self._park():
                        self._lead(poller)
        finally:
            with self._lock:
                self._threads -= 1

    def _lead(self, poller: select.epoll) -> None:
        """Wait on the socket and serve; give the socket up only to park."""
        while True:
            parts = self._router.receive(poller)
            with self._lock:
                self._leading = False
                self._handoffs += 1
                if parts is None or self._stopping:
                    return
                if self._standby_asleep:
                    self._standby_asleep = False
                    self._standby_wakeup.notify()
            while parts is not None:
                self._serve(parts)
                with self._lock:
                    if self._stopping:
                        return
                    lead = not self._leading
                    self._leading = True
                if lead:
                    break
                # Another thread leads. Our reply may have consumed libzmq's signal of a
                # request that arrived meanwhile: read before parking.
                parts = self._router.receive(poller, block=False)
            else:
                if not self._park():
                    return

    def _park(self) -> bool:
        """Wait until told to lead (True), or False when this thread is to end."""
        with self._lock:
            if self._threads - self._waiting > self._max_workers:
                return False  # started while others waited parked: no longer needed
            self._parked += 1
            try:
                if not self._standby:
                    return self._stand_by()
                self._wakeup.wait_for(lambda: self._wakeups or self._stopping)
                if self._stopping:
                    return False
                self._wakeups -= 1
                return True
            finally:
                self._parked -= 1

    def _stand_by(self) -> bool:
        """Under the lock, parked: the standby's wait (see the module's docstring)."""
        self._standby = True
        try:
            seen, timed = self._handoffs, True
            while not self._stopping:
                if self._standby_leads:
                    return True
                if not timed:  # no call in a whole interval: sleep until the next one
                    self._standby_asleep = True
                    self._standby_wakeup.wait()
                    self._standby_asleep = False
                    seen, timed = self._handoffs, True
                    continue
                self._standby_wakeup.wait(STANDBY_SECONDS)
                if self._standby_leads or seen != self._handoffs:
                    seen = self._handoffs
                elif self._leading:
                    timed = False
                elif self._working() < self._max_workers:
                    self._leading = True  # one call held the socket for a whole interval
                    if self._threads - self._waiting < self._max_workers:
                        self._start_thread(lead=False)  # the next standby
                    return True
            return False
        finally:
            self._standby = self._standby_leads = self._standby_asleep = False

    def _serve(self, parts: list[zmq.Frame]) -> None:
        if len(parts) < 2:
            return  # a routing id without a body: nothing to answer
        ident = parts[0].bytes
        self._guard.received(ident, parts)
        if len(parts) > self._max_parts or (
                len(parts) > 2 and sum(map(len, parts[2:])) > self._limit):
            self._router.send([ident, *wire.encode_error(
                wire.peek_request_id(parts[1]), errors.RESOURCE_EXHAUSTED,
                f"Message too large: more than {wire.MAX_PARTS} parts or more than the "
                f"max_message_bytes ({self._limit}) of the zmq listener at {self._address} "
                "in its buffer parts. Send less per call, or raise max_message_bytes.")])
            return
        peer = self._guard.admit(ident, parts[1])
        if peer is None:
            self._router.send([ident, *wire.encode_error(
                wire.peek_request_id(parts[1]), errors.RESOURCE_EXHAUSTED,
                f"The zmq listener at {self._address} holds its max_connections "
                f"({self._max_connections}) authenticated connections, and no other peer "
                "holds more than this one: raise max_connections or close idle channels.")])
            return
        try:
            message = wire.decode(parts[1:], self._limit)
        except errors.OpError as err:
            request_id = wire.peek_request_id(parts[1])
            self._router.send([ident, *wire.encode_error(request_id, err.error_code,
                                                         err.message)])
            return
        if message.kind == wire.HELLO:
            self._router.send([ident, *wire.encode_welcome(message.request_id, self._limit)])
        elif message.kind != wire.REQUEST:
            self._router.send([ident, *wire.encode_error(
                message.request_id, errors.INVALID_ARGUMENT,
                f"Malformed message: kind {message.kind} is not a request.")])
        else:
            self._call(ident, message, peer)

    def _call(self, ident: bytes, message: wire.Message, peer: str) -> None:
        call = [ident, message.request_id, False]
        with self._lock:
            if len(self._calls) >= self._max_calls:
                self._router.send([ident, *wire.encode_error(
                    message.request_id, errors.RESOURCE_EXHAUSTED,
                    f"The zmq listener at {self._address} already runs {self._max_calls} "
                    "calls (max_concurrent_calls).")])
                return
            token = next(self._tokens)
            self._calls[token] = call
        try:
            response = self._handler(Frame(message.header, message.buffers, peer=peer))
            header = response.header
            reply = wire.encode(wire.REPLY, message.request_id,
                                header if isinstance(header, bytes) else bytes(header),
                                wire.byte_views(response.buffers), self._inline_max)
        except errors.OpError as err:
            reply = wire.encode_error(message.request_id, err.error_code, err.message)
        except Exception as err:  # the handler's failure is the caller's error, not ours
            reply = wire.encode_error(message.request_id, errors.UNKNOWN,
                                      f"Exception in the handler: {type(err).__name__}: {err}")
        with self._lock:
            # Under the lock, so stop() either sees the call finished or cancels it.
            del self._calls[token]
            if not call[2]:
                self._router.send([ident, *reply])
            if self._stopping:  # stop() waits for the calls in flight
                self._calls_changed.notify_all()
