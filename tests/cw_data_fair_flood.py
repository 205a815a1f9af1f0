"""A token holder on another host flooding the data service with entries it *uses*, as a process.

``python cw_data_fair_flood.py jobs|datasets|streams|caches DISPATCHER SECONDS``. Every connection
it makes comes from 127.0.0.2 (through ``Relay``), as from another host: the servers count
its entries in that peer's share. 4 threads, as fast as the servers answer, for SECONDS or
until stdin closes:

* ``jobs``: create anonymous jobs of one dataset and read each (a client heartbeat);
* ``datasets``: register distinct tiny datasets, and create and read a job on each;
* ``streams``: open streams on the worker, each of a new anonymous job (so a new consumer
  id) of an infinite dataset, and read every one again and again;
* ``caches``: open the worker's cross-trainer caches, each of a new named job of an infinite
  dataset read with a trainer id, and read every one again and again.

When the servers refuse a new entry, the thread reads one of its entries instead (round the
flooder's entries). It prints ``FULL <entries it holds>`` at the first refusal: the table
(ServiceLimits' max_jobs, max_datasets, the worker's max_open_streams or its cache slots) is
full and it holds its share.
At the end it reads every entry it holds once more and prints a JSON line of counts:
``created``, ``refused`` (ResourceExhaustedError of a new entry, by the fair-share rule),
``displaced`` (an entry read after it was displaced: the error said so), ``held`` (entries
still read at the end), ``other`` (any other error, or a refusal not by the rule: a list of
up to 5 of them).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import socket
import sys
import threading

from clusterwire import data, errors
from clusterwire.addressing import split_host_port
from clusterwire.data import graph
from clusterwire.data.rpc import DispatcherClient, WorkerChannels
from clusterwire.protos.data_service_pb2 import (
    ClientHeartbeatRequest,
    DataRequest,
    GetElementsRequest,
    GetOrCreateJobRequest,
    RegisterDatasetRequest,
    StreamSpec,
)
from clusterwire.security import Security
from clusterwire.testing.child import run_threads

_THREADS = 4
#: The address the flood's connections come from (another host's, on loopback).
SOURCE = "127.0.0.2"


class Relay:
    """Accepts connections on 127.0.0.1 and relays each to ``target`` over a connection made
    from ``SOURCE``: a client pointed at ``address`` reaches ``target`` as that peer."""

    def __init__(self, target: str):
        host, port = split_host_port(target)
        self._target = ("127.0.0.1" if host in ("localhost", "") else host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self._target, source_address=(SOURCE, 0))
            except OSError:
                client.close()  # the target is gone: so is the relayed connection
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        """Accept no more connections (relayed ones end when either side closes)."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(1 << 16):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for side in (source, sink):
            with contextlib.suppress(OSError):
                side.shutdown(socket.SHUT_RDWR)


class Flooder:
    """The flood's state, shared by its threads. ``relay``: connect from ``SOURCE`` (else
    as this process)."""

    def __init__(self, kind: str, dispatcher: str, relay: bool = True):
        self.kind = kind
        self.relay = relay
        self.name = secrets.token_hex(4)  # in its consumer ids (so its job keys)
        # A generous deadline: nothing about the flood is timed, and on a loaded machine
        # its first registration met a 10 s one (the victim's calls are what is timed).
        self.dispatcher = DispatcherClient(
            "grpc", Relay(dispatcher).address if relay else dispatcher, 60.0, Security())
        self.workers = WorkerChannels(Security())
        self.relays: dict[str, str] = {}  # worker address -> its relay's
        self.lock = threading.Lock()
        self.serial = itertools.count()
        self.entries: list[dict] = []  # what the flood holds, to read again
        self.full = False  # FULL was printed
        self.counts: dict = {"created": 0, "refused": 0, "displaced": 0, "other": []}
        self.dataset_id = ""
        self.named = kind == "caches"  # a cross-trainer cache is a named job's
        if kind != "datasets":
            pipe = data.Dataset.range(10) if kind == "jobs" else data.Dataset.range(1).repeat()
            self.dataset_id = self._register(pipe)

    def _register(self, dataset: data.Dataset) -> str:
        definition, buffers = graph.to_def(dataset.pipeline)
        response, _ = self.dispatcher.call(DataRequest(register_dataset=RegisterDatasetRequest(
            dataset=definition)), buffers)
        return response.register_dataset.dataset_id

    def _job(self, dataset_id: str, n: int) -> dict:
        consumer = f"flood-{self.name}-{n}"
        job = self.dispatcher.call(DataRequest(get_or_create_job=GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=data.ShardingPolicy.OFF,
            job_key=f"{'named' if self.named else 'anonymous'}/{consumer}", named=self.named,
            consumer_id=consumer)))[0].job
        return {"job": job, "consumer": consumer, "seq": 0}

    def _worker(self, address: str) -> str:
        if not self.relay:
            return address
        with self.lock:
            if address not in self.relays:
                self.relays[address] = Relay(address).address
            return self.relays[address]

    def read(self, entry: dict) -> None:
        """Read ``entry`` once: a job's heartbeat, or a batch of its stream."""
        job = entry["job"]
        if self.kind not in ("streams", "caches"):
            self.dispatcher.call(DataRequest(client_heartbeat=ClientHeartbeatRequest(
                job_id=job.job_id, consumer_id=entry["consumer"])))
            return
        entry["seq"] += 1
        spec = StreamSpec(job_id=job.job_id, dataset_id=job.dataset_id,
                          sharding_policy=job.sharding_policy, grant=job.grant, owner=job.owner,
                          trainer_id="flood" if self.named else "")
        self.workers.call("grpc", self._worker(job.workers[0].address), DataRequest(
            get_elements=GetElementsRequest(stream=spec, consumer_id=entry["consumer"],
                                            request_seq=entry["seq"], max_elements=1,
                                            wait_seconds=1.0)), 10.0)

    def create(self) -> dict:
        """A new entry of the flood's kind, read once."""
        n = next(self.serial)
        dataset_id = (self._register(data.Dataset.range(n + 1)) if self.kind == "datasets"
                      else self.dataset_id)
        entry = self._job(dataset_id, n)
        self.read(entry)
        return entry

    def run(self, stop: threading.Event) -> None:
        turn = itertools.count()
        while not stop.is_set():
            try:
                entry = self.create()
            except errors.ResourceExhaustedError as err:
                self._count("refused", err)
                with self.lock:
                    entries = list(self.entries)
                if entries:
                    self._read_again(entries[next(turn) % len(entries)])
                continue
            except errors.OpError as err:
                self._count("other", err)
                continue
            with self.lock:
                self.entries.append(entry)
                self.counts["created"] += 1

    def _read_again(self, entry: dict, last: bool = False) -> bool:
        """Read ``entry``; False if it is lost (displaced, or another error)."""
        try:
            self.read(entry)
            return True
        except errors.CancelledError as err:
            # A stream closed under a read in flight: the next read says why (at the end).
            if not last and "stream was closed" in err.message:
                return True
            self._count("other", err)
            return False
        except errors.OpError as err:
            if "was displaced" in err.message:
                with self.lock:
                    if entry in self.entries:
                        self.entries.remove(entry)
            self._count("displaced" if "was displaced" in err.message else "other", err)
            return False

    def check(self) -> None:
        """Read every entry once more: each is still read, or says it was displaced."""
        with self.lock:
            entries = list(self.entries)
        self.counts["held"] = sum(self._read_again(entry, last=True) for entry in entries)

    def _count(self, key: str, err: errors.OpError) -> None:
        with self.lock:
            if key == "other":
                if len(self.counts["other"]) < 5:
                    self.counts["other"].append(f"{type(err).__name__}: {err.message[:300]}")
            elif key != "refused" or "shared fairly" in err.message:
                self.counts[key] += 1
                if key == "refused" and not self.full:
                    self.full = True
                    print("FULL", len(self.entries), flush=True)
            else:
                self.counts["other"].append(f"unfair refusal: {err.message[:300]}")


def main(kind: str, address: str, seconds: float) -> None:
    flooder = Flooder(kind, address)
    run_threads(flooder.run, _THREADS, seconds)
    flooder.check()
    flooder.dispatcher.close()
    flooder.workers.close()
    print(json.dumps(flooder.counts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
