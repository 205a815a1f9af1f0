"""gRPC status codes and failures as clusterwire errors."""

from __future__ import annotations

import grpc

from clusterwire import errors
from clusterwire.addressing import split_host_port
from clusterwire.security import Security
from clusterwire.transport import ConnectionFailed, HandshakeFailed
from clusterwire.wrong_protocol import not_spoken


def grpc_error(err: grpc.RpcError, address: str,
               security: Security | None = None) -> errors.OpError:
    """The clusterwire error for a gRPC failure talking to ``address`` with ``security``."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    lowered = details.lower()
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
    return errors.error_from_code(code.value[0], details)


def _reason(details: str) -> str:
    return details.rsplit(":", 2)[-2].strip() if details.count(":") >= 2 else details


def status_code(code: int) -> tuple[int, str]:
    """The grpc.StatusCode value of a clusterwire error code."""
    return next(s.value for s in grpc.StatusCode if s.value[0] == code)
