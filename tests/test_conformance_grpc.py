"""The built-in grpc transport passes the conformance kit."""

from clusterwire.testing import Capabilities, TransportSuite


class TestGrpcConformance(TransportSuite):
    protocol = "grpc"
    # The gRPC port closes the oldest pending connection through its door
    # (clusterwire.transports._grpc_common.door).
    capabilities = Capabilities()
