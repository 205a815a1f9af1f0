"""What kind of clusterwire server answers at an address, for the tools that found the other
kind there (``clusterwire status``/``top`` at a data-service server, ``top --dispatcher`` at
a task or a worker): one place for how it is asked and what the tool then says.

A task serves the cluster service (``Request``), a dispatcher and a worker the data service
(``DataRequest``); each answers the other's request with an error of its own, which says
nothing of what it is. ``identify`` asks both status requests.
"""

from __future__ import annotations

from collections.abc import Callable

from clusterwire import errors
from clusterwire.protos.data_service_pb2 import DataRequest, GetStatusRequest
from clusterwire.protos.service_pb2 import Request
from clusterwire.rpc import RequestClient, parse_response, raise_for_status
from clusterwire.security import Security
from clusterwire.transport import Frame
from clusterwire.wrong_protocol import is_wrong_protocol

TASK, DISPATCHER, WORKER = "task", "dispatcher", "worker"
#: Error codes a server answers a request of the other service with.
OTHER_SERVICE_CODES = frozenset(
    {errors.INVALID_ARGUMENT, errors.UNIMPLEMENTED, errors.DATA_LOSS, errors.INTERNAL})
_TASK_STATUS = Request(method="status").SerializeToString()
_DATA_STATUS = DataRequest(get_status=GetStatusRequest()).SerializeToString()


def identify(client: RequestClient, address: str, timeout: float) -> tuple[str, str] | None:
    """``(kind, name)`` of the server at ``address``: (TASK, "/job:ps/task:0"),
    (DISPATCHER, "") or (WORKER, ""); None if it answers neither status request."""
    from clusterwire.data.rpc import parse

    try:
        frame = client.send_frame(address, Frame(_DATA_STATUS, []), "data.get_status",
                                  timeout, idempotent=True, retry=False)
        kind = parse(frame).status_report.kind
        if kind in (DISPATCHER, WORKER):
            return kind, ""
    except errors.OpError:
        pass
    try:
        frame = client.send_frame(address, Frame(_TASK_STATUS, []), "status", timeout,
                                  retry=False)
        response = parse_response(frame)
        raise_for_status(response)
    except errors.OpError:
        return None
    task = response.task_status.task
    return TASK, f"/job:{task.job}/task:{task.index}"


def _what(kind: str, name: str) -> str:
    return {TASK: f"a clusterwire task ({name})", DISPATCHER: "a tf.data service dispatcher",
            WORKER: "a tf.data service worker"}[kind]


def wrong_kind(protocol: str, address: str, security: Security, timeout: float,
               wanted: str) -> errors.InvalidArgumentError | None:
    """The error for a tool that wanted a ``wanted`` server (TASK or DISPATCHER) at
    ``address`` and got an error from it: what serves there instead and the command that
    shows it; None if that is not known (no answer, or it is a ``wanted`` server)."""
    client = RequestClient(protocol, timeout=timeout, security=security)
    try:
        found = identify(client, address, timeout)
    finally:
        client.close()
    if found is None or found[0] == wanted:
        return None
    return wrong_kind_error(protocol, address, found[0], found[1])


def wrong_kind_error(protocol: str, address: str, kind: str,
                     name: str = "") -> errors.InvalidArgumentError:
    """The error naming ``kind`` (``name``: a task's) found at ``address`` and the command
    for it."""
    fix = {TASK: f"use `clusterwire status {protocol}://{address}` or `clusterwire top "
                 f"{protocol}://{address}`",
           DISPATCHER: f"use `clusterwire top --dispatcher {address}"
                       + (f" --protocol {protocol}`" if protocol != "grpc" else "`"),
           WORKER: "use `clusterwire top --dispatcher HOST:PORT` with its dispatcher's "
                   "address"}[kind]
    return errors.InvalidArgumentError(
        f"{protocol}://{address} is {_what(kind, name)}: {fix}.")


def first_failure(tool: str, code: int, server: str, error: str,
                  found_there: Callable[[], errors.OpError | None]) -> errors.OpError | None:
    """What ``tool`` says when its first request to ``server`` failed with ``code``
    (``error``: that failure as text), when it knows better than the failure itself: an
    authentication failure as one (the tool's security flags fix it), a refusal that names
    its fix (a listener of another protocol, a grpc+local task of another host) as it is, a
    request of the other service as what serves there instead (``found_there``); else
    None."""
    if code in (errors.UNAUTHENTICATED, errors.PERMISSION_DENIED):
        return errors.error_from_code(code, (
            f"{server} refused {tool}'s credentials: {error}. Give {tool} the cluster's: "
            "--auth-token-file, --tls-ca-file (and --tls-cert-file/--tls-key-file for "
            "mutual TLS)."))
    message = error.partition(": ")[2]
    if code == errors.FAILED_PRECONDITION or is_wrong_protocol(message):
        return errors.error_from_code(code, f"{server}: {message}")
    return found_there() if code in OTHER_SERVICE_CODES else None
