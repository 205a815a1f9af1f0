"""Every metric clusterwire exports: the one table of names, kinds, labels and meanings.

The README's metrics table is generated from it (``python -m clusterwire.metrics``) and a
test keeps the two equal. Names follow Prometheus' conventions: the ``clusterwire_``
prefix, base units (seconds, bytes) in the name, ``_total`` on counters, and label sets
bounded by the deployment (server names, request methods, status codes, job ids), never by
what a client sends (a tensor name or a client address).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Request latencies: from 50 us (an in-process get) to 10 s (a long barrier or poll).
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Waits that are normally long (a barrier, a training loop waiting for data).
WAIT_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Metric:
    """One exported metric."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    labels: tuple[str, ...]
    help: str
    #: Which processes export it: "every server", "task", "dispatcher", "worker", "consumer".
    source: str
    buckets: tuple[float, ...] = ()


def _metric(name: str, kind: str, labels: tuple[str, ...], source: str, help: str,
            buckets: tuple[float, ...] = ()) -> Metric:
    return Metric(name, kind, labels, help, source, buckets)


# -- every server (task, dispatcher, worker): recorded by the listener shell -------------
REQUESTS = _metric(
    "clusterwire_requests_total", "counter", ("server", "method", "code"), "every server",
    "Requests served, by method and status code (OK, NOT_FOUND, ...); refusals by admission "
    "(RESOURCE_EXHAUSTED) and drain (UNAVAILABLE) included.")
REQUEST_SECONDS = _metric(
    "clusterwire_request_duration_seconds", "histogram", ("server", "method"), "every server",
    "Time from a request reaching the server's shell through its transport to its response "
    "being ready (requests of callers in the same process are counted, not timed).",
    LATENCY_BUCKETS)
RECEIVED_BYTES = _metric(
    "clusterwire_received_bytes_total", "counter", ("server", "transport"), "every server",
    "Request bytes received through the transport: header and tensor buffers.")
SENT_BYTES = _metric(
    "clusterwire_sent_bytes_total", "counter", ("server", "transport"), "every server",
    "Response bytes sent through the transport: header and tensor buffers.")
IN_FLIGHT = _metric(
    "clusterwire_requests_in_flight", "gauge", ("server",), "every server",
    "Requests being served now (max_concurrent_calls bounds it).")
CONNECTIONS = _metric(
    "clusterwire_connections", "gauge", ("server", "transport"), "every server",
    "Authenticated client connections held now, where the transport counts them "
    "(grpc+local, grpc+verbs, zmq; grpc's are not visible to Python).")
SERVING = _metric(
    "clusterwire_serving", "gauge", ("server",), "every server",
    "1 while the server accepts work, 0 from the moment it drains.")
START_TIME = _metric(
    "clusterwire_start_time_seconds", "gauge", ("server",), "every server",
    "When the server started listening, in Unix seconds by its clock (its uptime is the time "
    "since).")

# -- task servers -------------------------------------------------------------------------
STORE_BYTES = _metric(
    "clusterwire_store_bytes", "gauge", ("server",), "task",
    "Bytes of tensors in the task's store (max_store_bytes bounds it).")
STORE_TENSORS = _metric(
    "clusterwire_store_tensors", "gauge", ("server",), "task",
    "Tensors in the task's store.")
FORWARDED = _metric(
    "clusterwire_forwarded_requests_total", "counter", ("server", "method"), "task",
    "Requests for another task that this task forwarded to it.")
BARRIER_WAITS = _metric(
    "clusterwire_barrier_wait_seconds", "histogram", ("server",), "task",
    "Time callers of this task waited in barriers (its count: the barrier waits).",
    WAIT_BUCKETS)
PEER_FAILURES = _metric(
    "clusterwire_peer_failures_total", "counter", ("server",), "task",
    "Attempts to reach a peer task that found it unreachable.")
UNREACHABLE_PEERS = _metric(
    "clusterwire_unreachable_peers", "gauge", ("server",), "task",
    "Peer tasks this task could not reach within the last minute and has not reached since "
    "(status() names them).")

# -- data service: dispatcher ---------------------------------------------------------------
DATA_WORKERS = _metric(
    "clusterwire_data_workers", "gauge", ("server",), "dispatcher",
    "Workers registered with the dispatcher and not timed out.")
DATA_HEARTBEATS = _metric(
    "clusterwire_data_worker_heartbeats_total", "counter", ("server",), "dispatcher",
    "Worker heartbeats received.")
DATA_JOBS = _metric(
    "clusterwire_data_jobs", "gauge", ("server",), "dispatcher",
    "Jobs the dispatcher holds (not yet collected).")
DATA_SPLITS_HANDED = _metric(
    "clusterwire_data_splits_handed_total", "counter", ("server", "job_id"), "dispatcher",
    "Splits of a distributed_epoch job handed to consumers (split progress).")
DATA_SPLITS_DONE = _metric(
    "clusterwire_data_splits_completed_total", "counter", ("server", "job_id"), "dispatcher",
    "Splits of a distributed_epoch job read to their end.")
DATA_JOURNAL_BYTES = _metric(
    "clusterwire_data_journal_bytes", "gauge", ("server",), "dispatcher",
    "Size of the fault-tolerant dispatcher's journal on disk (0 without fault_tolerant_mode).")

# -- data service: worker -----------------------------------------------------------------
DATA_ELEMENTS = _metric(
    "clusterwire_data_elements_total", "counter", ("server", "job_id"), "worker",
    "Elements the worker sent to consumers, by job id.")
DATA_ELEMENT_BYTES = _metric(
    "clusterwire_data_element_bytes_total", "counter", ("server", "job_id"), "worker",
    "Bytes of elements the worker sent to consumers, by job id.")
DATA_BUFFERED = _metric(
    "clusterwire_data_buffered_elements", "gauge", ("server",), "worker",
    "Elements produced and waiting for their consumers (the worker's queue depth).")
DATA_STREAMS = _metric(
    "clusterwire_data_streams", "gauge", ("server",), "worker",
    "Element streams (a job's pipeline on this worker) open now: not yet produced and handed "
    "out completely; what the worker's limit of open streams counts (README: Reliability).")
DATA_FINISHED_STREAMS = _metric(
    "clusterwire_data_finished_streams", "gauge", ("server",), "worker",
    "Finished element streams (produced and handed out completely) the worker still keeps for "
    "their consumers' last reads; not counted against its limit of open streams.")

# -- data service: the training process -------------------------------------------------
DATA_CONSUMER_WAIT = _metric(
    "clusterwire_data_consumer_wait_seconds", "histogram", (), "consumer",
    "Time the training loop waited for its next element (stalled on data); its count is the "
    "elements read.", WAIT_BUCKETS)

CATALOG: tuple[Metric, ...] = (
    REQUESTS, REQUEST_SECONDS, RECEIVED_BYTES, SENT_BYTES, IN_FLIGHT, CONNECTIONS, SERVING,
    START_TIME, STORE_BYTES, STORE_TENSORS, FORWARDED, BARRIER_WAITS, PEER_FAILURES,
    UNREACHABLE_PEERS,
    DATA_WORKERS, DATA_HEARTBEATS, DATA_JOBS, DATA_SPLITS_HANDED, DATA_SPLITS_DONE,
    DATA_JOURNAL_BYTES, DATA_ELEMENTS, DATA_ELEMENT_BYTES, DATA_BUFFERED, DATA_STREAMS,
    DATA_FINISHED_STREAMS, DATA_CONSUMER_WAIT,
)


def markdown_table() -> str:
    """The README's table of every metric."""
    rows = ["| Metric | Type | Labels | Exported by | Meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{m.name}` | {m.kind} | {', '.join(m.labels) or '-'} | {m.source} | "
             f"{m.help} |" for m in CATALOG]
    return "\n".join(rows)
