"""The zmq transport passes clusterwire's conformance kit."""

from clusterwire.testing import Capabilities, TransportSuite


class TestZmqConformance(TransportSuite):
    protocol = "zmq"
    # libzmq has no TLS over TCP (its CURVE mechanism uses its own keys, not X.509
    # certificates), so the transport refuses Security.tls with UnimplementedError
    # (tested in test_zmq_security.py). Everything else is on.
    capabilities = Capabilities(tls=False)
