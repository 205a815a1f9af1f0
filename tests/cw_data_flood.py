"""A token holder flooding a dispatcher with new jobs or new datasets, as a process of its own.

``python cw_data_flood.py jobs|datasets ADDRESS SECONDS``: 4 threads create anonymous jobs
(never read) of one dataset, or register distinct tiny datasets (never used), as fast as the
dispatcher answers, for SECONDS or until stdin closes. It prints ``FULL`` once it has made
as many as the dispatcher's limit (its table is full of them from then on) and, at the end,
a JSON line ``{"created": N, "refused": M}``.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading

from clusterwire import data, errors
from clusterwire.data import graph
from clusterwire.data.quotas import ServiceLimits
from clusterwire.data.rpc import DispatcherClient
from clusterwire.protos.data_service_pb2 import (
    DataRequest,
    GetOrCreateJobRequest,
    RegisterDatasetRequest,
)
from clusterwire.security import Security
from clusterwire.testing.child import run_threads

_THREADS = 4


def main(kind: str, address: str, seconds: float) -> None:
    client = DispatcherClient("grpc", address, 10.0, Security())
    counts = {"created": 0, "refused": 0}
    lock = threading.Lock()
    serial = itertools.count()
    limit = ServiceLimits().max_jobs if kind == "jobs" else ServiceLimits().max_datasets
    dataset_id = ""
    if kind == "jobs":
        definition, buffers = graph.to_def(data.Dataset.range(10).pipeline)
        response, _ = client.call(DataRequest(register_dataset=RegisterDatasetRequest(
            dataset=definition)), buffers)
        dataset_id = response.register_dataset.dataset_id

    def request(n: int) -> tuple[DataRequest, list]:
        if kind == "jobs":
            return DataRequest(get_or_create_job=GetOrCreateJobRequest(
                dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
                job_key=f"flood/{n}", consumer_id=f"flood-{n}")), []
        definition, buffers = graph.to_def(data.Dataset.range(n + 1).pipeline)
        return DataRequest(register_dataset=RegisterDatasetRequest(dataset=definition)), buffers

    def flood(stop: threading.Event) -> None:
        while not stop.is_set():
            n = next(serial)
            try:
                client.call(*request(n))
                key = "created"
            except errors.ResourceExhaustedError:
                key = "refused"
            with lock:
                counts[key] += 1
                if key == "created" and counts["created"] == limit:
                    print("FULL", flush=True)

    run_threads(flood, _THREADS, seconds)
    client.close()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
