"""The one answer every listener gives a call it cannot serve: a client of another
clusterwire protocol (``grpc://`` to a grpc+local task, ``grpc+local://`` to a grpc task...)
or a peer that is no clusterwire client. Transports only detect such a call; this module
says what the caller is told, at once and not retried: the protocol served and the target to
use, nothing more (a peer without the cluster token learns only the protocol's name)."""

from __future__ import annotations

from clusterwire import errors
from clusterwire.transport import HandshakeFailed


def wrong_protocol(served: str) -> errors.UnimplementedError:
    """The error for a call of another protocol to a listener serving ``served``:
    UnimplementedError, what gRPC answers a method a server does not serve."""
    return errors.UnimplementedError(
        f"This server serves {served}, not the protocol of this call: use "
        f"{served}://HOST:PORT as the target.")


def not_spoken(spoken: str, address: str, detail: str) -> HandshakeFailed:
    """The error of a client whose peer at ``address`` answered in something other than
    ``spoken`` (a listener of another protocol that cannot say so in it, e.g. ``zmq``):
    not retried, as no retry can change it."""
    return HandshakeFailed(
        f"{address} does not speak {spoken} ({detail}): it serves another protocol (e.g. "
        "zmq) or is no clusterwire server; check the target's protocol (`clusterwire "
        "plugins` lists them).")


def is_wrong_protocol(message: str) -> bool:
    """Whether ``message`` is a listener's ``wrong_protocol`` answer."""
    return message.startswith("This server serves ") and "not the protocol of this call" in message
