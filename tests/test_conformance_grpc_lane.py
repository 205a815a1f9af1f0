"""The grpc transport with its fast lane on passes the conformance kit, and its checks of a
channel pass over the lane inside TLS too (``TestGrpcLaneTlsConformance``).

The kit's processes (its peers, token holders, cluster tasks) read the options from the
plugins.toml this module points $CLUSTERWIRE_PLUGINS at, so every listener and channel of
the run, in this process and the children, has the lane on.
"""

import os

import pytest

from clusterwire.plugins import PluginManager, get_plugin_manager, set_plugin_manager
from clusterwire.security import Security
from clusterwire.testing import Capabilities, TransportSuite
from clusterwire.transport import Frame, ListenOptions

#: The grpc options the kit runs with, one run each.
LANE_OPTIONS = {
    "lane": 'fast_lane = true',
    # Every response inline on the lane up to 1 MiB (none fetched from the bulk port).
    "lane-inline-replies": 'fast_lane = true\nbulk_bytes = 1048576',
}
#: The kit's channel checks whose frames are all over inline_bytes (none takes the lane).
LARGE_ONLY = {"test_multi_megabyte_buffers", "test_256_mib_frame", "test_many_buffers",
              "test_received_buffers_are_writable_and_owned"}


@pytest.fixture(scope="module", params=sorted(LANE_OPTIONS), autouse=True)
def lane_options(request, tmp_path_factory):
    config = tmp_path_factory.mktemp("lane") / "plugins.toml"
    config.write_text(f"[options.grpc]\n{LANE_OPTIONS[request.param]}\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CLUSTERWIRE_PLUGINS", str(config))
        previous = set_plugin_manager(PluginManager(str(config)))
        try:
            yield request.param
        finally:
            set_plugin_manager(previous)


class TestGrpcLaneConformance(TransportSuite):
    protocol = "grpc"
    capabilities = Capabilities()

    def test_small_calls_take_the_lane(self, transport, listener):
        assert transport.fast_lane and listener.lane is not None
        channel = transport.connect(listener.address)
        try:
            before = listener.lane.calls
            for i in range(3):
                self._echo(channel, b"lane-%d" % i, [b"8 bytes!"])
            assert listener.lane.calls == before + 3
        finally:
            channel.close()
        assert os.environ["CLUSTERWIRE_PLUGINS"]
        assert get_plugin_manager().transport("grpc") is transport

    def test_calls_without_buffers_take_the_lane_too(self, transport, listener):
        channel = transport.connect(listener.address)
        try:
            before = listener.lane.calls
            assert bytes(channel.call(Frame(b"bare", []), timeout=30).header) == b"bare"
            assert listener.lane.calls == before + 1
        finally:
            channel.close()


class TestGrpcLaneTlsConformance(TransportSuite):
    """The kit's checks of a channel, with a listener and a channel that use TLS: frames
    that fit ``inline_bytes`` travel on the lane inside TLS (asserted after each check).
    The kit's other checks (its TLS ones among them) run in TestGrpcLaneConformance."""

    protocol = "grpc"
    capabilities = Capabilities()

    @pytest.fixture(autouse=True)
    def _channel_checks_only(self, request):
        if "channel" not in request.fixturenames:
            pytest.skip("not a check of a channel: TestGrpcLaneConformance runs it")

    @pytest.fixture
    def channel(self, request, transport, authority):
        server = self._tls(authority, authority.issue("lane-server"), ca=False)
        listener = self._listen(transport, options=ListenOptions(security=Security(tls=server)))
        channel = transport.connect(listener.address, Security(tls=self._tls(authority)))
        try:
            yield channel
            if request.node.originalname not in LARGE_ONLY:
                assert listener.lane.calls > 0, "no call took the TLS lane"
        finally:
            channel.close()
            listener.stop(0)
