"""The security flags of the ``clusterwire`` commands, one definition for servers and clients:
the same names as ``clusterwire.security``'s options (``--auth-token-file`` is
``auth_token_file``), so a command's flags are its ``load_security`` options."""

from __future__ import annotations

import argparse
from typing import Any

from clusterwire.security import security_fields

_CONTEXT = ("the CLUSTERWIRE_* environment and plugins.toml's [security] apply too (the token "
            "itself only from a file or CLUSTERWIRE_AUTH_TOKEN)")


def add_security_arguments(parser: argparse.ArgumentParser, server: bool) -> None:
    """Add the security flags of a ``server`` command (its certificate, the CA that checks
    its clients) or of a client command (the CA that checks servers, its own certificate
    for mutual TLS)."""
    group = parser.add_argument_group(
        "security", f"as Server's; {_CONTEXT}" if server else
        f"what the servers asked require: their token and TLS; {_CONTEXT}")
    group.add_argument("--auth-token-file", metavar="FILE",
                       help="file holding the cluster token every request must carry" if server
                       else "file holding the cluster token (the servers' auth_token_file)")
    group.add_argument("--tls-cert-file", metavar="PEM",
                       help="this server's certificate" if server
                       else "this client's certificate, for servers that require one")
    group.add_argument("--tls-key-file", metavar="PEM",
                       help="this server's private key" if server
                       else "this client's private key (with --tls-cert-file)")
    group.add_argument("--tls-ca-file", metavar="PEM",
                       help="CA that checks peers" if server else "CA that checks the servers")
    if server:
        group.add_argument("--tls-client-auth", action="store_true", default=None,
                           help="require client certificates (mutual TLS)")


def security_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``load_security`` options the security flags of ``args`` give (unset: None)."""
    return {name: getattr(args, name, None) for name in security_fields()}
