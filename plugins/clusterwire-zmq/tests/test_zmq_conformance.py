"""The zmq transport passes clusterwire's conformance kit."""

from clusterwire.testing import Capabilities, TransportSuite


class TestZmqConformance(TransportSuite):
    protocol = "zmq"
    # libzmq has no TLS over TCP (its CURVE mechanism uses its own keys, not X.509
    # certificates), so the transport refuses Security.tls with UnimplementedError
    # (tested in test_zmq_security.py). A stopping listener answers its running calls
    # CANCELLED, then closes; now and then (6% of stops, 25% under load) the answer is lost
    # with the connection (waiting 200 ms more after the close did not bring it), and
    # that call gets UnavailableError. Everything else is on.
    capabilities = Capabilities(tls=False, cancels_on_stop=False)
