"""The cluster service every Server hosts: tensor store, remote calls, barrier, status.

It is transport-agnostic: it takes a request ``Frame`` and returns a response
``Frame``. Requests for another task of the cluster are forwarded to that
task's server unchanged (header and buffers as received).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError

from clusterwire import barrier, barrier_tree, codec, errors, functions, in_process, swim
from clusterwire._version import __version__
from clusterwire.addressing import split_host_port
from clusterwire.barrier import Arrival, Releases, Rounds, Subtrees
from clusterwire.barrier_tree import Tree
from clusterwire.cluster_spec import ClusterSpec, with_address
from clusterwire.devices import local_devices
from clusterwire.membership import (
    CHANGES_FIX,
    Membership,
    PeerLink,
    View,
    check_identity,
    identity_proof,
)
from clusterwire.metrics import REGISTRY, catalog, snapshot
from clusterwire.metrics.registry import Sample
from clusterwire.protos.service_pb2 import (
    MembershipView,
    PeerState,
    Request,
    Response,
    TaskRef,
    TaskStatus,
    UnreachablePeer,
)
from clusterwire.rpc import RequestClient
from clusterwire.security import Security
from clusterwire.swim_driver import SwimDriver
from clusterwire.thread_pool import parked
from clusterwire.transport import Buffer, Frame

_MAX_HOPS = 2
#: Methods answered without waiting for other requests (here, or forwarded to their task).
_AT_ONCE = frozenset({"get", "put", "delete", "list", "status", "heartbeat", "identify",
                      "swim"})
#: Answered at once as well: a malformed request or an unknown method (an error).
SERVED_AT_ONCE = _AT_ONCE | {"unknown"}
#: Every method a task serves (a metric's ``method`` label is one of these or "unknown").
METHODS = frozenset({*_AT_ONCE, "call", "barrier", "complete_cluster", "update_cluster",
                     "barrier_arrive", "barrier_release", "barrier_withdraw", "barrier_report",
                     "barrier_missing"})
#: Threads a coordinating task sends barrier releases from (its server threads never do).
_RELEASE_SENDERS = 8
#: How long a peer that could not be reached counts as unreachable (unless reached since).
UNREACHABLE_WINDOW_S = 60.0
_LOG = logging.getLogger("clusterwire")


class _Route(NamedTuple):
    """Where requests with one header go: kept per header while the view is the same."""

    address: str
    header: bytes  # the header as forwarded
    method: str
    label: str  # the method as a metric label (one of METHODS, or "unknown")
    timeout: float | None  # the request's own bound on the forward, if any


def value_response(value: Any) -> Frame:
    """An OK response frame carrying ``value``."""
    def build(buffers: list[Buffer]) -> bytes:
        response = Response()
        codec.encode_into(response.value, value, buffers)
        return response.SerializeToString()

    return Frame(*_responses.encode(None, value, build))


_responses = codec.HeaderCache()
Serve = Callable[[list[Buffer]], Frame]



def _cluster_of(cluster_def: Any) -> ClusterSpec:
    """The cluster a request or a peer's answer carries; a malformed one (a bad job name,
    address or task index) is the sender's error, not this task's."""
    try:
        return ClusterSpec(cluster_def)
    except ValueError as err:
        raise errors.InvalidArgumentError(
            f"The cluster in the request is malformed: {err} Send a ClusterDef whose job "
            "names, task indices and host:port addresses ClusterSpec accepts.") from None

@dataclass
class _Stored:
    header: bytes  # the serialized get response, built once at put
    buffers: list[Buffer]
    nbytes: int


def default_store_bytes() -> int:
    """Half of the machine's physical memory: the store's quota unless one is configured."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _barrier_timeout(name: str, timeout: float, missing: list[int]) -> errors.OpError:
    return errors.DeadlineExceededError(
        f"Barrier {name!r} timed out after {timeout:.3g} s waiting for task(s) {missing}.")


def _no_args(_buffers: list[Buffer]) -> list:
    return []


def _no_kwargs(_buffers: list[Buffer]) -> dict:
    return {}


def _check_call_arguments(request: Request) -> None:
    """A call's arguments must decode to a list and a dict with str keys; their header
    alone says whether they will."""
    kwargs = request.kwargs
    if (request.HasField("value") and request.value.WhichOneof("kind") != "list_value") or (
            request.HasField("kwargs") and (kwargs.WhichOneof("kind") != "dict_value" or any(
                entry.key.WhichOneof("kind") != "str_value"
                for entry in kwargs.dict_value.entries))):
        raise errors.InvalidArgumentError(
            "A call needs its positional arguments as a list (value) and its keyword "
            "arguments as a dict with str keys (kwargs).")


class ClusterService:
    """Serves one task's requests; forwards requests for other tasks to their servers."""

    def __init__(self, cluster: ClusterSpec, job: str, index: int, protocol: str,
                 target: Callable[[], str], peer_timeout: float,
                 transport_info: Callable[[], dict[str, str]],
                 security: Security | None = None, max_store_bytes: int | None = None,
                 heartbeat_seconds: float = 0.0, membership_timeout: float = 0.0,
                 allow_membership_changes: bool = False, membership_protocol: str = ""):
        self.job, self.index, self.protocol = job, index, protocol
        self.name = f"/job:{job}/task:{index}"
        self._target = target
        self._transport_info = transport_info
        self._store: dict[str, _Stored] = {}
        self._store_bytes = 0
        self._max_store_bytes = max_store_bytes or default_store_bytes()
        self._store_lock = threading.Lock()
        # Barriers this task coordinates (it is the lowest index of its job).
        self._rounds = Rounds(max_held=barrier.MAX_HELD_ARRIVALS)
        self._releases = Releases()  # rounds its own callers (and held children) wait for
        self._subtrees = Subtrees()  # its subtree's rounds, in a tree barrier's job
        self._trees: dict[str, tuple[bytes, Tree]] = {}  # job -> (view digest, its tree)
        self._missing_found: dict[str, Future] = {}  # barrier name -> its missing tasks
        self._missing_lock = threading.Lock()
        self._release_senders: ThreadPoolExecutor | None = None
        self._release_lock = threading.Lock()
        # Peers are reached with this server's own credentials (its certificate
        # doubles as the client certificate under mutual TLS).
        self._peers = RequestClient(protocol, timeout=peer_timeout, security=security)
        link = PeerLink(self._send_heartbeat, self._identify_peer, self._peers.drop)
        self._swim: SwimDriver | None = None
        if membership_protocol == "swim":
            if membership_timeout:
                raise errors.InvalidArgumentError(
                    f"membership_timeout_seconds={membership_timeout} does not apply with "
                    'membership_protocol="swim" (its suspicion timeout says when a task is '
                    "down): leave it 0.")
            interval = heartbeat_seconds or swim.Config.probe_interval
            self._swim = SwimDriver((job, index), lambda: self.membership.view,
                                    self._send_swim, swim.Config(
                                        probe_interval=interval, probe_timeout=interval / 2,
                                        allow_joins=allow_membership_changes))
            heartbeat_seconds = 0.0  # SWIM's rounds replace the heartbeats
        elif membership_protocol not in ("", "heartbeats"):
            raise errors.InvalidArgumentError(
                f"membership_protocol {membership_protocol!r} is not one of \"heartbeats\" "
                '(the default) or "swim".')
        self.membership = Membership((job, index), cluster, self._membership_changed, link,
                                     heartbeat_seconds, membership_timeout,
                                     allow_membership_changes)
        # Request header -> what serves it (see _prepare); its method (method_of).
        self._prepared: dict[bytes, Serve] = {}
        self._methods: dict[bytes, str] = {}
        # The view the routes are of; header of a request for another task -> its route.
        self._routes: tuple[View | None, dict[bytes, _Route]] = (None, {})
        self._forwarded = REGISTRY.family(catalog.FORWARDED)
        self._barrier_waits = REGISTRY.family(catalog.BARRIER_WAITS)
        self._stop_reporting = REGISTRY.add_source(self._samples)

    @property
    def cluster(self) -> ClusterSpec:
        """The cluster of the current membership view."""
        return self.membership.view.cluster

    def _membership_changed(self, old: View, new: View) -> None:
        if old.digest == new.digest:
            return  # a version with the same cluster: barriers go on
        before, after = old.tasks(), new.tasks()
        joined = sorted(t for t in after if t not in before)
        left = sorted(t for t in before if t not in after)
        moved = sorted(t for t in after if t in before and after[t] != before[t])
        _LOG.info("clusterwire: %s: membership version %d -> %d; joined %s, left %s, moved %s",
                  self.name, old.version, new.version, joined, left, moved)
        # A round counts the members of the version it started in: its waits end now.
        self._rounds.reset()
        self._subtrees.reset()
        self._releases.abort(f"the membership changed (version {old.version} -> "
                             f"{new.version}) while it waited; arrive again.")

    def _send_heartbeat(self, address: str, view: View, timeout: float) -> View:
        request = Request(method="heartbeat", membership_version=view.version,
                          from_task=TaskRef(job=self.job, index=self.index),
                          cluster=view.cluster.as_cluster_def())
        try:
            response, _ = self._peers.send(address, request, timeout=timeout)
        except errors.DeadlineExceededError as err:
            self._note_if_silent(address, request.method, err)
            raise
        return View.of(response.membership.version, _cluster_of(response.membership.cluster))

    def _heartbeat(self, request: Request) -> Frame:
        sender = (request.from_task.job, request.from_task.index) \
            if request.HasField("from_task") else None
        view = self.membership.receive(
            View.of(request.membership_version, _cluster_of(request.cluster)), sender)
        return Frame(Response(membership=MembershipView(
            version=view.version, cluster=view.cluster.as_cluster_def())).SerializeToString(),
            [])

    def start_membership(self) -> None:
        """Start heartbeats or SWIM, as configured (idempotent)."""
        self.membership.start()
        if self._swim is not None:
            self._swim.start()

    def _send_swim(self, address: str, data: bytes, timeout: float) -> bytes:
        """Send a SWIM message; when the receiver's membership version differs from this
        task's, exchange views with it (a heartbeat: the newer view spreads with the probes,
        as there are no heartbeats to carry it)."""
        view = self.membership.view
        request = Request(method="swim", swim=data, membership_version=view.version,
                          from_task=TaskRef(job=self.job, index=self.index))
        response, _ = self._peers.send(address, request, timeout=timeout, retry=False)
        if response.membership.version != view.version:
            try:
                self.membership.receive(self._send_heartbeat(address, view, timeout), None,
                                        solicited=True)
            except errors.OpError as err:  # the next probe of this peer tries again
                _LOG.debug("clusterwire: %s: membership views not exchanged with %s: %s",
                           self.name, address, err.message)
        return response.swim

    def _take_swim(self, request: Request) -> Frame:
        """A peer's SWIM message, answered at once (its direct ack, if any)."""
        if self._swim is None:
            raise errors.FailedPreconditionError(
                f"{self.name} does not run SWIM: start every task of the cluster with "
                'membership_protocol="swim" (server config).')
        sender = (request.from_task.job, request.from_task.index)
        if not request.HasField("from_task") or sender not in self.membership.view.tasks():
            raise errors.PermissionDeniedError(
                f"A SWIM message to {self.name} must come from a task of its membership "
                f"view (from_task /job:{sender[0]}/task:{sender[1]} is not one).")
        answer = self._swim.receive(sender, request.swim)
        return Frame(Response(swim=answer, membership=MembershipView(
            version=self.membership.view.version)).SerializeToString(), [])

    def _identify_peer(self, task: tuple[str, int], address: str, timeout: float) -> None:
        """Raise unless ``address`` answers ``identify`` as ``task``, with the proof."""
        nonce = secrets.token_bytes(32)
        response, buffers = self._peers.send(address, Request(method="identify", nonce=nonce),
                                             timeout=timeout, retry=False)
        check_identity(self._peers.security.token, nonce, task, address,
                       codec.decode(response.value, buffers))

    def _identify(self, request: Request) -> Frame:
        """This task and its address, with the proof of the cluster token for the
        challenge (see clusterwire.membership)."""
        if not 16 <= len(request.nonce) <= 64:
            raise errors.InvalidArgumentError(
                f"identify needs a challenge (nonce) of 16 to 64 bytes, got "
                f"{len(request.nonce)}.")
        me = (self.job, self.index)
        address = self.cluster.task_address(*me)
        return value_response({"job": self.job, "index": self.index, "address": address,
                               "proof": identity_proof(self._peers.security.token,
                                                       request.nonce, me, address)})

    def leave(self) -> None:
        """A stopping task's goodbye to its peers: with SWIM, a leave they take at once
        (heartbeats have none: a stopped task is found down)."""
        if self._swim is not None:
            self._swim.leave()

    def cancel_waits(self) -> None:
        """Answer the waits left with CancelledError (the server's shell is stopping):
        barrier waits, and requests waiting on a peer (forwarded, or a barrier arrival held
        by its coordinator), whose peer calls are cancelled.

        Remote calls still running are cancelled by the listener's stop, which answers their
        callers with CancelledError (a function's thread cannot be killed; its result is
        dropped).
        """
        self._releases.cancel()
        self._peers.close()

    def close(self) -> None:
        """Release peer connections; stop reporting metrics."""
        self.membership.stop()
        if self._swim is not None:
            self._swim.close()
        self._peers.close()
        self._stop_reporting()
        for family in (self._forwarded, self._barrier_waits):
            family.remove(server=self.name)
        with self._release_lock:
            senders, self._release_senders = self._release_senders, None
        if senders is not None:
            senders.shutdown(wait=False, cancel_futures=True)

    def handle(self, frame: Frame) -> Frame:
        """Serve one request frame (the shell maps the errors it raises)."""
        header = frame.header if type(frame.header) is bytes else bytes(frame.header)
        serve = self._prepared.get(header)
        if serve is None:
            view, routes = self._routes
            route = routes.get(header) if view is self.membership.view else None
            if route is not None:
                return self._send_on(route, frame.buffers)
            try:
                request = Request.FromString(header)
            except DecodeError as err:
                raise errors.InvalidArgumentError(f"Malformed request header: {err}") from None
            if request.has_task and (request.task.job, request.task.index) != (
                    self.job, self.index):
                view, route = self._route(request)
                if len(header) <= codec.PLAN_KEY_MAX:
                    self._remember_route(header, view, route)
                return self._send_on(route, frame.buffers)
            serve = self._prepare(request)
            if serve is None:
                return self._serve(request, list(frame.buffers))
            if len(header) <= codec.PLAN_KEY_MAX:
                codec.remember(self._prepared, header, serve)
        return serve(list(frame.buffers))

    def method_of(self, frame: Frame) -> str:
        """The request's method, one of ``METHODS`` or "unknown" (malformed or unknown)."""
        header = frame.header if type(frame.header) is bytes else bytes(frame.header)
        method = self._methods.get(header)
        if method is None:
            try:
                method = Request.FromString(header).method
            except DecodeError:
                method = "unknown"
            if method not in METHODS:
                method = "unknown"
            if len(header) <= codec.PLAN_KEY_MAX:
                codec.remember(self._methods, header, method)
        return method

    def _address_of(self, job: str, index: int) -> str:
        try:
            return self.cluster.task_address(job, index)
        except ValueError:
            raise errors.NotFoundError(
                f"No task /job:{job}/task:{index} in the cluster {self.cluster!r} (membership "
                f"version {self.membership.view.version}).") from None

    def _note_if_silent(self, address: str, method: str,
                        err: errors.DeadlineExceededError) -> None:
        """A request of a method answered at once that got no answer in time: the peer is
        cut off with a connection still open (a refused connection would have said so at
        once), so it counts as unreachable (the caller raises ``err`` on)."""
        if method in _AT_ONCE:
            self._peers.note_unreachable(address, err.message)

    def _remember_route(self, header: bytes, view: View, route: _Route) -> None:
        """Keep ``route`` (of membership ``view``) for requests with ``header`` while the
        view is the task's (the routes of an older view are dropped with it)."""
        kept_view, routes = self._routes
        if kept_view is not view:
            routes = {}
            self._routes = (view, routes)
        codec.remember(routes, header, route)

    def _route(self, request: Request) -> tuple[View, _Route]:
        """The current view and where ``request`` (for another task) goes in it, with its
        header as forwarded: one more hop, nothing else changed."""
        if request.hops >= _MAX_HOPS:
            raise errors.InternalError(
                f"Request for /job:{request.task.job}/task:{request.task.index} was forwarded "
                f"{request.hops} times: the tasks disagree on the cluster spec.")
        view = self.membership.view
        address = self._address_of(request.task.job, request.task.index)
        request.hops += 1
        timeout = None
        if request.method == "barrier" and request.timeout_seconds:
            timeout = request.timeout_seconds + self._peers.timeout
        elif request.method == "status" and request.timeout_seconds > 0:
            # The caller's budget (Session.status): a task that does not answer is named
            # in this task's error before the caller's own deadline passes.
            timeout = min(request.timeout_seconds, self._peers.timeout)
        method = request.method
        return view, _Route(address, request.SerializeToString(), method,
                            method if method in METHODS else "unknown", timeout)

    def _forward(self, request: Request, buffers: Sequence[Buffer]) -> Frame:
        return self._send_on(self._route(request)[1], buffers)

    def _send_on(self, route: _Route, buffers: Sequence[Buffer]) -> Frame:
        """Forward a request along ``route``: the peer's answer."""
        self._forwarded.inc(self.name, route.label)
        timeout = route.timeout
        left = in_process.time_left()  # a caller of this process waits for this long
        if left is not None:
            timeout = min(timeout or self._peers.timeout, left)
        with parked():
            try:
                # A caller of this process takes the buffers themselves; for one on the
                # wire, they may stream through this task's listener as they arrive
                # (cut-through).
                reply = self._peers.send_frame(
                    route.address, Frame(route.header, buffers), route.method, timeout,
                    relay=not in_process.serving())
            except errors.DeadlineExceededError as err:
                self._note_if_silent(route.address, route.method, err)
                raise
        # Received for this request alone: an in-process caller may share them.
        return Frame(reply.header, reply.buffers, frozen=True)

    def _prepare(self, request: Request) -> Serve | None:
        """What serves a request with this header, given its buffers, for the methods whose
        answer depends on nothing else (get, call): kept and reused for the same header."""
        name = request.name
        if request.method == "get":
            return lambda _buffers: self._get(name)
        if request.method == "call":
            _check_call_arguments(request)
            args = codec.decoder(request.value) if request.HasField("value") else _no_args
            kwargs = codec.decoder(request.kwargs) if request.HasField("kwargs") else _no_kwargs
            return lambda buffers: self._call(name, args(buffers), kwargs(buffers))
        return None

    def _get(self, name: str) -> Frame:
        with self._store_lock:
            stored = self._store.get(name)
        if stored is None:
            raise errors.NotFoundError(
                f"No tensor named {name!r} on /job:{self.job}/task:{self.index}.")
        return Frame(stored.header, stored.buffers, frozen=True)  # the store never writes

    def _serve(self, request: Request, buffers: list[Buffer]) -> Frame:
        method = request.method
        if method == "put":
            codec.decode(request.value, buffers)  # validate before storing
            self._store_put(request.name, _Stored(
                Response(value=request.value).SerializeToString(), buffers,
                sum(memoryview(b).nbytes for b in buffers)))
            return value_response(None)
        if method == "delete":
            with self._store_lock:
                found = self._store.pop(request.name, None)
                self._store_bytes -= found.nbytes if found else 0
            return value_response(found is not None)
        if method == "list":
            with self._store_lock:
                return value_response(sorted(self._store))
        if method.startswith("barrier"):
            return self._barrier_request(request)
        if method == "complete_cluster":
            self.complete_cluster(_cluster_of(request.cluster))
            return value_response(None)
        if method == "update_cluster":
            if not self.membership.allow_changes:
                raise errors.PermissionDeniedError(
                    f"update_cluster: {self.name} takes membership changes from clients only "
                    f"when its operator enables them: {CHANGES_FIX}.")
            return value_response(self.update_cluster(_cluster_of(request.cluster)))
        if method == "status":
            return Frame(Response(task_status=self.status()).SerializeToString(), [])
        if method == "heartbeat":
            return self._heartbeat(request)
        if method == "identify":
            return self._identify(request)
        if method == "swim":
            return self._take_swim(request)
        raise errors.UnimplementedError(
            f"Unknown method {method!r}; this server serves: status, put, get, delete, list, "
            "call, barrier, complete_cluster, update_cluster (and, between tasks, "
            "barrier_arrive, barrier_release, barrier_withdraw, barrier_report, "
            "barrier_missing, heartbeat, identify, swim).")

    def _store_put(self, name: str, stored: _Stored) -> None:
        """Store ``stored`` as ``name`` (replacing it) within max_store_bytes."""
        with self._store_lock:
            old = self._store.get(name)
            total = self._store_bytes - (old.nbytes if old else 0) + stored.nbytes
            if total > self._max_store_bytes:
                raise errors.ResourceExhaustedError(
                    f"Storing {name!r} ({stored.nbytes} bytes) would put "
                    f"/job:{self.job}/task:{self.index}'s store at {total} bytes, over its "
                    f"max_store_bytes ({self._max_store_bytes}); delete tensors or raise "
                    "max_store_bytes.")
            self._store[name] = stored
            self._store_bytes = total

    @staticmethod
    def _call(name: str, args: list, kwargs: dict[str, Any]) -> Frame:
        fn = functions.lookup(name)
        try:
            result = fn(*args, **kwargs)
        except errors.OpError:
            raise
        except Exception as err:
            raise errors.RemoteFunctionError(
                str(err), f"{type(err).__module__}.{type(err).__qualname__}",
                traceback.format_exc()) from None
        return value_response(result)

    # -- barriers (see clusterwire.barrier) -------------------------------------------

    def _barrier_request(self, request: Request) -> Frame:
        method, name = request.method, request.name
        if not 0.0 <= request.timeout_seconds <= threading.TIMEOUT_MAX:  # NaN too
            raise errors.InvalidArgumentError(
                f"{method}: timeout_seconds {request.timeout_seconds!r} is not a wait; send "
                f"0 (the server's peer timeout) or up to {threading.TIMEOUT_MAX:.0f} s.")
        if method == "barrier_release":
            self._releases.release(name, request.round_id)
            return value_response(None)
        job = request.from_task.job or self.job
        index = request.from_task.index if request.from_task.job else self.index
        try:
            expected = set(self.cluster.task_indices(job))
        except ValueError:
            raise errors.NotFoundError(f"No job {job!r} in the cluster for a barrier.") from None
        if index not in expected:
            raise errors.InvalidArgumentError(f"Task {index} is not in job {job!r}.")
        coordinator = (job, min(expected))
        tree = self._tree(job, expected) if len(expected) > barrier.FLAT_MAX_TASKS else None
        if method == "barrier" and tree is not None and (job, index) != (self.job, self.index):
            # Counted on the task it arrives as: the caller waits there.
            request.task.CopyFrom(TaskRef(job=job, index=index))
            return self._forward(request, [])
        if method == "barrier":
            started = time.monotonic()
            try:
                if tree is None:
                    self._barrier(request, index, expected, coordinator)
                else:
                    self._tree_barrier(request, tree)
            finally:
                self._barrier_waits.observe(self.name, value=time.monotonic() - started)
            return value_response(None)
        if method in ("barrier_report", "barrier_missing"):
            return value_response(self._tree_request(request, job, index, tree))
        if coordinator != (self.job, self.index):
            raise errors.FailedPreconditionError(
                f"{method} for job {job!r} goes to /job:{job}/task:{coordinator[1]}, not to "
                f"/job:{self.job}/task:{self.index}.")
        if method == "barrier_arrive":
            return value_response(self._coordinate(request, index, expected))
        if method == "barrier_withdraw":
            return value_response(self._rounds.withdraw(name, request.round_id, index,
                                                        expected))
        raise errors.UnimplementedError(f"Unknown barrier method {method!r}.")

    def _barrier(self, request: Request, index: int, expected: set[int],
                 coordinator: tuple[str, int]) -> None:
        """A caller arrives as task ``index``: count it on the coordinator, wait here."""
        name = request.name
        timeout = request.timeout_seconds or self._peers.timeout
        me = (self.job, self.index)
        arrival = TaskRef(job=coordinator[0], index=index)
        if coordinator == me:
            counted = self._rounds.arrive(name, index, expected, me, hold=False)
            round_id, released = counted.round_id, counted.release is not None
            if released:
                self._release_round(name, counted, me)
        else:
            answer = self._ask_task(coordinator, Request(
                method="barrier_arrive", name=name, from_task=arrival, timeout_seconds=timeout,
                release_to=TaskRef(job=self.job, index=self.index)), timeout)
            round_id, released = answer["round"], answer["released"]
            if answer["missing"] is not None:
                raise _barrier_timeout(name, timeout, answer["missing"])
        if released:
            self._releases.release(name, round_id)  # for other callers waiting here on it
            return
        if self._releases.wait(name, round_id, timeout):
            return
        withdraw = Request(method="barrier_withdraw", name=name, from_task=arrival,
                           round_id=round_id)
        try:
            missing = (self._rounds.withdraw(name, round_id, index, expected)
                       if coordinator == me else self._ask_task(coordinator, withdraw))
        except errors.OpError as err:
            raise errors.DeadlineExceededError(
                f"Barrier {name!r} timed out after {timeout:.3g} s, and its coordinator "
                f"/job:{coordinator[0]}/task:{coordinator[1]} could not say which tasks are "
                f"missing: {err.message}") from None
        if missing is not None:
            raise _barrier_timeout(name, timeout, missing)
        # else: released while this caller gave up

    def _coordinate(self, request: Request, index: int, expected: set[int]) -> dict[str, Any]:
        """Count an arrival another task reports; answer once released if it is held."""
        name = request.name
        waiter = (request.release_to.job, request.release_to.index)
        counted = self._rounds.arrive(name, index, expected, waiter, hold=True)
        answer = {"round": counted.round_id, "released": counted.release is not None,
                  "missing": None}
        if counted.release is not None:
            self._release_round(name, counted, waiter)
        if not counted.held:
            return answer
        try:
            answer["released"] = self._releases.wait(
                name, counted.round_id, request.timeout_seconds or self._peers.timeout)
        finally:
            self._rounds.unhold()
        if not answer["released"]:
            answer["missing"] = self._rounds.withdraw(name, counted.round_id, index, expected)
            answer["released"] = answer["missing"] is None
        return answer

    def _ask_task(self, task: tuple[str, int], request: Request, wait: float = 0.0,
                  retry: bool = True) -> Any:
        """Send ``request`` to ``task``, parked: its answer's value (an answer held up to
        ``wait`` seconds gets that on top of the peer timeout)."""
        with parked():
            response, buffers = self._peers.send(self._address_of(*task), request,
                                                 timeout=wait + self._peers.timeout,
                                                 retry=retry)
        return codec.decode(response.value, buffers)

    # -- tree barriers (a job of more than barrier.FLAT_MAX_TASKS tasks) ---------------

    def _tree(self, job: str, expected: set[int]) -> Tree:
        """The barrier tree of ``job`` in the current view (built once per view)."""
        view = self.membership.view
        known = self._trees.get(job)
        if known is not None and known[0] == view.digest:
            return known[1]
        tree = barrier_tree.build({i: view.cluster.task_address(job, i) for i in expected},
                                  barrier_tree.FAN_IN)
        self._trees[job] = (view.digest, tree)
        return tree

    def _below(self, tree: Tree) -> frozenset[int]:
        """What this task's subtree round counts: itself and its children."""
        return frozenset((self.index, *tree.children[self.index]))

    def _tree_request(self, request: Request, job: str, index: int,
                      tree: Tree | None) -> Any:
        """A child's report (``from_task`` the child), or a question for this task's
        subtree's missing tasks (``from_task`` this task, ``timeout_seconds`` how long the
        asking caller has waited)."""
        if tree is not None and job == self.job:
            if request.method == "barrier_missing" and index == self.index:
                return self._subtree_missing(request.name, tree, request.timeout_seconds)
            if request.method == "barrier_report" and tree.parent[index] == self.index:
                return self._held_report(request, index, tree)
        raise errors.FailedPreconditionError(
            f"{request.method} from /job:{job}/task:{index} does not fit {self.name}'s "
            f"barrier tree (membership version {self.membership.view.version}): the tasks "
            "disagree on the cluster.")

    def _tree_barrier(self, request: Request, tree: Tree) -> None:
        """A caller arrives as this task: count it in the subtree round, wait here."""
        name = request.name
        timeout = request.timeout_seconds or self._peers.timeout
        started = time.monotonic()
        round_id, complete = self._subtrees.arrive(name, self.index, self._below(tree))
        if complete:
            self._report(name, round_id, tree, timeout)
        if self._releases.wait(name, round_id, max(0.0, started + timeout - time.monotonic())):
            return
        self._subtrees.withdraw(name, round_id, self.index)
        missing = self._missing_below(name, tree, tree.root, time.monotonic() - started)
        if self._releases.wait(name, round_id, 0.0):
            return  # released while this caller gave up
        if not missing:
            raise errors.DeadlineExceededError(
                f"Barrier {name!r} timed out after {timeout:.3g} s: every task arrived, but "
                f"the release did not reach {self.name} (its parent in the barrier tree, "
                f"/job:{self.job}/task:{tree.parent[self.index]}, stopped or gave up).")
        raise _barrier_timeout(name, timeout, missing)

    def _held_report(self, request: Request, child: int, tree: Tree) -> bool:
        """Count a child's complete subtree; answer whether the round was released before
        the report's timeout (else the report is withdrawn, unless sealed meanwhile)."""
        name = request.name
        timeout = request.timeout_seconds or self._peers.timeout
        started = time.monotonic()
        round_id, complete = self._subtrees.arrive(name, child, self._below(tree))
        if complete:
            self._report(name, round_id, tree, timeout)
        if self._releases.wait(name, round_id, max(0.0, started + timeout - time.monotonic())):
            return True
        self._subtrees.withdraw(name, round_id, child)
        return self._releases.wait(name, round_id, 0.0)

    def _report(self, name: str, round_id: int, tree: Tree, timeout: float) -> None:
        """This task's subtree completed round ``round_id``: release it at the root, else
        report it to the parent and release it when the parent's answer says so."""
        parent = tree.parent[self.index]
        if parent is not None:
            report = Request(method="barrier_report", name=name, timeout_seconds=timeout,
                             from_task=TaskRef(job=self.job, index=self.index))
            try:
                # Not retried: a parent that is down is named when the callers time out.
                released = self._ask_task((self.job, parent), report, timeout,
                                                 retry=False)
            except errors.OpError as err:
                _LOG.warning("Could not report barrier %r to /job:%s/task:%d: %s", name,
                             self.job, parent, err.message)
                return  # the subtree stays counted as arrived (sealed)
            if not released:
                self._subtrees.settled(name, round_id, released=False)  # withdrawn above
                return
        self._subtrees.settled(name, round_id, released=True)
        self._releases.release(name, round_id)

    def _subtree_missing(self, name: str, tree: Tree, waited: float) -> list[int]:
        """The tasks of this task's subtree a caller that has waited ``waited`` s misses.

        The callers of a round time out together: those that ask while an answer for
        ``name`` is being found share it, so this task asks its children once, not once
        per caller."""
        with self._missing_lock:
            found = self._missing_found.get(name)
            finding = found is None
            if finding:
                found = self._missing_found[name] = Future()
        if not finding:
            with parked():
                return found.result()
        try:
            missing = self._find_missing(name, tree, waited)
        except BaseException as err:
            found.set_exception(err)
            raise
        finally:
            with self._missing_lock:
                del self._missing_found[name]
        found.set_result(missing)
        return missing

    def _find_missing(self, name: str, tree: Tree, waited: float) -> list[int]:
        unreported = self._subtrees.unreported(name, self._below(tree), waited)
        children = [who for who in unreported if who != self.index]
        return sorted([*(who for who in unreported if who == self.index),
                       *self._missing_among(name, tree, children, waited)])

    def _missing_among(self, name: str, tree: Tree, nodes: list[int],
                       waited: float) -> list[int]:
        """The missing tasks of the subtrees of ``nodes``, asked of them at once (a host cut
        off costs one peer timeout a level, not one per task)."""
        if len(nodes) <= 1:
            return [task for node in nodes
                    for task in self._missing_below(name, tree, node, waited)]
        with ThreadPoolExecutor(len(nodes), thread_name_prefix="clusterwire-barrier-missing"
                                ) as pool, parked():
            return [task for found in pool.map(
                lambda node: self._missing_below(name, tree, node, waited), nodes)
                for task in found]

    def _missing_below(self, name: str, tree: Tree, node: int, waited: float) -> list[int]:
        """The missing tasks of ``node``'s subtree: asked of ``node``; if it cannot answer,
        ``node`` itself and, asked of its children, theirs."""
        if node == self.index:
            return self._subtree_missing(name, tree, waited)
        question = Request(method="barrier_missing", name=name, timeout_seconds=waited,
                           from_task=TaskRef(job=self.job, index=node))
        below = tree.question_timeouts(node) * self._peers.timeout
        try:
            return list(self._ask_task((self.job, node), question, below, retry=False))
        except errors.OpError:
            return sorted([node, *self._missing_among(name, tree, list(tree.children[node]),
                                                      waited)])

    def _release_round(self, name: str, counted: Arrival, completing: tuple[str, int]) -> None:
        """Release a completed round: the arrivals held here and this task's own callers at
        once, the other tasks' callers (answered at once) by a release sent to their task.
        The caller of the ``completing`` arrival learns it from the answer."""
        self._releases.release(name, counted.round_id)
        for task in (counted.release or set()) - {completing, (self.job, self.index)}:
            self._send_release(task, name, counted.round_id)

    def _send_release(self, task: tuple[str, int], name: str, round_id: int) -> None:
        with self._release_lock:
            if self._release_senders is None:
                self._release_senders = ThreadPoolExecutor(
                    _RELEASE_SENDERS, thread_name_prefix="clusterwire-barrier-release")
            senders = self._release_senders
        request = Request(method="barrier_release", name=name, round_id=round_id)

        def send() -> None:
            try:
                self._peers.send(self._address_of(*task), request)
            except errors.CancelledError:
                pass  # this server is stopping
            except errors.OpError as err:  # its callers time out, naming no missing task
                _LOG.warning("Could not release barrier %r at /job:%s/task:%d: %s", name,
                             *task, err.message)

        with contextlib.suppress(RuntimeError):  # the server is stopping: waits cancelled
            senders.submit(send)

    def complete_cluster(self, cluster: ClusterSpec) -> None:
        """Learn the ports of tasks that were started with port 0.

        ``cluster`` must have the same tasks; an address may differ from the
        known one only where the known port is 0 (FailedPreconditionError
        otherwise), so a running cluster cannot be re-pointed.
        """
        known = self.cluster
        if {j: known.task_indices(j) for j in known.jobs} != {
                j: cluster.task_indices(j) for j in cluster.jobs}:
            raise errors.FailedPreconditionError(
                f"complete_cluster: {cluster!r} does not have the tasks of {known!r}.")
        for job in known.jobs:
            for index in known.task_indices(job):
                old, new = known.task_address(job, index), cluster.task_address(job, index)
                if old != new and split_host_port(old) != (split_host_port(new)[0], 0):
                    raise errors.FailedPreconditionError(
                        f"complete_cluster: /job:{job}/task:{index} is at {old}; only "
                        "port-0 addresses can be completed.")
        if cluster.task_address(self.job, self.index) != known.task_address(self.job, self.index):
            raise errors.FailedPreconditionError("complete_cluster may not move this task.")
        self.membership.update(cluster)

    def _samples(self) -> list[Sample]:
        with self._store_lock:
            stored, nbytes = len(self._store), self._store_bytes
        return [Sample(catalog.STORE_BYTES, (self.name,), nbytes),
                Sample(catalog.STORE_TENSORS, (self.name,), stored),
                Sample(catalog.PEER_FAILURES, (self.name,), self._peers.failures),
                Sample(catalog.UNREACHABLE_PEERS, (self.name,),
                       len(self._peers.unreachable(UNREACHABLE_WINDOW_S)))]

    def _unreachable_peers(self) -> list[UnreachablePeer]:
        tasks = {address: TaskRef(job=job, index=index)
                 for (job, index), address in self.membership.view.tasks().items()}
        return [UnreachablePeer(task=tasks.get(address), address=address,
                                last_failure_unix_seconds=when, error=error)
                for address, (when, error)
                in sorted(self._peers.unreachable(UNREACHABLE_WINDOW_S).items())]

    def update_cluster(self, cluster: ClusterSpec) -> int:
        """Make ``cluster`` the next membership version (this task at its own address);
        the version. See ``Server.update_cluster``."""
        if self.job not in cluster.jobs or self.index not in cluster.task_indices(self.job):
            raise errors.InvalidArgumentError(
                f"update_cluster: {cluster!r} does not have this task {self.name}; a task "
                "cannot remove itself (stop it, and update the others).")
        own = self.cluster.task_address(self.job, self.index)
        return self.membership.update(with_address(cluster, self.job, self.index, own)).version

    def status(self) -> TaskStatus:
        """This task's identity, cluster, devices, version, metrics and the peers it could
        not reach recently."""
        status = TaskStatus(task=TaskRef(job=self.job, index=self.index),
                            cluster=self.cluster.as_cluster_def(), protocol=self.protocol,
                            target=self._target(), version=__version__,
                            cpu_count=len(os.sched_getaffinity(0)))
        status.devices.extend(local_devices(self.job, self.index))
        status.transport_info.update(self._transport_info())
        status.metrics.extend(snapshot.to_protos(REGISTRY.samples(server=self.name)))
        status.unreachable_peers.extend(self._unreachable_peers())
        status.membership_version = self.membership.view.version
        status.peers.extend(
            PeerState(task=TaskRef(job=job, index=index), address=address,
                      last_seen_unix_seconds=seen, down=down)
            for (job, index), address, seen, down in (
                self._swim.peers() if self._swim is not None else self.membership.peers()))
        return status
