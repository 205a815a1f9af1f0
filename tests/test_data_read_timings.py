"""A consumer's reads (issue 35): element reads go through the core ``RequestClient``
(channel choice, deadline, error mapping in one path), and their retry windows, timeouts
and idle times are one table, ``ReadTimings``, which README's Reliability list shows.

Real servers of this process on 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket

import pytest
from conftest import in_process_data_service

from clusterwire import data, errors
from clusterwire.data import reader
from clusterwire.data.read_timings import ReadTimings
from clusterwire.data.rpc import WorkerChannels
from clusterwire.protos.data_service_pb2 import DataRequest, GetElementsRequest, StreamSpec
from clusterwire.security import Security

pytestmark = pytest.mark.timeout(60)

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _readme_table() -> str:
    rows = ["| timing | default | what it times |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {f.default:g} s | {f.metadata['times']} |"
             for f in dataclasses.fields(ReadTimings)]
    return "\n".join("  " + row for row in rows)


def test_the_readme_table_is_the_dataclass():
    with open(README, encoding="utf-8") as handle:
        text = handle.read()
    found = re.search(r"<!-- read-timings:begin -->\n(.*?)\n?<!-- read-timings:end -->",
                      text, re.DOTALL)
    assert found, "README's Reliability list lost its read-timings block"
    assert found.group(1) == _readme_table(), (
        "README's read timings differ from ReadTimings; put this between the read-timings "
        "markers:\n" + _readme_table())


@pytest.mark.parametrize("value", [0, -1.0, True, "15", None, math.inf, math.nan])
def test_a_bad_timing_is_refused_naming_it_and_its_default(value):
    with pytest.raises(errors.InvalidArgumentError,
                       match=rf"read_timeout_s = {re.escape(repr(value))} must be a positive, "
                             r"finite number of seconds \(default 15.0\)"):
        ReadTimings(read_timeout_s=value)


@pytest.mark.parametrize(("shorter", "longer"), [("read_wait_s", "read_timeout_s"),
                                                 ("retry_s", "retry_max_s")])
def test_timings_that_contradict_each_other_are_refused(shorter, longer):
    with pytest.raises(errors.InvalidArgumentError,
                       match=rf"{shorter} = 3.0 is longer than {longer} = 2.0.*"
                             rf"Give {shorter} <= {longer}"):
        ReadTimings(**{shorter: 3.0, longer: 2.0})


def test_the_reader_keeps_no_timing_of_its_own():
    """The windows live in the table only: no seconds constant is left in the reader."""
    with open(reader.__file__, encoding="utf-8") as handle:
        source = handle.read()
    assert not re.findall(r"^_?[A-Z_]+_S\s*=", source, re.MULTILINE)
    assert ReadTimings() == reader.TIMINGS
    assert ReadTimings(retry_max_s=0.3).backoff(0.2) == 0.3  # doubles, up to retry_max_s


def test_a_reader_takes_the_table_it_was_made_with(monkeypatch):
    """A reader uses the timings of ``reader.TIMINGS`` when it is made: here a read wait of
    0.1 s, which every element read asks the worker for."""
    waits = []
    call = WorkerChannels.call

    def spy(channels, protocol, address, request, timeout):
        if request.WhichOneof("kind") == "get_elements":
            waits.append((request.get_elements.wait_seconds, timeout))
        return call(channels, protocol, address, request, timeout)

    monkeypatch.setattr(WorkerChannels, "call", spy)
    monkeypatch.setattr(reader, "TIMINGS", dataclasses.replace(
        reader.TIMINGS, read_wait_s=0.125, read_timeout_s=7.5))
    with in_process_data_service(workers=1) as dispatcher:
        ds = data.Dataset.range(50).apply(data.distribute("parallel_epochs",
                                                          dispatcher.target))
        assert [int(x) for x in ds] == list(range(50))
    assert waits and set(waits) == {(0.125, 7.5)}


def test_an_unreachable_worker_is_an_unavailable_error_naming_it():
    """Through RequestClient: one attempt (the reader decides what a failed worker means),
    mapped to UnavailableError naming the worker, its address and protocol."""
    with socket.socket() as bound:  # bound, never listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        channels = WorkerChannels(Security())
        try:
            with pytest.raises(errors.UnavailableError,
                               match=rf"tf.data service worker at {address} \(grpc\) is "
                                     "unavailable"):
                channels.call("grpc", address, DataRequest(get_elements=GetElementsRequest(
                    stream=StreamSpec(job_id=1), consumer_id="c")), 5.0)
        finally:
            channels.close()


def test_a_workers_refusal_comes_back_as_its_class_and_closed_channels_cancel():
    """A worker's error status maps to its clusterwire class (a stream the dispatcher did
    not grant: PermissionDeniedError, with the worker's words); once closed, the channels
    refuse further calls with CancelledError, also over a protocol they had not opened."""
    with in_process_data_service(workers=1) as dispatcher:
        [worker] = data.service_status(dispatcher.target).workers
        channels = WorkerChannels(Security())
        request = DataRequest(get_elements=GetElementsRequest(
            stream=StreamSpec(job_id=987654), consumer_id="c", max_elements=1))
        try:
            with pytest.raises(errors.PermissionDeniedError,
                               match="did not grant a whole-dataset stream of job 987654"):
                channels.call("grpc", worker.address, request, 10.0)
        finally:
            channels.close()
        for protocol in ("grpc", "grpc+local"):  # one it used, one it never opened
            with pytest.raises(errors.CancelledError):
                channels.call(protocol, worker.address, request, 10.0)
