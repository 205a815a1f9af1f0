"""The built-in grpc+verbs transport passes the conformance kit (real UCX, no GPU needed)."""

import pytest

from clusterwire.testing import Capabilities, TransportSuite

# Its request bytes travel over UCX, not through the kit's TCP proxy.
_VERBS = Capabilities(trickle_via_proxy=False)

pytest.importorskip("ucxx", reason="the verbs extra is not installed: pip install '.[verbs]'")


class TestVerbsConformance(TransportSuite):
    protocol = "grpc+verbs"
    capabilities = _VERBS

    def test_small_calls_run_in_c(self, transport):
        pytest.importorskip("clusterwire.transports.verbs._ucp",
                            reason="the C helper was not built (no C compiler at install)")
        assert transport.info()["small_calls"] == "in C (_ucp)"


class TestVerbsPythonRoundTripConformance(TransportSuite):
    """The same with the C helper off (``compiled = false``), as where it was not built.

    Its peer process still uses the C helper: the two interoperate.
    """

    protocol = "grpc+verbs"
    capabilities = _VERBS

    @pytest.fixture(scope="class")
    @classmethod
    def transport(cls):
        from clusterwire.transports.verbs.transport import VerbsTransport

        transport = VerbsTransport({"compiled": False})
        assert transport.info()["small_calls"].startswith("in Python")
        yield transport
        transport.engine.stop()
