"""The one answer every listener gives a call it cannot serve: a client of another
clusterwire protocol (``grpc://`` to a grpc+local task, ``grpc+local://`` to a grpc task...)
or a peer that is no clusterwire client. Transports only detect such a call; this module
says what the caller is told, at once and not retried: the protocol served and the target to
use, nothing more (a peer without the cluster token learns only the protocol's name)."""

from __future__ import annotations

from clusterwire import errors


def wrong_protocol(served: str) -> errors.FailedPreconditionError:
    """The error for a call of another protocol to a listener serving ``served``."""
    return errors.FailedPreconditionError(
        f"This server serves {served}, not the protocol of this call: use "
        f"{served}://HOST:PORT as the target.")


def is_wrong_protocol(err: errors.OpError) -> bool:
    """Whether ``err`` is a listener's ``wrong_protocol`` answer."""
    return (isinstance(err, errors.FailedPreconditionError)
            and err.message.startswith("This server serves ")
            and "not the protocol of this call" in err.message)
