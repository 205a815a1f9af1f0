"""The built-in grpc+local transport passes the conformance kit."""

from clusterwire.testing import Capabilities, TransportSuite


class TestLocalConformance(TransportSuite):
    protocol = "grpc+local"
    # Zero-copy: received buffers are read-only views of shared memory.
    capabilities = Capabilities(writable_buffers=False)
