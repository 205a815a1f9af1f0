"""``clusterwire top``: a live table of a cluster's tasks, or of the data service's workers
and jobs, read from their status (``clusterwire.metrics``; no Prometheus needed).

Each refresh asks every server once, all at once, with a deadline: a server that does not
answer is shown as unreachable, never waited for past it. The servers are the target's task
and the others of the cluster of its first answer (or the dispatcher and the workers it
lists), at most ``MAX_SERVERS`` of them: a reply naming a thousand dead addresses costs one
deadline and ``MAX_SERVERS`` connections, not a thousand. A rate is the difference of a
counter between two consecutive answers of one server divided by the time between them
(monotonic clock); the first frame has none. top's own status requests are left out of
what it shows: the server counts each one (and its bytes) by its next answer, and shows it
in flight in the answer it is part of, so top subtracts exactly those.

Snapshots turn into rows in pure functions (``task_rows``, ``worker_rows``, ``job_rows``);
rich, an extra (``pip install 'clusterwire[top]'``), is imported only to draw them. Every
string a server sent (names, addresses, errors) is drawn through
``clusterwire.terminal_text.printable`` as a rich ``Text``, never parsed as markup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from clusterwire import errors
from clusterwire.addressing import split_target
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.metrics import catalog
from clusterwire.metrics.snapshot import total
from clusterwire.protos.data_service_pb2 import DataRequest, DataServiceStatus, GetStatusRequest
from clusterwire.protos.service_pb2 import MetricSample, Request, TaskStatus
from clusterwire.rpc import RequestClient, parse_response, raise_for_status
from clusterwire.security import Security, load_security
from clusterwire.server_kind import (
    DISPATCHER,
    TASK,
    WORKER,
    first_failure,
    wrong_kind,
    wrong_kind_error,
)
from clusterwire.terminal_text import MAX_CHARS, printable
from clusterwire.transport import Frame

#: Servers one refresh asks (the target or the dispatcher among them), all at once.
MAX_SERVERS = 64
#: Jobs the jobs table shows.
MAX_JOBS = 100
#: Characters of a table cell (a name, an address).
CELL_CHARS = 128
_STATUS_REQUEST = Request(method="status").SerializeToString()
_DATA_STATUS_REQUEST = DataRequest(get_status=GetStatusRequest()).SerializeToString()

SERVING, DRAINING, UNREACHABLE = "serving", "draining", "unreachable"
_HEALTH_STYLE = {SERVING: "green", DRAINING: "yellow", UNREACHABLE: "bold red"}


# -- tasks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSnapshot:
    """One task's answer to one status request, or why there was none."""

    task: str  # "/job:worker/task:0"
    address: str
    at: float  # time.monotonic() when the answer arrived
    status: TaskStatus | None = None
    #: It answered that it is stopping (its drain refuses new requests).
    draining: bool = False
    error: str = ""
    #: The error's code (clusterwire.errors), when there was one.
    code: int = 0
    #: Bytes of this status request and of its response: the task counts them (received,
    #: sent) by its next answer.
    request_bytes: int = 0
    response_bytes: int = 0


@dataclass(frozen=True)
class TaskRow:
    """One line of the tasks table; a rate is None where there is nothing to compute it
    from (first frame, no answer, metrics off in the task)."""

    task: str
    address: str
    health: str  # SERVING, DRAINING or UNREACHABLE
    requests_per_s: float | None
    errors_per_s: float | None
    received_bytes_per_s: float | None
    sent_bytes_per_s: float | None
    in_flight: int | None
    store_bytes: int | None
    unreachable_peers: tuple[str, ...]
    error: str


@dataclass(frozen=True)
class _Counters:
    requests: float
    errors: float
    received: float
    sent: float


def _gauge(metrics: Sequence[MetricSample], name: str) -> float | None:
    """The sum of the samples named ``name``; None when the server sent none."""
    if not any(sample.name == name for sample in metrics):
        return None
    return total(metrics, name)


def _request_counters(status: TaskStatus) -> _Counters | None:
    """The listener's counters, or None when the task does not record them
    (``CLUSTERWIRE_METRICS=0``: then its shell reports no serving gauge either)."""
    metrics = status.metrics
    if _gauge(metrics, catalog.SERVING.name) is None:
        return None
    requests = total(metrics, catalog.REQUESTS.name)
    return _Counters(requests, requests - total(metrics, catalog.REQUESTS.name, code="OK"),
                     total(metrics, catalog.RECEIVED_BYTES.name),
                     total(metrics, catalog.SENT_BYTES.name))


def _task_rates(before: TaskSnapshot | None, after: TaskSnapshot
                ) -> tuple[float | None, float | None, float | None, float | None]:
    """Requests, errors, received and sent bytes per second between two answers, without
    ``before``'s own status request; Nones when there is no pair of counters, or a counter
    went down (the task restarted on its address)."""
    none = (None, None, None, None)
    if before is None or before.status is None or after.status is None:
        return none
    old, new = _request_counters(before.status), _request_counters(after.status)
    seconds = after.at - before.at
    if old is None or new is None or seconds <= 0:
        return none
    differences = (new.requests - old.requests - 1, new.errors - old.errors,
                   new.received - old.received - before.request_bytes,
                   new.sent - old.sent - before.response_bytes)
    if any(difference < 0 for difference in differences):
        return none
    requests, errors_, received, sent = (difference / seconds for difference in differences)
    return requests, errors_, received, sent


def task_rows(previous: Sequence[TaskSnapshot] | None,
              current: Sequence[TaskSnapshot]) -> list[TaskRow]:
    """The tasks table of ``current``, with rates against ``previous`` (the answers of the
    refresh before, matched by task and address)."""
    before = {(s.task, s.address): s for s in previous or ()}
    rows = []
    for snapshot in current:
        status = snapshot.status
        if status is None:
            rows.append(TaskRow(snapshot.task, snapshot.address,
                                DRAINING if snapshot.draining else UNREACHABLE,
                                None, None, None, None, None, None, (), snapshot.error))
            continue
        serving = _gauge(status.metrics, catalog.SERVING.name)
        in_flight = _gauge(status.metrics, catalog.IN_FLIGHT.name)
        store = _gauge(status.metrics, catalog.STORE_BYTES.name)
        peers = tuple(f"/job:{p.task.job}/task:{p.task.index}" if p.HasField("task")
                      else p.address for p in status.unreachable_peers)
        rows.append(TaskRow(
            snapshot.task, snapshot.address, DRAINING if serving == 0 else SERVING,
            *_task_rates(before.get((snapshot.task, snapshot.address)), snapshot),
            # The task counts this status request in flight while it answers it.
            None if in_flight is None else int(in_flight) - 1,
            None if store is None else int(store), peers, ""))
    return rows


class TaskPoller:
    """Asks the tasks of the cluster ``target`` reports on the first poll for their
    status, each directly at its address and all at once, within ``timeout`` seconds: the
    target's task and the first others in the cluster's order, ``MAX_SERVERS`` in all.

    The tasks stay those of that first answer: a later reply cannot send top to other
    addresses (each handshake a silent address holds lasts gRPC's connect timeout, past
    the request's deadline); ``version`` says when the target's membership moved on."""

    def __init__(self, target: str, timeout: float, security: Security | None = None):
        protocol, self._target_address = split_target(target)
        self.target = target
        self._timeout = timeout
        self._protocol = protocol
        self._security = security or load_security()
        self._client = RequestClient(protocol, timeout=timeout, security=self._security)
        self._pool = ThreadPoolExecutor(MAX_SERVERS, thread_name_prefix="clusterwire-top")
        self._own: str | None = None  # the target's task
        self._tasks: list[tuple[str, str]] = []  # (task, address) asked, in the cluster's order
        #: Tasks of the target's cluster, asked or not.
        self.listed = 0
        #: The target's membership version when top learnt its cluster, and in its last
        #: answer.
        self.learnt_version = self.version = 0

    def _ask(self, task: str, address: str) -> TaskSnapshot:
        # Sent as a frame, not through a Session: top needs the bytes of the request and
        # response, and to tell a task that answers it is stopping from one that is gone.
        try:
            frame = self._client.send_frame(address, Frame(_STATUS_REQUEST, ()), "status",
                                            self._timeout)
            at = time.monotonic()
            response = parse_response(frame)
            if response.status.code == errors.UNAVAILABLE:
                return TaskSnapshot(task, address, at, draining=True,
                                    error=response.status.message)
            raise_for_status(response)
        except errors.OpError as err:
            return TaskSnapshot(task, address, time.monotonic(),
                                error=f"{type(err).__name__}: {err.message}",
                                code=err.error_code)
        return TaskSnapshot(task, address, at, response.task_status,
                            request_bytes=len(_STATUS_REQUEST),
                            response_bytes=len(frame.header) + frame.payload_bytes)

    def _learn(self, status: TaskStatus) -> None:
        """Take the tasks to ask from the target's first status; ValueError or TypeError
        if its cluster is not a valid ClusterSpec."""
        cluster = ClusterSpec(status.cluster).task_addresses()
        own = f"/job:{status.task.job}/task:{status.task.index}"
        tasks = [(f"/job:{job}/task:{index}", address)
                 for (job, index), address in cluster.items()]
        if own not in {task for task, _ in tasks}:
            tasks.insert(0, (own, self._target_address))
        asked = {own, *[task for task, _ in tasks if task != own][:MAX_SERVERS - 1]}
        self.listed = len(tasks)
        self.learnt_version = self.version = status.membership_version
        self._own = own
        self._tasks = [(task, self._target_address if task == own else address)
                       for task, address in tasks if task in asked]

    def poll(self) -> list[TaskSnapshot]:
        """One answer (or failure) of every task asked, in the cluster's order. The first
        poll asks the target for its cluster first: UnavailableError if it does not
        answer, InternalError if its cluster is invalid, and ``server_kind.first_failure``'s
        error for refused credentials, another protocol or another kind of server."""
        if self._own is None:
            first = self._ask(self.target, self._target_address)
            if first.status is None:
                raise first_failure("top", first.code, f"The task at {self.target}",
                                    first.error, lambda: wrong_kind(
                                        self._protocol, self._target_address,
                                        self._security, self._timeout, TASK)) or (
                    errors.UnavailableError(
                        f"The task at {self.target} did not answer its status request: "
                        f"{first.error}. Is a task serving there? (--timeout gives it "
                        "longer.)"))
            try:
                self._learn(first.status)
            except (ValueError, TypeError) as err:
                raise errors.InternalError(
                    f"The task at {self.target} reported an invalid cluster: {err}") from None
            others = [(task, address) for task, address in self._tasks if task != self._own]
            answers = dict(zip(others, self._pool.map(lambda t: self._ask(*t), others),
                               strict=True))
            answers[self._own, self._target_address] = TaskSnapshot(
                self._own, self._target_address, first.at, first.status,
                request_bytes=first.request_bytes, response_bytes=first.response_bytes)
            return [answers[key] for key in self._tasks]
        snapshots = list(self._pool.map(lambda t: self._ask(*t), self._tasks))
        for snapshot in snapshots:
            if snapshot.task == self._own and snapshot.status is not None:
                self.version = snapshot.status.membership_version
        return snapshots

    def close(self) -> None:
        """Cancel requests in flight and release the connections."""
        self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


# -- the data service -----------------------------------------------------------------


@dataclass(frozen=True)
class DataServerSnapshot:
    """One data-service server's answer to one status request, or why there was none."""

    address: str
    at: float  # time.monotonic() when the answer arrived
    status: DataServiceStatus | None = None
    error: str = ""
    #: The error's code (clusterwire.errors), when there was one.
    code: int = 0


@dataclass(frozen=True)
class DataSnapshot:
    """The dispatcher's answer and those of every worker it listed (or that it listed
    last, when it did not answer)."""

    dispatcher: DataServerSnapshot
    workers: tuple[DataServerSnapshot, ...]


@dataclass(frozen=True)
class WorkerRow:
    """One line of the workers table; None where there is nothing to compute a value from."""

    address: str
    health: str
    heartbeat_age_seconds: float | None  # as the dispatcher says
    elements_per_s: float | None
    element_bytes_per_s: float | None
    buffered_elements: int | None
    #: Open streams (not yet handed out completely): what the worker's limit counts.
    streams: int | None
    requests_per_s: float | None
    errors_per_s: float | None
    error: str
    #: Finished streams the worker still keeps for their consumers' last reads.
    finished_streams: int | None = None


@dataclass(frozen=True)
class JobRow:
    """One line of the jobs table."""

    job_id: int
    name: str
    mode: str
    consumers: int
    splits_handed: int
    splits_completed: int
    finished: bool
    elements_per_s: float | None  # summed over the workers with a rate


def _recording(snapshot: DataServerSnapshot | None) -> bool:
    # As for tasks: a server recording no metrics reports no serving gauge.
    return (snapshot is not None and snapshot.status is not None
            and _gauge(snapshot.status.metrics, catalog.SERVING.name) is not None)


def _rate(before: DataServerSnapshot | None, after: DataServerSnapshot,
          counter: Callable[[Sequence[MetricSample]], float], own: int = 0) -> float | None:
    """A counter's increase per second between two answers of one server, less ``own``
    (what top's request of ``before`` added); None without two answers of a server that
    records metrics, or if the counter went down (the server restarted)."""
    if not (_recording(before) and _recording(after)):
        return None
    seconds = after.at - before.at
    difference = counter(after.status.metrics) - counter(before.status.metrics) - own
    return difference / seconds if seconds > 0 and difference >= 0 else None


def worker_rows(previous: DataSnapshot | None, current: DataSnapshot) -> list[WorkerRow]:
    """The workers table of ``current``, with rates against ``previous``."""
    before = {w.address: w for w in previous.workers} if previous is not None else {}
    dispatcher = current.dispatcher.status
    ages = {w.address: w.heartbeat_age_seconds for w in dispatcher.workers} if dispatcher else {}
    rows = []
    for snapshot in current.workers:
        age = ages.get(snapshot.address)
        status = snapshot.status
        if status is None:
            rows.append(WorkerRow(snapshot.address, UNREACHABLE, age, None, None, None, None,
                                  None, None, snapshot.error))
            continue
        old = before.get(snapshot.address)
        buffered = _gauge(status.metrics, catalog.DATA_BUFFERED.name)
        streams = _gauge(status.metrics, catalog.DATA_STREAMS.name)
        finished = _gauge(status.metrics, catalog.DATA_FINISHED_STREAMS.name)
        rows.append(WorkerRow(
            snapshot.address,
            DRAINING if _gauge(status.metrics, catalog.SERVING.name) == 0 else SERVING, age,
            _rate(old, snapshot, lambda m: total(m, catalog.DATA_ELEMENTS.name)),
            _rate(old, snapshot, lambda m: total(m, catalog.DATA_ELEMENT_BYTES.name)),
            None if buffered is None else int(buffered),
            None if streams is None else int(streams),
            _rate(old, snapshot, lambda m: total(m, catalog.REQUESTS.name), own=1),
            _rate(old, snapshot, lambda m: total(m, catalog.REQUESTS.name)
                  - total(m, catalog.REQUESTS.name, code="OK")), "",
            None if finished is None else int(finished)))
    return rows


def job_rows(previous: DataSnapshot | None, current: DataSnapshot) -> list[JobRow]:
    """The jobs table of ``current`` (the first ``MAX_JOBS`` its dispatcher reports; none
    if it did not answer), elements/s summed over the workers that answered both times."""
    if current.dispatcher.status is None:
        return []
    before = {w.address: w for w in previous.workers} if previous is not None else {}
    rows = []
    for job in current.dispatcher.status.jobs[:MAX_JOBS]:
        rates = [_rate(before.get(w.address), w,
                       lambda m, job_id=str(job.job_id): total(
                           m, catalog.DATA_ELEMENTS.name, job_id=job_id))
                 for w in current.workers]
        measured = [rate for rate in rates if rate is not None]
        rows.append(JobRow(job.job_id, job.job_name, job.processing_mode, job.num_consumers,
                           job.splits_handed, job.splits_completed, job.finished,
                           sum(measured) if measured else None))
    return rows


class DataPoller:
    """Asks the dispatcher at ``address`` for its status, then the workers it lists, all
    at once, each within ``timeout`` seconds, over the dispatcher's protocol: at most
    ``MAX_SERVERS`` - 1 worker addresses in all, the first listed (a reply cannot send top
    to other addresses on every refresh); one connection to each, kept. ``address`` may list
    a primary and its standbys (``HOST1:P1,HOST2:P2``): top shows the one that serves,
    asking the one that served last first."""

    def __init__(self, address: str, protocol: str, timeout: float,
                 security: Security | None = None):
        if "://" in address:
            from clusterwire.data.modes import parse_service

            protocol, address = parse_service(address)
        from clusterwire.data.addresses import dispatcher_addresses

        self.addresses = dispatcher_addresses(address)
        self.address, self.protocol = self.addresses[0], protocol
        self._timeout = timeout
        self._security = security or load_security()
        self._client = RequestClient(protocol, timeout=timeout, security=self._security)
        self._pool = ThreadPoolExecutor(MAX_SERVERS, thread_name_prefix="clusterwire-top")
        self._known: dict[str, None] = {}  # the worker addresses top asks, in order
        self._workers: list[str] = []  # asked, as the dispatcher last listed them
        self._answered = False  # the dispatcher, ever

    def _ask(self, address: str) -> DataServerSnapshot:
        from clusterwire.data.rpc import parse

        if "://" in address:
            return DataServerSnapshot(address, time.monotonic(), error=(
                f"not asked: listed with a protocol prefix; top asks the workers over "
                f"the dispatcher's, {self.protocol}"))
        try:
            frame = self._client.send_frame(address, Frame(_DATA_STATUS_REQUEST, []),
                                            "data.get_status", self._timeout,
                                            idempotent=True)
            status = parse(frame).status_report
        except errors.OpError as err:
            return DataServerSnapshot(address, time.monotonic(),
                                      error=f"{type(err).__name__}: {err.message}",
                                      code=err.error_code)
        return DataServerSnapshot(address, time.monotonic(), status)

    def _ask_dispatcher(self) -> DataServerSnapshot:
        """The answer of the listed dispatcher that serves (a standby answers that it
        stands by), the one that served last asked first; else the first one's error."""
        first = None
        for address in [self.address, *(a for a in self.addresses if a != self.address)]:
            answer = self._ask(address)
            if answer.status is not None:
                self.address = address
                return answer
            first = first or answer
        return first

    def poll(self) -> DataSnapshot:
        """The dispatcher's answer, then its workers'. The first poll raises
        UnavailableError if the dispatcher does not answer (``server_kind.first_failure``'s
        error when it says why); any poll InvalidArgumentError if a worker answers."""
        dispatcher = self._ask_dispatcher()
        if dispatcher.status is not None and dispatcher.status.kind == WORKER:
            raise wrong_kind_error(self.protocol, self.address, WORKER)
        if dispatcher.status is not None:
            listed = [w.address for w in dispatcher.status.workers]
            for worker in listed:
                if len(self._known) >= MAX_SERVERS - 1:
                    break
                self._known.setdefault(worker)
            self._workers = [worker for worker in listed if worker in self._known]
            self._answered = True
        elif not self._answered:
            server = f"The dispatcher at {self.address} ({self.protocol})"
            raise first_failure(
                "top", dispatcher.code, server, dispatcher.error,
                lambda: wrong_kind(self.protocol, self.address, self._security, self._timeout,
                                   DISPATCHER)) or errors.UnavailableError(
                f"{server} did not answer its status request: {dispatcher.error}. Is it "
                "serving there, over this --protocol? (--timeout gives it longer.)")
        return DataSnapshot(dispatcher, tuple(self._pool.map(self._ask, self._workers)))

    def close(self) -> None:
        """Cancel requests in flight and release the connections."""
        self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


# -- drawing ---------------------------------------------------------------------------


def format_rate(value: float | None) -> str:
    """A per-second rate with one decimal; "-" when there is none."""
    return "-" if value is None else f"{value:.1f}"


def format_bytes(value: float | None, suffix: str = "") -> str:
    """Bytes in binary units (B, KiB, MiB, GiB, TiB); "-" when there are none."""
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}{suffix}" if unit == "B" else f"{value:.1f} {unit}{suffix}"
        value /= 1024
    return f"{value:.1f} TiB{suffix}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _health(health: str) -> Any:
    from rich.text import Text

    return Text(health, style=_HEALTH_STYLE[health])


def _text(value: object, limit: int = CELL_CHARS, style: str = "") -> Any:
    """Text a server sent (or one quoting it), as rich draws it: ``printable``, and a
    ``Text``, which rich never parses as markup."""
    from rich.text import Text

    return Text(printable(value, limit), style=style)


def _caption(failures: Sequence[tuple[str, str]]) -> Any:
    """The lines saying why each server did not answer; None if all did."""
    from rich.text import Text

    if not failures:
        return None
    return Text("\n").join(_text(f"{who}: {error}", MAX_CHARS) for who, error in failures)


def task_table(rows: Sequence[TaskRow], title: str) -> Any:
    """The rich Table of ``rows``; why a task did not answer is in the caption."""
    from rich.table import Table

    table = Table(title=_text(title, MAX_CHARS), title_justify="left", caption_justify="left")
    for name in ("TASK", "ADDRESS", "HEALTH"):
        table.add_column(name, no_wrap=True)
    for name in ("REQ/S", "ERR/S", "IN/S", "OUT/S", "IN FLIGHT", "STORE"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("UNREACHABLE PEERS")
    for row in rows:
        table.add_row(_text(row.task), _text(row.address), _health(row.health),
                      format_rate(row.requests_per_s), format_rate(row.errors_per_s),
                      format_bytes(row.received_bytes_per_s, "/s"),
                      format_bytes(row.sent_bytes_per_s, "/s"), _count(row.in_flight),
                      format_bytes(row.store_bytes),
                      _text(", ".join(row.unreachable_peers) or "-", MAX_CHARS))
    table.caption = _caption([(row.task, row.error) for row in rows if row.error])
    return table


def worker_table(rows: Sequence[WorkerRow], title: str) -> Any:
    """The rich Table of the workers; why one did not answer is in the caption."""
    from rich.table import Table

    table = Table(title=_text(title, MAX_CHARS), title_justify="left", caption_justify="left")
    for name in ("WORKER", "HEALTH"):
        table.add_column(name, no_wrap=True)
    for name in ("HEARTBEAT AGE", "ELEMENTS/S", "BYTES/S", "BUFFERED", "OPEN STREAMS",
                 "FINISHED STREAMS", "REQ/S", "ERR/S"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in rows:
        age = row.heartbeat_age_seconds
        table.add_row(_text(row.address), _health(row.health),
                      "-" if age is None else f"{age:.1f} s",
                      format_rate(row.elements_per_s),
                      format_bytes(row.element_bytes_per_s, "/s"),
                      _count(row.buffered_elements), _count(row.streams),
                      _count(row.finished_streams),
                      format_rate(row.requests_per_s), format_rate(row.errors_per_s))
    table.caption = _caption([(row.address, row.error) for row in rows if row.error])
    return table


def job_table(rows: Sequence[JobRow], listed: int | None = None) -> Any:
    """The rich Table of the jobs; ``listed``: how many the dispatcher listed, when
    ``rows`` are fewer."""
    from rich.table import Table

    title = "jobs" if listed is None else f"jobs: the first {len(rows)} of {listed}"
    table = Table(title=title, title_justify="left")
    for name in ("JOB", "NAME", "MODE", "STATE"):
        table.add_column(name, no_wrap=True)
    for name in ("CONSUMERS", "SPLITS HANDED", "SPLITS DONE", "ELEMENTS/S"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(str(row.job_id), _text(row.name or "-"), _text(row.mode),
                      "finished" if row.finished else "running", str(row.consumers),
                      str(row.splits_handed), str(row.splits_completed),
                      format_rate(row.elements_per_s))
    return table


# -- the command -----------------------------------------------------------------------

S = TypeVar("S")


@dataclass
class View(Generic[S]):
    """What ``run`` refreshes: ``poll`` takes a snapshot, ``render`` draws one against the
    one before (None on the first frame), ``healthy`` says whether every server answered."""

    poll: Callable[[], S]
    render: Callable[[S | None, S], Any]
    healthy: Callable[[S], bool]
    close: Callable[[], None]


def task_view(target: str, interval: float, timeout: float,
              security: Security | None = None) -> View[list[TaskSnapshot]]:
    """The tasks of ``target``'s cluster."""
    poller = TaskPoller(target, timeout, security)

    def render(previous: list[TaskSnapshot] | None, current: list[TaskSnapshot]) -> Any:
        rows = task_rows(previous, current)
        serving = sum(row.health == SERVING for row in rows)
        bounded = (f" (top asks {len(rows)} of the cluster's {poller.listed})"
                   if poller.listed > len(rows) else "")
        changed = (f"; the cluster changed since top started (membership version "
                   f"{poller.learnt_version} -> {poller.version}): restart top to follow it"
                   if poller.version != poller.learnt_version else "")
        return task_table(rows, f"clusterwire top {target}: {serving} of {len(rows)} tasks "
                                f"serving{bounded}, every {interval:g} s, "
                                f"{time.strftime('%H:%M:%S')}{changed}")

    return View(poller.poll, render,
                lambda snapshots: all(s.status is not None for s in snapshots), poller.close)


def data_view(address: str, protocol: str, interval: float, timeout: float,
              security: Security | None = None) -> View[DataSnapshot]:
    """The data service of the dispatcher at ``address``: its workers and jobs."""
    from rich.console import Group

    poller = DataPoller(address, protocol, timeout, security)

    def render(previous: DataSnapshot | None, current: DataSnapshot) -> Any:
        status = current.dispatcher.status
        asked = len(current.workers)
        serving = f" (serving: {poller.address})" if len(poller.addresses) > 1 else ""
        heading = (f"clusterwire top --dispatcher {address}{serving}: "
                   + (f"{len(status.workers)} workers"
                      + (f" (top asks {asked})" if len(status.workers) > asked else "")
                      + f", {len(status.jobs)} jobs"
                      if status is not None else "the dispatcher is unreachable")
                   + f", every {interval:g} s, {time.strftime('%H:%M:%S')}")
        parts: list[Any] = [worker_table(worker_rows(previous, current), heading)]
        if status is None:
            parts.insert(0, _text(f"dispatcher {address}: {current.dispatcher.error}",
                                  MAX_CHARS, _HEALTH_STYLE[UNREACHABLE]))
        jobs = job_rows(previous, current)
        listed = len(status.jobs) if status is not None else 0
        parts.append(job_table(jobs, listed if listed > len(jobs) else None))
        return Group(*parts)

    return View(poller.poll, render,
                lambda snapshot: snapshot.dispatcher.status is not None
                and all(w.status is not None for w in snapshot.workers), poller.close)


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.monotonic()))


def _print_unwrapped(console: Any, renderable: Any) -> None:
    """Print in full: a pipe gets the table's own width, not a terminal's 80 columns."""
    from rich.measure import Measurement

    if not console.is_terminal:
        console.width = max(console.width,
                            Measurement.get(console, console.options.update(width=10_000),
                                            renderable).maximum)
    console.print(renderable)


def run(view: View[Any], interval: float, once: bool, console: Any = None) -> int:
    """Refresh ``view`` every ``interval`` seconds until Ctrl-C (then 0). ``once``: print
    one frame, after two snapshots ``interval`` apart, and return 0 if every server
    answered the second, else 1 (130 if Ctrl-C cuts it short)."""
    from rich.console import Console
    from rich.live import Live

    # Markup off: what a server sent is drawn as Text anyway; this keeps a string that
    # slips through from styling the screen or raising a MarkupError.
    console = console or Console(markup=False, emoji=False)
    try:
        started = time.monotonic()
        current = view.poll()
        if once:
            _sleep_until(started + interval)
            previous, current = current, view.poll()
            _print_unwrapped(console, view.render(previous, current))
            return 0 if view.healthy(current) else 1
        with Live(view.render(None, current), console=console, auto_refresh=False) as live:
            while True:
                _sleep_until(started + interval)
                started = time.monotonic()
                previous, current = current, view.poll()
                live.update(view.render(previous, current), refresh=True)
    except KeyboardInterrupt:
        return 130 if once else 0  # Ctrl-C is how a live view ends; it cuts a --once short
    finally:
        view.close()
