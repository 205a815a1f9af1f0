"""The built-in grpc+local transport passes the conformance kit."""

import socket

from clusterwire.testing import Capabilities, TransportSuite


class TestLocalConformance(TransportSuite):
    protocol = "grpc+local"
    # Zero-copy: received buffers are read-only views of shared memory.
    # Its gRPC port is gRPC core's: it accepts in C and can only refuse the newest
    # connection over its quota, never close a chosen pending one (its Unix socket does).
    # No trickling through a TCP proxy: a channel finds the Unix socket by the listener's
    # address (a proxy's has none), and bulk bytes travel as shared memory, not over a socket.
    capabilities = Capabilities(writable_buffers=False, evicts_oldest_pending_tcp=False,
                                trickle_via_proxy=False)

    def unix_endpoint(self, listener):
        return socket.SOCK_SEQPACKET, listener.unix_address
