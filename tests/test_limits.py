"""A task's memory limits hold against a client that tries to exhaust them (real processes)."""

from __future__ import annotations

import numpy as np
import pytest

from clusterwire import Session, errors
from clusterwire.local_cluster import LocalCluster
from clusterwire.protos.service_pb2 import Request
from clusterwire.rpc import RequestClient

_MiB = 1 << 20


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.timeout(120)
def test_the_store_quota_refuses_puts_beyond_it_and_the_task_stays_small():
    with LocalCluster({"w": 1}, config={"max_store_bytes": 32 * _MiB}) as cluster:
        pid = cluster.process("w").pid
        before = rss_mib(pid)
        with Session(cluster.target("w"), timeout=30) as session:
            for index in range(4):
                session.put(f"t{index}", np.ones(8 * _MiB, np.uint8))
            for index in range(4, 24):  # the red team's 24 puts, beyond the quota
                with pytest.raises(errors.ResourceExhaustedError, match="max_store_bytes"):
                    session.put(f"t{index}", np.ones(8 * _MiB, np.uint8))
            assert session.list() == ["t0", "t1", "t2", "t3"]
            session.put("t0", np.ones(8 * _MiB, np.uint8))   # replacing fits
            assert session.delete("t1")
            session.put("t4", np.zeros(8 * _MiB, np.uint8))  # freed room fits again
            assert int(session.get("t4").sum()) == 0
        # 32 MiB stored, plus what the transport keeps around for reuse.
        assert rss_mib(pid) - before < 32 + 64


@pytest.mark.timeout(60)
def test_a_huge_dtype_header_is_refused_quickly():
    with LocalCluster({"w": 1}) as cluster:
        request = Request(method="put", name="x")
        request.value.tensor.dtype = repr([(f"f{i}", "<f8") for i in range(400_000)])
        request.value.tensor.shape.append(1)
        client = RequestClient("grpc", timeout=10)
        try:
            with pytest.raises(errors.InvalidArgumentError, match="characters: more than"):
                client.send(cluster.target("w").split("://")[1], request, [b"\0" * 8])
        finally:
            client.close()
        with Session(cluster.target("w")) as session:
            assert session.list() == []
