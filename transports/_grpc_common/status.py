"""gRPC status codes and failures as clusterwire errors, both ways.

A clusterwire server refuses a call with ``abort``: gRPC's status code of the error's class
(clusterwire's codes are TensorFlow's, which are gRPC's) plus two trailing metadata keys,
the error code and whether the refusal is only "busy" (nothing of the call was read: send
it again). A client maps a failed call with ``grpc_error``: by those keys when the server
set them, else by gRPC's status code, type to type; only where gRPC gives nothing but a
status UNAVAILABLE and a text (a connection that failed, a server's stop) is the text
matched, each match checked against the grpcio version named beside it.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.security import Security
from clusterwire.transport import ConnectionFailed, HandshakeFailed
from clusterwire.wrong_protocol import not_spoken

#: Trailing metadata of a refusal: clusterwire's error code, and "1" when it is only busy.
ERROR_CODE_KEY = "clusterwire-error-code"
BUSY_KEY = "clusterwire-busy"
_CODES = {status.value[0]: status for status in grpc.StatusCode}


def abort(context: grpc.ServicerContext, error: errors.OpError, busy: bool = False
          ) -> NoReturn:
    """Refuse the call of ``context`` with ``error`` (``busy``: nothing of it was read, and
    the client may send it again)."""
    metadata = [(ERROR_CODE_KEY, str(error.error_code))]
    if busy:
        metadata.append((BUSY_KEY, "1"))
    context.set_trailing_metadata(tuple(metadata))
    context.abort(_CODES.get(error.error_code, grpc.StatusCode.UNKNOWN), error.message)


def _trailers(err: grpc.RpcError) -> dict[str, str]:
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return {key: value for key, value in trailing or () if isinstance(value, str)}


def is_busy(err: grpc.RpcError) -> bool:
    """Whether a clusterwire server refused the call as busy (``abort(..., busy=True)``)."""
    return _trailers(err).get(BUSY_KEY) == "1"


def grpc_error(err: grpc.RpcError, address: str,
               security: Security | None = None) -> errors.OpError:
    """The clusterwire error for a gRPC failure talking to ``address`` with ``security``."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    ours = _trailers(err).get(ERROR_CODE_KEY, "")
    if ours.isdigit() and int(ours) in _CODES:  # a clusterwire server's refusal
        return errors.error_from_code(int(ours), details)
    lowered = details.lower()
    # gRPC's own texts below: checked against grpcio 1.85.3.
    if code == grpc.StatusCode.UNAVAILABLE and details == "Cancelling all calls":
        # What a gRPC server's stop() tells calls still running after the grace period.
        return errors.CancelledError(f"The server at {address} stopped during the call.")
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in lowered:
        if ("certificate_verify_failed" in lowered or "peer_did_not_return" in lowered
                or "verification check failed" in lowered):
            return errors.UnauthenticatedError(
                f"TLS to {address}: the certificate was refused ({_reason(details)}). Check "
                "tls_ca_file and that the certificate is current and names this host "
                f"({split_host_port(address)[0]}).")
        tls = security.tls if security is not None else None
        if lowered.endswith(": socket closed") and tls is not None and not tls.certificate_chain:
            return errors.UnauthenticatedError(
                f"TLS to {address}: the server closed the connection during the handshake; it "
                "requires a client certificate (mutual TLS), which this client does not "
                "present: set tls_cert_file and tls_key_file.")
        if "wrong_version_number" in lowered:
            return HandshakeFailed(
                f"TLS to {address} failed: the server does not speak TLS ({_reason(details)}).")
        if "socket closed" in lowered:
            return HandshakeFailed(
                f"{address} closed the connection at once: it holds its max_connections, or "
                "it requires TLS, or a client certificate, that this client does not present "
                "(then set tls_ca_file, and tls_cert_file/tls_key_file for mutual TLS).")
        if "failed parsing http/2" in lowered:
            return not_spoken("gRPC", address, "it answered the HTTP/2 preface with other bytes")
        return ConnectionFailed(f"cannot connect to {address}: {details}")
    return errors.error_from_code(code.value[0], details)  # type to type: same codes


def _reason(details: str) -> str:
    return details.rsplit(":", 2)[-2].strip() if details.count(":") >= 2 else details
