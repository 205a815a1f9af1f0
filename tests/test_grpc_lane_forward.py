"""Forwarded calls on the grpc fast lane: a forwarding listener passes the owner's reply on
as it came (no second encoding), a task's kept forwarding routes follow membership changes,
and forwarded puts, gets, calls and errors come back right between task processes.

Listeners and in-process Servers run on 127.0.0.1; the cluster's tasks are processes of a
LocalCluster with the lane on; everything is stopped at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import child_env
from grpc_listeners import channel_to, listening

import clusterwire
from clusterwire import errors
from clusterwire.local_cluster import LocalCluster
from clusterwire.plugins import PluginManager, set_plugin_manager
from clusterwire.transport import Frame
from clusterwire.transports.grpc.relay import verbatim_of

pytestmark = pytest.mark.timeout(60)

LANE = {"fast_lane": True}


def test_a_forwarding_listener_passes_the_owners_reply_on_as_it_came():
    with listening(LANE) as owner, channel_to(owner.address, transport_options=LANE) as peer:
        passed: list[bool] = []

        def forward(frame: Frame) -> Frame:
            reply = peer.call_relayed(Frame(frame.header, frame.buffers), timeout=10)
            passed.append(verbatim_of(reply.header, reply.buffers) is not None)
            if bytes(frame.header) == b"renamed":  # a changed reply is encoded afresh
                return Frame(b"new header", reply.buffers)
            return reply

        with listening(LANE, handler=forward) as forwarder, \
                channel_to(forwarder.address, transport_options=LANE) as client:
            for header, payload in ((b"small", b"8 bytes!"), (b"bare", None),
                                    (b"renamed", b"x" * 1000)):
                reply = client.call(Frame(header, [payload] if payload else []), timeout=10)
                expected = b"new header" if header == b"renamed" else header
                assert bytes(reply.header) == expected
                assert [bytes(b) for b in reply.buffers] == ([payload] if payload else [])
            assert passed == [True, True, True]
            assert owner.lane.calls == 3 and forwarder.lane.calls == 3


def test_a_kept_forwarding_route_follows_the_task_to_its_new_address():
    config = {"allow_membership_changes": True}
    first = clusterwire.Server({"w": ["127.0.0.1:0"] * 2}, job_name="w", task_index=0,
                               config=config)
    owner = moved = None
    try:
        owner = clusterwire.Server({"w": [first.target.split("://")[1], "127.0.0.1:0"]},
                                   job_name="w", task_index=1, config=config)
        here = first.target.split("://")[1]
        first.update_cluster({"w": [here, owner.target.split("://")[1]]})
        with clusterwire.Session(first.target) as session:
            with clusterwire.Session(owner.target) as to_owner:
                to_owner.put("x", np.array([1]))
            for _ in range(2):  # the second one takes the kept route
                np.testing.assert_array_equal(session.get("x", task="/job:w/task:1"), [1])
            view, routes = first._service._routes
            assert view is first._service.membership.view and len(routes) == 1
            moved = clusterwire.Server({"w": [here, "127.0.0.1:0"]}, job_name="w",
                                       task_index=1, config=config)
            with clusterwire.Session(moved.target) as to_moved:
                to_moved.put("x", np.array([2]))
            first.update_cluster({"w": [here, moved.target.split("://")[1]]})
            np.testing.assert_array_equal(session.get("x", task="/job:w/task:1"), [2])
    finally:
        for server in (moved, owner, first):
            if server is not None:
                server.stop()


def test_forwarded_requests_over_the_lane_between_task_processes(tmp_path):
    config = tmp_path / "plugins.toml"
    config.write_text("[options.grpc]\nfast_lane = true\n")
    with LocalCluster({"worker": 2}, env={**child_env(), "CLUSTERWIRE_PLUGINS": str(config)}
                      ) as cluster:
        previous = set_plugin_manager(PluginManager(str(config)))
        try:
            with clusterwire.Session(cluster.target("worker", 0)) as session:
                assert "small_calls" in session.status()["transport"]
                remote = "/job:worker/task:1"
                for value in (np.arange(8, dtype=np.uint8), np.arange(4.0)):
                    session.put("v", value, task=remote)
                    np.testing.assert_array_equal(session.get("v", task=remote), value)
                assert session.list(task=remote) == ["v"]
                with pytest.raises(errors.NotFoundError, match="task:1"):
                    session.get("missing", task=remote)
                with clusterwire.Session(cluster.target("worker", 1)) as owner:
                    np.testing.assert_array_equal(owner.get("v"), np.arange(4.0))
        finally:
            set_plugin_manager(previous)
