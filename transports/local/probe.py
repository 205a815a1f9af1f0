"""Is a port whose grpc+local Unix name nobody holds served by another protocol?

A grpc+local client reaches calls over a Unix name derived from the port; a grpc or
grpc+verbs server on that port holds no such name, so the connection is refused as if
nothing served there. One gRPC call to the port tells the two apart: a listener of another
protocol answers it with ``clusterwire.wrong_protocol``'s error, which the client raises at
once instead of retrying an address that will never serve grpc+local.
"""

from __future__ import annotations

import time

import grpc

from clusterwire import errors
from clusterwire.security import Security
from clusterwire.transport import HandshakeFailed
from clusterwire.transports._grpc_common.client import open_channel, token_metadata
from clusterwire.transports._grpc_common.status import grpc_error
from clusterwire.wrong_protocol import is_wrong_protocol

#: The longest a probe waits for the port's answer (a listener answers at once).
PROBE_TIMEOUT_S = 1.0
_METHOD = "/clusterwire.Local/Call"


def other_protocol(address: str, security: Security,
                   deadline: float | None) -> errors.OpError | None:
    """The wrong-protocol error the gRPC listener at ``address`` answers a grpc+local call
    with, or the handshake failure of a port that speaks no gRPC (a ``zmq`` task); None if
    nothing listens there, it is a grpc+local server, or no answer came in time."""
    timeout = PROBE_TIMEOUT_S if deadline is None else min(
        PROBE_TIMEOUT_S, deadline - time.monotonic())
    if timeout <= 0:
        return None
    channel = open_channel(address, security)
    try:
        channel.unary_unary(_METHOD)(b"", timeout=timeout, metadata=token_metadata(security))
    except grpc.RpcError as err:
        answer = grpc_error(err, address, security)
        # A handshake failure: the port holds a server, but none a grpc+local client speaks to.
        return (answer if is_wrong_protocol(answer.message) or isinstance(answer, HandshakeFailed)
                else None)
    finally:
        channel.close()
    return None
