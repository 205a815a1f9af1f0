"""A hostile clusterwire server in its own process, for the tests of what operator tools print.

``python cw_hostile_server.py task|dispatcher|invalid|stalling LISTED_FILE ROTATE`` listens
over grpc on two ports of 127.0.0.1 and prints ``CLUSTERWIRE_READY <address>`` (the one to point a
tool at); then it answers until stdin closes or SIGTERM:

* at the first address, every status request (a task's ``status`` or a dispatcher's
  ``get_status``) with a reply made against the operator's terminal: ``HOSTILE`` in every
  name and message, an address whose host is ``HOSTILE``, ``HUGE`` in an error, and the
  addresses of LISTED_FILE (a JSON list) as more tasks of its cluster or more workers (all
  of them; with ROTATE > 0, the next ROTATE of them in each reply, a task's under the
  next membership version; a dispatcher also lists ``PREFIXED``);
  a ``status`` for another task (``status --all``) fails with ``HOSTILE`` as its message;
  ``invalid`` answers as ``task`` with ``HOSTILE`` as a job name of its cluster;
  ``stalling`` answers as ``task`` but never answers a ``status`` for another task (it
  holds the request until the server stops), as a target that stalls every forward;
* at the second address (listed as a task or a worker too), every request with an
  UNAVAILABLE error whose message is ``HOSTILE``.
"""

from __future__ import annotations

import itertools
import json
import signal
import sys
import threading

from clusterwire import errors
from clusterwire.plugins import get_plugin_manager
from clusterwire.protos.cluster_pb2 import ClusterDef, JobDef
from clusterwire.protos.data_service_pb2 import (
    DataResponse,
    DataServiceStatus,
    JobSummary,
    WorkerSummary,
)
from clusterwire.protos.service_pb2 import (
    DeviceInfo,
    MetricSample,
    Request,
    Response,
    Status,
    TaskRef,
    TaskStatus,
    UnreachablePeer,
)
from clusterwire.ready_line import say_ready
from clusterwire.testing.child import stop_on_stdin_close
from clusterwire.transport import Frame, ListenOptions

#: Window title (OSC 0), clear screen (CSI 2J), a link (OSC 8), rich markup, a bidi
#: override, NUL, a C1 CSI and DEL: no ':' in it, so it can be an address's host.
HOSTILE = ("\x1b]0;pwned\x07\x1b[2J\x1b]8;;evil.example/x\x07link\x1b]8;;\x07"
           "[/pwned][bold]x\u202eevil\u202c\x00\x9b31m\x7f")
HUGE = "H" * 1_000_000
#: A worker address naming another transport than the dispatcher's.
PREFIXED = "grpc+local:///tmp/cw-hostile.sock"


def task_reply(own: str, failing: str, listed: list[str], version: int,
               job: str = "worker") -> Response:
    cluster = ClusterDef(job=[JobDef(name=job, tasks={
        0: own, 1: f"{HOSTILE}:1", 2: failing,
        **{3 + i: address for i, address in enumerate(listed)}})])
    return Response(task_status=TaskStatus(
        task=TaskRef(job=HOSTILE, index=0), cluster=cluster, protocol=HOSTILE,
        target=HOSTILE, version=HOSTILE, devices=[DeviceInfo(name=HOSTILE, device_type=HOSTILE)],
        transport_info={HOSTILE: HOSTILE},
        metrics=[MetricSample(name="clusterwire_serving", labels={"server": HOSTILE}, value=1),
                 MetricSample(name="clusterwire_requests_in_flight", value=1)],
        unreachable_peers=[UnreachablePeer(task=TaskRef(job=HOSTILE, index=7),
                                           address=f"{HOSTILE}:2", error=HOSTILE + HUGE)],
        membership_version=version))


def dispatcher_reply(failing: str, listed: list[str]) -> DataResponse:
    workers = [f"{HOSTILE}:1", failing, PREFIXED, *listed]
    return DataResponse(status_report=DataServiceStatus(
        kind="dispatcher", address=HOSTILE, protocol=HOSTILE, version=HOSTILE,
        workers=[WorkerSummary(address=address, heartbeat_age_seconds=1.0)
                 for address in workers],
        jobs=[JobSummary(job_id=1, job_name=HOSTILE, processing_mode=HOSTILE),
              JobSummary(job_id=2, job_name="[/pwned]", processing_mode="parallel_epochs"),
              JobSummary(job_id=3, job_name="[bold]x", processing_mode="parallel_epochs"),
              JobSummary(job_id=4, job_name=HUGE, processing_mode="parallel_epochs")],
        metrics=[MetricSample(name="clusterwire_serving", labels={"server": HOSTILE},
                              value=1)]))


def main(argv: list[str]) -> int:
    kind, listed_file, rotate = argv[0], argv[1], int(argv[2])
    with open(listed_file, encoding="utf-8") as handle:
        addresses = json.load(handle)
    replies = itertools.count()

    def listed() -> tuple[list[str], int]:
        """The addresses a reply lists, and its membership version."""
        if not rotate:
            return addresses, 0
        reply = next(replies)
        start = reply * rotate % len(addresses)
        return addresses[start:start + rotate], reply
    transport = get_plugin_manager().transport("grpc")
    refused = Status(code=errors.UNAVAILABLE, message=HOSTILE)
    failing = transport.listen("127.0.0.1:0", lambda frame: Frame(
        (DataResponse(status=refused) if kind == "dispatcher" else Response(status=refused))
        .SerializeToString(), []), ListenOptions())
    failing.start()
    own: list[str] = []

    def answer(frame: Frame) -> Frame:
        if kind == "dispatcher":
            return Frame(dispatcher_reply(failing.address, listed()[0]).SerializeToString(), [])
        request = Request.FromString(bytes(frame.header))
        if request.HasField("task"):
            if kind == "stalling":
                stop.wait()
            reply = Response(status=Status(code=errors.INTERNAL, message=HOSTILE))
        else:
            reply = task_reply(own[0], failing.address, *listed(),
                               job=HOSTILE if kind == "invalid" else "worker")
        return Frame(reply.SerializeToString(), [])

    stop = threading.Event()
    listener = transport.listen("127.0.0.1:0", answer, ListenOptions())
    listener.start()
    own.append(listener.address)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop_on_stdin_close(stop)
    say_ready(listener.address)
    stop.wait()
    listener.stop(0)
    failing.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
