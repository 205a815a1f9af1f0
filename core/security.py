"""Transport security settings: TLS certificates and the shared cluster token.

Sources, in order of precedence: explicit options (``ServerOptions`` fields
or a Session's ``config``), then environment variables, then the
``[security]`` table of plugins.toml. The token is read from a file or the
environment, never from a command-line argument.

Environment: ``CLUSTERWIRE_AUTH_TOKEN`` (the secret itself),
``CLUSTERWIRE_AUTH_TOKEN_FILE``, ``CLUSTERWIRE_TLS_CERT_FILE``,
``CLUSTERWIRE_TLS_KEY_FILE``, ``CLUSTERWIRE_TLS_CA_FILE``,
``CLUSTERWIRE_TLS_CLIENT_AUTH`` ("1" to require client certificates).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clusterwire.errors import InvalidArgumentError, NotFoundError, UnauthenticatedError
from clusterwire.plugins import get_plugin_manager

#: Metadata key / field under which a request carries the cluster token.
TOKEN_KEY = "clusterwire-token"

_FIELDS = ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_client_auth", "auth_token_file")


@dataclass(frozen=True)
class TlsConfig:
    """PEM material for one side of a TLS connection.

    A server needs ``certificate_chain`` and ``private_key``; with
    ``require_client_auth`` it also needs ``root_certificates`` to check
    client certificates (mutual TLS). A client needs ``root_certificates``
    to check the server, and its own certificate and key for mutual TLS.
    """

    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    root_certificates: bytes | None = None
    require_client_auth: bool = False


@dataclass(frozen=True)
class Security:
    """What a transport must enforce: TLS (if set) and the cluster token (if set)."""

    tls: TlsConfig | None = None
    token: bytes | None = None

    def check_token(self, presented: bytes | str | None) -> None:
        """UnauthenticatedError unless ``presented`` equals the token (constant time)."""
        if self.token is None:
            return
        if not same_secret(self.token, presented):
            raise UnauthenticatedError(
                "Missing or wrong cluster token: give this client the cluster's secret "
                "(CLUSTERWIRE_AUTH_TOKEN or CLUSTERWIRE_AUTH_TOKEN_FILE, or auth_token_file).")

    @property
    def secure(self) -> bool:
        """True when TLS or a token is configured."""
        return self.tls is not None or self.token is not None


def same_secret(expected: bytes, presented: bytes | str | None) -> bool:
    """``presented`` is ``expected`` (compared in constant time; empty never is)."""
    if isinstance(presented, str):
        presented = presented.encode()
    return bool(presented) and hmac.compare_digest(presented, expected)


def read_secret(path: str | None, value: str | None, what: str) -> bytes | None:
    """The secret in the file at ``path`` (first) or ``value`` (an environment variable's);
    None when neither is set; InvalidArgumentError when it is shorter than 16 bytes."""
    secret = _read(path, f"{what} file").strip() if path else (
        value.encode() if value else None)
    if secret is not None and len(secret) < 16:
        raise InvalidArgumentError(
            f"The {what} is shorter than 16 bytes; use a random secret, e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`.")
    return secret


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as err:
        raise NotFoundError(f"Cannot read the {what} {path!r}: {err.strerror}.") from None


def _settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """Merge explicit options over the environment over plugins.toml's [security]."""
    merged: dict[str, Any] = dict(get_plugin_manager().security_options())
    env = {"tls_cert_file": "CLUSTERWIRE_TLS_CERT_FILE", "tls_key_file": "CLUSTERWIRE_TLS_KEY_FILE",
           "tls_ca_file": "CLUSTERWIRE_TLS_CA_FILE",
           "tls_client_auth": "CLUSTERWIRE_TLS_CLIENT_AUTH",
           "auth_token_file": "CLUSTERWIRE_AUTH_TOKEN_FILE"}
    for key, variable in env.items():
        if os.environ.get(variable):
            merged[key] = os.environ[variable]
    for key in _FIELDS:
        if options.get(key):
            merged[key] = options[key]
    unknown = set(merged) - set(_FIELDS)
    if unknown:
        raise InvalidArgumentError(
            f"Unknown security option(s) {sorted(unknown)}; known: {', '.join(_FIELDS)}.")
    return merged


def load_security(options: Mapping[str, Any] | None = None) -> Security:
    """Build the Security of a server or client from options, environment and plugins.toml."""
    settings = _settings(options or {})
    token = read_secret(settings.get("auth_token_file"),
                        os.environ.get("CLUSTERWIRE_AUTH_TOKEN"), "cluster token")
    tls = None
    cert, key, ca = (settings.get(k) for k in ("tls_cert_file", "tls_key_file", "tls_ca_file"))
    client_auth = str(settings.get("tls_client_auth", "")).lower() in ("1", "true", "yes")
    if bool(cert) != bool(key):
        raise InvalidArgumentError("TLS needs both tls_cert_file and tls_key_file (or neither).")
    if client_auth and not ca:
        raise InvalidArgumentError("tls_client_auth needs tls_ca_file to check clients.")
    if cert or ca:
        tls = TlsConfig(
            certificate_chain=_read(cert, "TLS certificate") if cert else None,
            private_key=_read(key, "TLS private key") if key else None,
            root_certificates=_read(ca, "TLS CA certificate") if ca else None,
            require_client_auth=client_auth)
    return Security(tls=tls, token=token)


def security_fields() -> tuple[str, ...]:
    """The option names load_security understands."""
    return _FIELDS
