"""clusterwire.testing: the conformance kit every transport plugin runs against itself.

A plugin's whole test file can be::

    from clusterwire.testing import Capabilities, TransportSuite

    class TestMyTransport(TransportSuite):
        protocol = "myproto"
        capabilities = Capabilities(raw_tcp_port=True)

pytest then runs every conformance check (payload shapes up to 256 MiB,
concurrency, deadlines, cancellation, killed peers, stop with calls in
flight, closed ports, size limits, malformed input, port 0, and a real
3-process cluster over the protocol) against that transport. Capability
flags switch off the checks for what a transport does not support.
"""

from clusterwire.testing.suite import Capabilities, TransportSuite

__all__ = ["Capabilities", "TransportSuite"]
