"""A server's per-request counts: the C cells (``_request_cells.c``) and their Python
fallback count the same requests the same way."""

from __future__ import annotations

import array
import random
import time

import numpy as np
import pytest
from conftest import fresh_python

from clusterwire.errors import CODE_NAMES
from clusterwire.metrics import catalog, requests
from clusterwire.metrics.requests import PythonRequestCells
from clusterwire.transport import Frame

try:
    from clusterwire.metrics import _request_cells as compiled
except ImportError:
    compiled = None
pytestmark = pytest.mark.timeout(60)
needs_c = pytest.mark.skipif(compiled is None, reason="the C request cells were not built "
                             "(no C compiler at install): the Python fallback counts alone")

BOUNDS = catalog.REQUEST_SECONDS.buckets
CODES = max(CODE_NAMES) + 1


class Relayed:
    """Stands for a buffer and tells its size (as a relayed response's buffers do)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def buffers(rng: random.Random) -> list:
    """A frame's buffers of every kind a frame may hold."""
    kinds = [
        lambda n: bytes(n),
        lambda n: bytearray(n),
        lambda n: memoryview(bytes(n)),
        lambda n: np.zeros(n, np.uint8),
        lambda n: np.zeros((n, 3), np.float32)[:, 1],  # not contiguous
        lambda n: array.array("d", bytes(8 * n)),  # a buffer without nbytes
        lambda n: memoryview(array.array("i", bytes(4 * n)))[::2],  # strided
        lambda n: Relayed(n),
    ]
    return [rng.choice(kinds)(rng.randrange(0, 5000)) for _ in range(rng.randrange(0, 4))]


@needs_c
def test_the_c_cells_are_the_ones_used():
    assert requests.RequestCells is compiled.RequestCells


@needs_c
def test_c_and_python_cells_count_alike():
    rng = random.Random(7)
    cells = [compiled.RequestCells(BOUNDS, CODES), PythonRequestCells(BOUNDS, CODES)]
    ages = []
    for _ in range(2000):
        method = rng.choice(["get", "put", "call", "unknown"])
        code = rng.choice([0, 0, 0, 5, 14, 16])
        # Latencies on either side of each bound: the bucket is what Prometheus says
        # (upper bound inclusive), whichever side counts it.
        age = rng.choice(BOUNDS) + rng.choice([-0.02, 0.02]) + 0.05
        request = Frame(bytes(rng.randrange(1, 80)), buffers(rng))
        response = Frame(memoryview(bytes(rng.randrange(0, 80))), buffers(rng))
        started = time.perf_counter() - age
        for each in cells:
            each.record(method, code, started, request, response)
        ages.append(age)
    (c_latency, c_errors, *c_bytes), (py_latency, py_errors, *py_bytes) = (
        each.snapshot() for each in cells)
    assert c_bytes == py_bytes and c_bytes[0] > 0
    assert c_errors == py_errors
    assert c_latency.keys() == py_latency.keys() == {"get", "put", "call", "unknown"}
    for method in c_latency:
        # The same buckets; sums within the few ms between the two records of a request.
        assert c_latency[method][:-1] == py_latency[method][:-1]
        assert c_latency[method][-1] == pytest.approx(py_latency[method][-1], rel=1e-3)
    assert sum(sum(counts[:-1]) for counts in c_latency.values()) == 2000
    assert sum(counts[-1] for counts in c_latency.values()) >= sum(ages)


@needs_c
def test_a_latency_is_counted_in_the_bucket_prometheus_puts_it_in():
    cells = compiled.RequestCells((0.1, 0.2), CODES)
    frame = Frame(b"h", [])
    for age in (0.05, 0.15, 0.15, 0.3):
        cells.record("get", 0, time.perf_counter() - age, frame, frame)
    latency, errors, received, sent = cells.snapshot()
    assert latency["get"][:-1] == [1, 2, 1]
    assert latency["get"][-1] == pytest.approx(0.65, abs=0.05)
    assert errors == {"get": [0] * CODES}
    assert (received, sent) == (4, 4)


@pytest.mark.parametrize("compiled_cells", [pytest.param(True, marks=needs_c), False])
def test_a_buffer_of_no_known_size_is_refused_and_nothing_is_counted(compiled_cells):
    counted = (compiled.RequestCells if compiled_cells else PythonRequestCells)(BOUNDS, CODES)
    with pytest.raises(TypeError):
        counted.record("get", 0, time.perf_counter(), Frame(b"h", [object()]), Frame(b"", []))
    assert counted.snapshot()[2:] == (0, 0)


@needs_c
def test_bad_construction_and_codes_are_clear_errors():
    with pytest.raises(ValueError, match="bounds"):
        compiled.RequestCells(tuple(range(40)), CODES)
    cells = compiled.RequestCells(BOUNDS, CODES)
    with pytest.raises(ValueError, match="status code 99"):
        cells.record("get", 99, time.perf_counter(), Frame(b"", []), Frame(b"", []))
    with pytest.raises(TypeError, match="method must be a str"):
        cells.record(3, 0, time.perf_counter(), Frame(b"", []), Frame(b"", []))


def test_without_the_c_cells_a_server_counts_in_python():
    counted = fresh_python(
        "import sys\n"
        "sys.modules['clusterwire.metrics._request_cells'] = None  # as if not built\n"
        "import numpy as np\n"
        "from clusterwire.metrics import REGISTRY, catalog, requests\n"
        "from clusterwire.shell import Shell, listen_options\n"
        "from clusterwire.testing.peer import echo_handler\n"
        "from clusterwire.transport import Frame\n"
        "assert requests.RequestCells is requests.PythonRequestCells\n"
        "shell = Shell('grpc+local', '127.0.0.1:0', echo_handler, 'echo', listen_options())\n"
        "shell.start()\n"
        "channel = shell.transport.connect(shell.address)\n"
        "for _ in range(3):\n"
        "    channel.call(Frame(b'hello', [np.zeros(100, np.uint8)]), 10)\n"
        "channel.close()\n"
        "values = {s.metric.name: s.value for s in REGISTRY.samples(server='echo')}\n"
        "shell.stop()\n"
        "print(values['clusterwire_requests_total'], values['clusterwire_received_bytes_total'],\n"
        "      values['clusterwire_sent_bytes_total'])\n")
    assert counted.split() == ["3", str(3 * 105), str(3 * 105)]
