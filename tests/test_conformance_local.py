"""The built-in grpc+local transport passes the conformance kit."""

import socket

from clusterwire.testing import Capabilities, TransportSuite


class TestLocalConformance(TransportSuite):
    protocol = "grpc+local"
    # Zero-copy: received buffers are read-only views of shared memory.
    # No trickling through a TCP proxy: a channel finds the Unix socket by the listener's
    # address (a proxy's has none), and bulk bytes travel as shared memory, not over a socket.
    # Peers are told apart by their Unix user ("uid:N").
    capabilities = Capabilities(writable_buffers=False, trickle_via_proxy=False, peers="uid")

    def unix_endpoint(self, listener):
        return socket.SOCK_SEQPACKET, listener.unix_address
