"""Fair shares of the data service's tables between peers (issue 29), on real processes.

A token holder on another host (127.0.0.2, ``cw_data_fair_flood.py``) fills the dispatcher's
job table or dataset table, or a worker's streams, with entries it keeps *using* (jobs it
reads, datasets its jobs read, streams it reads under many consumer ids), which nothing
collects. Meanwhile a client on 127.0.0.1 creates a dataset, a job and reads, each within a
second and with every element; the flooder holds its share, is refused beyond it, and its
displaced entries say so at their next use. The rule itself (``clusterwire.fair_shares``) is
checked directly first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from cw_data_procs import TESTS_DIR

from clusterwire import data, errors
from clusterwire.data.quotas import ServiceLimits
from clusterwire.data.rpc import DispatcherClient
from clusterwire.fair_shares import Displaced, FairShares
from clusterwire.protos.data_service_pb2 import DataRequest, GetOrCreateJobRequest
from clusterwire.security import Security
from clusterwire.testing.surfaces import allowed_for

#: How long the flooder may take to fill a table (4,096 jobs, each created and read, through
#: a relay, on a machine shared with other test runs).
FILL_S = 240.0


# ---- the rule -----------------------------------------------------------------------------

def shares_of(**held: int) -> FairShares[str]:
    """Entries "<peer><i>", each peer's in order, the peers in the order given."""
    shares: FairShares[str] = FairShares()
    for peer, count in held.items():
        for i in range(count):
            shares.add(f"{peer}{i}", peer)
    return shares


def test_a_new_entry_displaces_the_oldest_of_the_biggest_peer_only_while_it_holds_more():
    shares = shares_of(flood=6, victim=1)
    assert shares.make_room("victim", 1) == ["flood0"]
    assert shares.make_room("other", 1) == ["flood0"]
    assert shares.make_room("flood", 1) is None  # it holds the most: refused
    shares = shares_of(a=3, b=2)
    assert shares.make_room("b", 1) is None  # b would hold 3, as many as a: refused
    assert shares.make_room("c", 1) == ["a0"]
    assert shares.make_room("c", 3) == ["a0", "a1", "b0"]  # a and b level down together


def test_what_nobody_uses_goes_first_of_the_biggest_peer_and_last_of_the_requester():
    shares = shares_of(flood=6, victim=2)
    # The victim's unused entry (a job it has not read yet) is not the flooder's to take.
    assert shares.make_room("flood", 1, unused=["victim1"]) is None
    assert shares.make_room("flood", 1, unused=["victim1", "flood3"]) == ["flood3"]
    # Below the biggest share, a peer takes the biggest's entries, not its own unused one.
    assert shares.make_room("victim", 1, unused=["victim1"]) == ["flood0"]
    assert shares.make_room("victim", 1, unused=["victim1", "flood4"]) == ["flood4"]
    assert shares.make_room("other", 1, unused=["victim1", "flood4"]) == ["flood4"]
    assert shares.make_room("other", 2, unused=["victim1", "flood4"]) == ["flood4", "flood0"]
    assert shares.make_room("other", 6, unused=["victim1", "flood4"]) == [
        "flood4", "flood0", "flood1", "flood2", "flood3", "victim1"]  # then both hold 2
    assert shares_of(a=2, b=2).make_room("b", 1, unused=["b1"]) == ["b1"]


def test_sizes_count_as_held_and_the_refusal_and_displacement_say_why():
    shares: FairShares[str] = FairShares()
    shares.add("big", "10.0.0.9", 900)
    shares.add("small", "10.0.0.9", 50)
    shares.add("mine", "127.0.0.1", 40)
    assert shares.held("10.0.0.9") == 950 and shares.total == 990
    assert shares.make_room("127.0.0.1", 100, 100) == ["big"]
    assert shares.make_room("127.0.0.1", 100, 1000) is None  # 1,040 would pass 950
    err = shares.refusal("The table", "1000 bytes", "127.0.0.1", 1000, "Retry later.")
    assert isinstance(err, errors.ResourceExhaustedError)
    assert all(s in err.message for s in ("The table is full (1000 bytes)", "peer 127.0.0.1 "
                                          "holds 40", "peer 10.0.0.9", "950", "Retry later."))
    why = shares.displacement("Entry big", "the table", "1000 bytes", "big", "127.0.0.1")
    assert why.startswith("Entry big was displaced: the table was full (1000 bytes), peer "
                          "10.0.0.9 held 950 of it, the most, and peer 127.0.0.1 needed room")
    shares.discard("big")
    assert shares.held("10.0.0.9") == 50 and shares.biggest() == ("10.0.0.9", 50)
    displaced: Displaced[str] = Displaced(2)
    for entry in ("a", "b", "c"):
        displaced.remember(entry, f"why {entry}")
    assert [displaced.why(e) for e in "abc"] == [None, "why b", "why c"]


# ---- floods on real processes -------------------------------------------------------------

class FairFlood:
    """cw_data_fair_flood.py in a process of its own."""

    def __init__(self, kind: str, dispatcher: str, seconds: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(TESTS_DIR, "cw_data_fair_flood.py"), kind,
             dispatcher, str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)

    def wait_full(self) -> int:
        """The entries the flooder holds once the table is full."""
        line = self.process.stdout.readline().split()
        assert line[:1] == ["FULL"], f"the flood ended before filling the table: {line!r}"
        return int(line[1])

    def stop(self) -> dict:
        self.process.stdin.close()
        counts = json.loads(self.process.stdout.readline())
        self.process.wait(60)
        return counts

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self.process.stdout.close()
        if not self.process.stdin.closed:
            self.process.stdin.close()


def timed(operation):
    started = time.monotonic()
    result = operation()
    return result, time.monotonic() - started


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["jobs", "datasets", "streams"])
def test_a_peer_filling_a_table_with_entries_it_uses_leaves_others_their_share(processes,
                                                                               kind):
    """The flooder (127.0.0.2) fills the table with entries it reads, and keeps creating and
    reading. The victim (127.0.0.1): a new dataset, a new job (and a read of it), and a read
    through distribute() each within a second (``allowed_for``: more on a busy machine), every
    element exactly once. The flooder is refused beyond its share (never by an unfair
    refusal), and learns of each entry it lost ("was displaced") at its next read: never
    another error, never a silent loss."""
    dispatcher = processes("dispatcher")
    processes("worker", "--dispatcher-address", dispatcher.address)
    victim = DispatcherClient("grpc", dispatcher.address, 10.0, Security())
    flood = None
    before: dict[str, float] = {}
    worst: dict[str, float] = {}
    try:
        for attempt in range(5):  # the first before the flood
            if attempt == 1:
                flood = FairFlood(kind, dispatcher.address, FILL_S + 120)
                full_at = flood.wait_full()
            dataset = data.Dataset.range(5 + attempt)
            dataset_id, took_dataset = timed(
                lambda d=dataset: data.register_dataset(dispatcher.target, d))
            job, took_job = timed(lambda d=dataset_id, a=attempt: victim.call(DataRequest(
                get_or_create_job=GetOrCreateJobRequest(
                    dataset_id=d, sharding_policy=data.ShardingPolicy.OFF,
                    job_key=f"victim/{a}", named=True, consumer_id=f"victim-{a}")))[0].job)
            assert job.job_id
            read, took_read = timed(lambda d=dataset_id: sorted(int(x) for x in (
                data.from_dataset_id("parallel_epochs", dispatcher.target, d))))
            assert read == list(range(5 + attempt))
            served, took_distribute = timed(lambda a=attempt: list(
                data.Dataset.range(100 + a).apply(data.distribute(
                    "parallel_epochs", dispatcher.target))))
            assert sorted(int(x) for x in served) == list(range(100 + attempt))
            for name, took in (("dataset", took_dataset), ("job", took_job),
                               ("read", took_read), ("distribute", took_distribute)):
                times = worst if attempt else before
                times[name] = max(times.get(name, 0.0), took)
        status = data.service_status(dispatcher.address)
        counts = flood.stop()
    finally:
        victim.close()
        if flood is not None:
            flood.close()
    print(f"\n{kind} flood from 127.0.0.2 (full at {full_at} of its entries): victim's "
          f"slowest before {before}, during {worst}; flooder {counts}; {len(status.jobs)} jobs")
    assert max(worst.values()) < allowed_for(max(before.values())), (before, worst)
    limits = ServiceLimits()
    limit = {"jobs": limits.max_jobs, "datasets": limits.max_datasets,
             "streams": limits.max_open_streams}[kind]
    assert full_at >= limit - 16 and counts["refused"] > 0, counts
    assert counts["other"] == [], counts
    # The victim's entries displaced some of the flooder's, which it was told of; it still
    # holds the rest of its share (at most one per victim entry fewer than the limit).
    assert counts["displaced"] > 0, counts
    assert limit - 16 <= counts["held"] <= limit, counts
    assert len(status.jobs) <= limits.max_jobs


# ---- what a displaced entry's reader sees -------------------------------------------------

def _read_until_error(iterator, seconds: float = 60.0) -> errors.OpError:
    """Read ``iterator`` (endless) until it raises; the error (bounded in time)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            next(iterator)
        except errors.OpError as err:
            return err
    raise AssertionError(f"no error within {seconds} s")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["jobs", "streams"])
def test_a_reader_whose_job_or_stream_was_displaced_is_told_why(kind):
    """Servers in this process (its own clients are peer ""). An endless reader opens its job
    and stream first; entries of this process fill the rest of the table (4,096 jobs, or the
    worker's 64 streams), each read; a token holder on 127.0.0.2 (through a relay) makes one
    more, which displaces the oldest entry of the biggest peer: the reader's. The reader's next
    elements end in ResourceExhaustedError saying it was displaced and for whom; its next one
    displaces this process's next oldest, which says so when read; the others still read."""
    from cw_data_fair_flood import Flooder

    # A worker of 16 streams (64 by default): the same rule over a quarter of the endless
    # streams, each of which fills its buffer in this process (the case's main cost).
    limit = ServiceLimits().max_jobs if kind == "jobs" else 16
    with data.DispatchServer(port=0) as dispatcher, data.WorkerServer(data.WorkerConfig(
            dispatcher_address=dispatcher.target.split("://")[1],
            limits={"max_open_streams": 16})):
        address = dispatcher.target.split("://")[1]
        reader = iter(data.Dataset.range(1).repeat().apply(data.distribute(
            "parallel_epochs", dispatcher.target)))
        ours, theirs = Flooder(kind, address, relay=False), Flooder(kind, address)
        try:
            assert int(next(reader)) == 0  # its job is read and its stream open
            entries = [ours.create() for _ in range(limit - 1)]
            theirs.create()
            err = _read_until_error(reader)
            assert isinstance(err, errors.ResourceExhaustedError), err
            assert "was displaced" in err.message and "peer 127.0.0.2 needed room" in \
                err.message, err.message
            theirs.create()  # it holds 1, this process 1 fewer than the limit: ours go
            with pytest.raises(errors.ResourceExhaustedError, match="was displaced"):
                ours.read(entries[0])
            for entry in entries[1:]:
                ours.read(entry)
        finally:
            reader.close()
            for flooder in (ours, theirs):
                flooder.dispatcher.close()
                flooder.workers.close()


@pytest.mark.timeout(120)
def test_a_dataset_is_each_peers_own_and_keeps_its_id_across_a_restart(tmp_path):
    """The same dataset registered from 127.0.0.2 and from this process gets two ids (a
    peer's displaced dataset never takes another peer's jobs along); registered again from
    127.0.0.2 it gets its own id back, also after a fault-tolerant restart, which forgot its
    creator (peer "")."""
    from cw_data_fair_flood import Flooder

    config = data.DispatcherConfig(port=0, fault_tolerant_mode=True, work_dir=str(tmp_path))

    def register(address: str, relay: bool = True) -> str:
        flooder = Flooder("jobs", address, relay=relay)  # registers range(10)
        flooder.dispatcher.close()
        flooder.workers.close()
        return flooder.dataset_id

    with data.DispatchServer(config) as dispatcher:
        address = dispatcher.target.split("://")[1]
        registered = [register(address), register(address, relay=False), register(address)]
    assert registered[0] != registered[1] and registered[2] == registered[0]
    with data.DispatchServer(config._replace(port=int(address.rsplit(":", 1)[1]))):
        assert register(address) == registered[0]
