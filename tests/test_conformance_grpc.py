"""The built-in grpc transport passes the conformance kit."""

from clusterwire.testing import TransportSuite


class TestGrpcConformance(TransportSuite):
    protocol = "grpc"
