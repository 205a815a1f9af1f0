"""A worker closes a stream nobody read for its idle time; what its consumer gets after.

An anonymous job's stream is its consumer's own: every read names where the consumer is
(with the service's vouch), so the worker opens the stream again there and the consumer
reads on, each element once. A named job's shared stream cannot be continued (its consumers
took its elements in turns): the worker refuses it with FailedPreconditionError instead of
starting it again from its first element.
"""

from __future__ import annotations

import pytest
from conftest import wait_for

from clusterwire import data, errors

pytestmark = pytest.mark.timeout(120)

ELEMENTS = 300
FIRST = 20


@pytest.fixture
def service():
    """A dispatcher and one worker in this process whose streams close after 0.5 s without
    a read (checked at its heartbeats, every 0.1 s)."""
    with data.DispatchServer(port=0) as dispatcher, data.WorkerServer(data.WorkerConfig(
            dispatcher_address=dispatcher.target.split("://")[1],
            heartbeat_interval_ms=100, limits={"idle_stream_s": 0.5})) as worker:
        wait_for(lambda: dispatcher.num_workers() == 1, what="the worker")
        yield dispatcher, worker


def _read_then_idle(dispatcher, worker, job_name: str | None):
    """An iterator of range(ELEMENTS) through the service (one element a read, so that its
    reader holds few ahead), FIRST elements read, then left until the worker closed its
    stream; the elements read and the iterator."""
    iterator = iter(data.Dataset.range(ELEMENTS).apply(data.distribute(
        "parallel_epochs", dispatcher.target, job_name=job_name,
        max_outstanding_requests=1)))
    got = [int(next(iterator)) for _ in range(FIRST)]
    wait_for(lambda: not worker._streams, timeout=30, what="the worker to close the stream")
    return got, iterator


def test_an_anonymous_jobs_stream_closed_idle_goes_on_where_its_consumer_is(service):
    got, iterator = _read_then_idle(*service, job_name=None)
    got += [int(x) for x in iterator]
    assert got == list(range(ELEMENTS))


def test_a_shared_stream_closed_idle_is_refused_not_started_again(service):
    got, iterator = _read_then_idle(*service, job_name="shared")
    with pytest.raises(errors.FailedPreconditionError, match="without a read"):
        got += [int(x) for x in iterator]
    assert got == list(range(len(got)))  # what came before the refusal: each once, in order
