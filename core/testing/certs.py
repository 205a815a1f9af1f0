"""Throwaway X.509 material for TLS checks, generated at test time (needs `cryptography`)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Pair:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key) -> Pair:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return Pair(cert_path, key_path)


class Authority:
    """A certificate authority that issues server and client certificates."""

    def __init__(self, directory: Path, name: str = "clusterwire test CA"):
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(days=1))
                     .not_valid_after(now + datetime.timedelta(days=30))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .sign(self.key, hashes.SHA256()))
        self.pair = _write(directory, name.replace(" ", "_"), self.cert, self.key)

    def issue(self, stem: str, expired: bool = False) -> Pair:
        """A certificate for 127.0.0.1 / localhost (also usable as a client certificate)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        start, end = ((now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
                      if expired else (now - datetime.timedelta(days=1),
                                       now + datetime.timedelta(days=30)))
        san = x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                           x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        cert = (x509.CertificateBuilder().subject_name(_name(stem)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end).add_extension(san, False)
                .sign(self.key, hashes.SHA256()))
        return _write(self.directory, stem, cert, key)
