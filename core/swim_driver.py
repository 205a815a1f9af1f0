"""Runs a task's ``clusterwire.swim`` state machine: its clock, its thread, its messages.

A task with ``membership_protocol="swim"`` has one ``SwimDriver``. The members are the
tasks of the membership view, named ``"job:index"``; a member's address is the one of the
current view (versioned views and ``identify`` still decide where a task is). The driver
ticks the state machine at its ``next_wakeup()`` on ``time.monotonic()`` and hands every
message it returns to a bounded pool of senders; a message is one ``swim`` request whose
response carries the receiver's direct answer (an ack). When every sender is busy (peers
that do not answer hold them up to a probe timeout each) a message is dropped and counted:
SWIM takes a lost message as it takes a lost datagram, and the thread that ticks never
waits on a peer. A received message is taken under the driver's lock and answered at once;
what it makes the task send to others (a ping-req's ping, a relayed ack) goes through the
same pool, so no server thread waits on a third task.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures

from clusterwire import errors, swim
from clusterwire.membership import Task, View

#: Messages a task has in flight at once (more are dropped, as lost).
SENDERS = 16

#: How long a stopping task waits for its leave to be taken (sent once in its life, so it
#: may wait longer than a probe).
LEAVE_SECONDS = 1.0

#: ``send(address, message bytes, timeout)``: the receiver's answer's bytes (b"": none).
Send = Callable[[str, bytes, float], bytes]


def member_name(task: Task) -> str:
    """The SWIM member name of ``task``: ``"job:index"``."""
    return f"{task[0]}:{task[1]}"


class SwimDriver:
    """One task's SWIM member, run on the wall clock and the task's peer client."""

    def __init__(self, me: Task, view: Callable[[], View], send: Send,
                 config: swim.Config, senders: int = SENDERS):
        """``view()`` is the task's current membership view; ``send`` delivers a message
        (raising an OpError when the peer cannot be reached or refuses it)."""
        self.me, self.name = me, member_name(me)
        self.config = config
        self._view, self._send = view, send
        self._lock = threading.Lock()
        self._swim: swim.Swim | None = None
        self._members: dict[str, str] = {}  # the addresses the member began with
        self._names: tuple[bytes, dict[str, str]] = (b"", {})  # view digest -> addresses
        self._heard: dict[str, float] = {}  # member -> last message from it (time.time())
        self.dropped: Counter = Counter()  # messages not sent, by reason
        self._free = threading.BoundedSemaphore(senders)
        self._senders = futures.ThreadPoolExecutor(senders, thread_name_prefix="clusterwire-swim")
        self._wake = threading.Event()
        self._sleep_until = 0.0  # when the ticker wakes next, unless woken (time.monotonic())
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="clusterwire-swim-ticker")

    def start(self) -> None:
        """Join the view's members and start probing (idempotent)."""
        with self._lock:
            if self._swim is not None:
                return
            self._begin(0)
        self._thread.start()

    def _begin(self, incarnation: int) -> None:
        """A fresh member for the view's tasks at their current addresses (under the lock)."""
        addresses = self._addresses()
        self._members = addresses
        self._swim = swim.Swim(self.name, addresses[self.name], addresses,
                               now=time.monotonic(), config=self.config,
                               incarnation=incarnation)
        if self.config.allow_joins:
            self._swim.join()

    def _follow_moves(self) -> None:
        """Begin afresh when a member's address changed in the view (a port bound after a
        port-0 start, a task restarted elsewhere): SWIM refuses news of a known member at
        another address, so its refutations would be refused. The states it held are
        found again by probing."""
        addresses = self._addresses()
        if addresses is self._members:
            return
        if any(addresses.get(member, address) != address
               for member, address in self._members.items()):
            self._begin(self._swim.incarnation)
        else:
            self._members = addresses

    def receive(self, sender: Task, data: bytes) -> bytes:
        """Take the message ``data`` that task ``sender`` sent; the direct answer's bytes
        (b"" if none). InvalidArgumentError, ResourceExhaustedError or
        PermissionDeniedError (nothing taken) when it is refused: malformed, over the
        bounds of ``clusterwire.swim``, or speaking for another member than its sender."""
        message = swim.Message.from_bytes(data)
        expected = member_name(sender)
        if message.sender != expected:
            raise errors.PermissionDeniedError(
                f"SWIM message from /job:{sender[0]}/task:{sender[1]} says it is from "
                f"{message.sender[:80]!r}: a task sends SWIM messages only as itself "
                f"({expected!r}).")
        with self._lock:
            if self._swim is None:
                raise errors.UnavailableError(
                    f"{self.name} has not started SWIM yet; send again in a moment.")
            out = self._swim.receive(time.monotonic(), message)
            self._heard[message.sender] = time.time()
            sooner = self._sooner()
        answer = b""
        rest = []
        for member, reply in out:
            if not answer and member == message.sender and reply.kind == swim.Kind.ACK:
                answer = reply.to_bytes()
            else:
                rest.append((member, reply))
        self._dispatch(rest)
        if sooner:
            self._wake.set()
        return answer

    def states(self) -> dict[Task, swim.State]:
        """The SWIM state of every task of the view but this one (unknown ones alive)."""
        with self._lock:
            machine = self._swim
            states = machine.members() if machine is not None else {}
        view = self._view()
        return {task: states.get(member_name(task), (swim.State.ALIVE, 0))[0]
                for task in view.tasks() if task != self.me}

    def peers(self) -> list[tuple[Task, str, float, bool]]:
        """Every other task of the view: (task, address, last heard as ``time.time()`` or
        0, down: dead or left in SWIM's view)."""
        states = self.states()
        with self._lock:
            heard = dict(self._heard)
        return [(task, address, heard.get(member_name(task), 0.0),
                 states[task] in (swim.State.DEAD, swim.State.LEFT))
                for task, address in sorted(self._view().tasks().items())
                if task != self.me]

    def leave(self) -> None:
        """Tell the others this task leaves (a server stopping does this before it drains):
        the leave goes at once to up to ``indirect_checks`` live members, which mark this
        task left and spread it, so no one has to find it dead. Waits at most
        ``LEAVE_SECONDS`` (or the probe timeout, if longer) for those messages; from then
        on this member sends and takes nothing. A task killed outright sends nothing and is
        found dead, as before."""
        with self._lock:
            if self._swim is None or self._stopped.is_set():
                return
            out = self._swim.leave()
            addresses = self._addresses()
        timeout = max(self.config.probe_timeout, LEAVE_SECONDS)
        sends = []
        for member, message in out:  # at most indirect_checks: not held to the senders' cap
            if member in addresses:
                try:
                    sends.append(self._senders.submit(
                        self._send, addresses[member], message.to_bytes(), timeout))
                except RuntimeError:  # closed meanwhile
                    break
        futures.wait(sends, timeout)

    def close(self) -> None:
        """Stop ticking and sending (without a leave: see ``leave``)."""
        self._stopped.set()
        self._wake.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._senders.shutdown(wait=False, cancel_futures=True)

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.clear()
            with self._lock:
                self._follow_moves()
                now = time.monotonic()
                out = self._swim.tick(now)
                self._sleep_until = min(self._swim.next_wakeup(),
                                        now + self.config.probe_interval)
            self._dispatch(out)
            self._wake.wait(max(0.0, self._sleep_until - time.monotonic()))

    def _sooner(self) -> bool:
        """Whether the state machine's next wakeup is now before the ticker's (under the
        lock): only then is the ticker woken, so an acknowledged probe costs it no wake."""
        return self._swim.next_wakeup() < self._sleep_until

    def _addresses(self) -> dict[str, str]:
        """Member name -> address in the current view (rebuilt when the view changes)."""
        view = self._view()
        digest, names = self._names
        if digest != view.digest:
            names = {member_name(task): address for task, address in view.tasks().items()}
            self._names = (view.digest, names)
        return names

    def _dispatch(self, out: swim.Outgoing) -> None:
        if not out or self._stopped.is_set():
            return
        with self._lock:
            addresses = self._addresses()
        for member, message in out:
            address = addresses.get(member)
            if address is None:
                self.dropped["member not in the view"] += 1
            elif not self._free.acquire(blocking=False):
                self.dropped["every sender busy"] += 1
            else:
                try:
                    self._senders.submit(self._send_one, member, address, message)
                except RuntimeError:  # closed meanwhile
                    self._free.release()

    def _send_one(self, member: str, address: str, message: swim.Message) -> None:
        try:
            if self._stopped.is_set():
                return
            try:
                data = self._send(address, message.to_bytes(), self.config.probe_timeout)
            except errors.OpError:
                self.dropped["peer unreachable or refused"] += 1
                return
            if not data:
                return
            try:
                reply = swim.Message.from_bytes(data)
                if reply.sender != member:
                    raise errors.PermissionDeniedError(
                        f"SWIM answer from {address} says it is from {reply.sender!r}, "
                        f"not {member!r}")
                with self._lock:
                    out = self._swim.receive(time.monotonic(), reply)
                    self._heard[reply.sender] = time.time()
                    sooner = self._sooner()
            except errors.OpError:
                self.dropped["answer refused"] += 1
                return
            self._dispatch(out)
            if sooner:
                self._wake.set()
        finally:
            self._free.release()
