"""``clusterwire status``'s human summary: a task's status (``Session.status``) in a few
lines, or one line per task of ``Session.cluster_status``. Every string a server sent goes
through ``clusterwire.terminal_text.printable``; ``status --json`` prints the whole status."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from clusterwire.durations import format_duration
from clusterwire.metrics import catalog
from clusterwire.terminal_text import printable
from clusterwire.top import format_bytes


def _metric(status: Mapping[str, Any], name: str, **labels: str) -> float | None:
    """The sum of the samples named ``name`` (with ``labels``); None when there are none."""
    values = [m["value"] for m in status["metrics"] if m["name"] == name
              and all(m["labels"].get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def state(status: Mapping[str, Any]) -> str:
    """"serving", or "draining" when its serving gauge says it is stopping; and for how
    long it has served, by its start time (``clusterwire_start_time_seconds``) and this
    machine's clock."""
    serving = "draining" if _metric(status, catalog.SERVING.name) == 0 else "serving"
    started = _metric(status, catalog.START_TIME.name)
    if started is None:
        return serving
    return f"{serving}, up {format_duration(max(time.time() - started, 0.0))}"


def _requests(status: Mapping[str, Any]) -> str:
    """Requests served and failed, and in flight but this status request; "metrics off"
    when the task records none (``CLUSTERWIRE_METRICS=0``)."""
    if _metric(status, catalog.SERVING.name) is None:
        return "metrics off"
    served = _metric(status, catalog.REQUESTS.name) or 0
    failed = served - (_metric(status, catalog.REQUESTS.name, code="OK") or 0)
    in_flight = (_metric(status, catalog.IN_FLIGHT.name) or 1) - 1
    return f"{served:.0f} requests, {failed:.0f} failed, {in_flight:.0f} in flight"


def _membership(status: Mapping[str, Any]) -> str:
    cluster = status["cluster"]
    counts = {job: cluster.num_tasks(job) for job in cluster.jobs}
    jobs = ", ".join(f"{printable(job)}: {count}" for job, count in counts.items())
    return f"version {status['membership_version']}, {sum(counts.values())} tasks ({jobs})"


def summary(status: Mapping[str, Any]) -> list[str]:
    """The lines of one task's summary."""
    lines = [
        f"task        /job:{printable(status['job'])}/task:{status['task_index']}",
        f"address     {printable(status['target'])}",
        f"state       {state(status)}",
        f"protocol    {printable(status['protocol'])} (clusterwire "
        f"{printable(status['version'])}, {status['cpu_count']} CPUs, "
        f"{len(status['devices'])} devices)",
        f"membership  {_membership(status)}",
        f"requests    {_requests(status)}",
    ]
    stored = _metric(status, catalog.STORE_TENSORS.name)
    if stored is not None:
        lines.append(f"store       {stored:.0f} tensors, "
                     f"{format_bytes(_metric(status, catalog.STORE_BYTES.name) or 0)}")
    down = [p for p in status["peers"] if p["down"]]
    if down:
        lines.append("peers down  " + ", ".join(
            f"{printable(p['task'])} at {printable(p['address'])}" for p in down))
    lines += [f"unreachable {printable(p['task'])} at {printable(p['address'])}: "
              f"{printable(p['error'])}" for p in status["unreachable_peers"]]
    return lines


def task_line(task: str, status: Mapping[str, Any]) -> str:
    """One task of ``status --all``: its address, state, membership and requests, or which
    task did not answer, at which address, and why."""
    if "error" in status:
        return (f"task {printable(task)} at {printable(status.get('address', '?'))} did not "
                f"answer: {printable(status['error'])}")
    return (f"{printable(task)}  {printable(status['target'])}  {state(status)}  "
            f"membership {_membership(status)}  {_requests(status)}")
