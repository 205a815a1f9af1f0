"""moto's AWS server on 127.0.0.1 for the tests that talk to EC2 and S3, and the environment a
boto3 user (a resolver, a worker) would have pointed at it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    """A ThreadedMotoServer on a free loopback port: its URL, the server stopped after."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def point_aws_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """boto3's usual configuration through the environment, every call going to ``url``: no
    endpoint argument is needed, and no real credentials, profile or metadata are read."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url,
                        "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1",
                        "AWS_CONFIG_FILE": "/nonexistent",
                        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
