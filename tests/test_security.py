"""TLS and the cluster token through Server and Session, for every built-in protocol."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import child_env

from clusterwire import Server, Session
from clusterwire.cli import is_loopback
from clusterwire.errors import (
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from clusterwire.local_cluster import LocalCluster
from clusterwire.security import load_security
from clusterwire.testing.certs import Authority

PROTOCOLS = ["grpc", "grpc+local"]
try:
    import ucxx  # noqa: F401

    PROTOCOLS.append("grpc+verbs")
except ImportError:
    pass

TOKEN = "s3cret-cluster-token-0123456789abcdef"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    authority = Authority(directory)
    token = directory / "token"
    token.write_text(TOKEN + "\n")
    wrong = directory / "wrong-token"
    wrong.write_text("not-the-cluster-token-at-all-0000\n")
    return {"ca": authority, "server": authority.issue("server"),
            "client": authority.issue("client"), "expired": authority.issue("old", expired=True),
            "token": str(token), "wrong": str(wrong), "dir": directory}


def server_config(pki, tls=True, token=True, client_auth=False, pair="server"):
    config = {}
    if tls:
        config.update(tls_cert_file=str(pki[pair].cert), tls_key_file=str(pki[pair].key),
                      tls_ca_file=str(pki["ca"].pair.cert), tls_client_auth=client_auth)
    if token:
        config["auth_token_file"] = pki["token"]
    return config


def client_config(pki, tls=True, token="token", cert=None):
    config = {}
    if tls:
        config["tls_ca_file"] = str(pki["ca"].pair.cert)
    if cert:
        config.update(tls_cert_file=str(pki[cert].cert), tls_key_file=str(pki[cert].key))
    if token:
        config["auth_token_file"] = pki[token]
    return config


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_tls_and_token_accept_the_right_client(pki, protocol):
    with Server({"w": ["127.0.0.1:0"]}, protocol=protocol, config=server_config(pki)) as server:
        assert server.secure
        with Session(server.target, config=client_config(pki)) as session:
            session.put("x", np.arange(300_000))
            assert session.get("x").sum() == np.arange(300_000).sum()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("token", [None, "wrong"])
def test_missing_or_wrong_token_is_unauthenticated_and_does_nothing(pki, protocol, token):
    with Server({"w": ["127.0.0.1:0"]}, protocol=protocol,
                config=server_config(pki, tls=False)) as server:
        with Session(server.target, config=client_config(pki, tls=False, token=token)) as rogue:
            with pytest.raises(UnauthenticatedError, match="cluster token"):
                rogue.put("planted", np.ones(1 << 20))
            with pytest.raises(UnauthenticatedError):
                rogue.status()
        with Session(server.target, config=client_config(pki, tls=False)) as session:
            assert session.list() == []


def test_token_from_the_environment(pki, monkeypatch):
    with Server({"w": ["127.0.0.1:0"]}, config=server_config(pki, tls=False)) as server:
        monkeypatch.setenv("CLUSTERWIRE_AUTH_TOKEN", TOKEN)
        with Session(server.target) as session:
            assert session.status()["job"] == "w"


def test_plaintext_client_against_tls_server_fails_fast(pki):
    with Server({"w": ["127.0.0.1:0"]}, config=server_config(pki, token=False)) as server:
        started = time.monotonic()
        with Session(server.target, timeout=30) as session:
            with pytest.raises(UnavailableError, match="requires\\s+TLS"):
                session.status()
        assert time.monotonic() - started < 5  # not retried until the 30 s deadline


@pytest.mark.parametrize("pair", ["expired"])
def test_expired_server_certificate_is_unauthenticated(pki, pair):
    with Server({"w": ["127.0.0.1:0"]}, config=server_config(pki, token=False, pair=pair)) as s:
        with Session(s.target, config=client_config(pki, token=None)) as session:
            with pytest.raises(UnauthenticatedError, match="certificate was refused.*expired"):
                session.status()


def test_wrong_ca_is_unauthenticated(pki, tmp_path):
    stranger = Authority(tmp_path, "stranger CA")
    with Server({"w": ["127.0.0.1:0"]}, config=server_config(pki, token=False)) as server:
        with Session(server.target, config={"tls_ca_file": str(stranger.pair.cert)}) as session:
            with pytest.raises(UnauthenticatedError, match="certificate was refused"):
                session.status()


def test_a_certificate_that_does_not_name_the_host_is_unauthenticated_at_once(pki):
    # The server's certificate names 127.0.0.1 and localhost, not 127.0.0.2.
    with Server({"w": ["127.0.0.2:0"]}, config=server_config(pki, token=False)) as server:
        started = time.monotonic()
        with Session(server.target, timeout=30, config=client_config(pki, token=None)) as s:
            with pytest.raises(UnauthenticatedError, match="names this host.*127.0.0.2"):
                s.status()
        assert time.monotonic() - started < 5


def test_mutual_tls_needs_a_client_certificate(pki):
    config = server_config(pki, token=False, client_auth=True)
    with Server({"w": ["127.0.0.1:0"]}, config=config) as server:
        with Session(server.target, config=client_config(pki, token=None, cert="client")) as ok:
            assert ok.status()["job"] == "w"
        started = time.monotonic()
        with Session(server.target, timeout=30,
                     config=client_config(pki, token=None)) as anonymous:
            with pytest.raises(UnauthenticatedError, match="requires a client certificate"):
                anonymous.status()
        assert time.monotonic() - started < 5  # not retried until the 30 s deadline
        expired = client_config(pki, token=None, cert="expired")
        with Session(server.target, config=expired) as old:
            with pytest.raises(UnavailableError):
                old.status()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_secure_multi_process_cluster_forwards_between_tasks(pki, protocol):
    config = server_config(pki, client_auth=True)
    with LocalCluster({"ps": 1, "worker": 1}, protocol=protocol, config=config,
                      env=child_env()) as cluster:
        with Session(cluster.target("worker"), config=cluster.client_config) as session:
            session.put("w", np.ones(200_000), task="/job:ps/task:0")
            assert session.get("w", task="/job:ps/task:0").sum() == 200_000
        with Session(cluster.target("worker"), config=client_config(pki, token=None,
                                                                    cert="client")) as rogue:
            with pytest.raises(UnauthenticatedError):
                rogue.get("w", task="/job:ps/task:0")


@pytest.mark.parametrize("options,error,match", [
    ({"auth_token_file": "/no/such/token"}, NotFoundError, "cluster token file"),
    ({"tls_cert_file": "/x.crt"}, InvalidArgumentError, "both tls_cert_file and tls_key_file"),
    ({"tls_client_auth": True}, InvalidArgumentError, "needs tls_ca_file"),
])
def test_bad_security_options(options, error, match):
    with pytest.raises(error, match=match):
        load_security(options)


def test_short_token_is_refused(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(InvalidArgumentError, match="shorter than 16 bytes"):
        load_security({"auth_token_file": str(short)})


def test_security_table_in_plugins_toml(pki, tmp_path, monkeypatch):
    config = tmp_path / "plugins.toml"
    config.write_text(f'[security]\nauth_token_file = "{pki["token"]}"\n')
    monkeypatch.setenv("CLUSTERWIRE_PLUGINS", str(config))
    from clusterwire.plugins import set_plugin_manager

    old = set_plugin_manager(None)
    try:
        assert load_security().token == TOKEN.encode()
    finally:
        set_plugin_manager(old)


def test_loopback_detection():
    assert all(map(is_loopback, ["127.0.0.1", "127.5.0.1", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "example.com", "::"]))


def test_serve_on_loopback_without_security_does_not_warn():
    proc = subprocess.Popen([sys.executable, "-m", "clusterwire", "serve", "--cluster",
                             '{"w": ["127.0.0.1:0"]}'], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("CLUSTERWIRE_READY")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert "WARNING" not in err


def test_a_server_beyond_loopback_warns_without_tls_or_token(caplog):
    from clusterwire.security import Security, TlsConfig
    from clusterwire.shell import listen_options, warn_if_exposed

    token = b"t" * 16
    with caplog.at_level("WARNING", logger="clusterwire"):
        warn_if_exposed("127.0.0.1", listen_options(), "Task A")
        warn_if_exposed("localhost", listen_options(), "Task A")
        assert not caplog.records
        warn_if_exposed("0.0.0.0", listen_options(), "Task B")
        warn_if_exposed("10.1.2.3", listen_options(security=Security(token=token)), "Task C")
        warn_if_exposed("10.1.2.3", listen_options(security=Security(
            token=token, tls=TlsConfig(b"cert", b"key"))), "Task D")
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "Task B listens on 0.0.0.0 without TLS or a cluster token" in messages[0]
    assert "Task C" in messages[1] and "travels in the clear" in messages[1]
