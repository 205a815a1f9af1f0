"""Security over zmq: the cluster token is checked at connect time; TLS is refused loudly."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from clusterwire_zmq import auth
from zmq_test_support import channel_to, serving, zmq_transport

from clusterwire import Server, Session, errors
from clusterwire.security import Security, TlsConfig
from clusterwire.transport import Frame, ListenOptions

pytestmark = pytest.mark.timeout(60)
TOKEN = b"0123456789abcdef" * 2


def test_tls_is_unimplemented_for_listeners_and_channels():
    tls = Security(tls=TlsConfig(certificate_chain=b"c", private_key=b"k"))
    with pytest.raises(errors.UnimplementedError, match="X.509"):
        zmq_transport().listen("127.0.0.1:0", lambda f: f, ListenOptions(security=tls))
    with pytest.raises(errors.UnimplementedError, match="TLS"):
        zmq_transport().connect("127.0.0.1:1", Security(tls=TlsConfig(root_certificates=b"r")))


def test_a_server_asked_for_tls_refuses_to_start(tmp_path):
    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_bytes(b"-----BEGIN PLACEHOLDER-----\n")
    config = {"tls_cert_file": str(tmp_path / "cert.pem"),
              "tls_key_file": str(tmp_path / "key.pem")}
    with pytest.raises(errors.UnimplementedError):
        Server({"w": ["127.0.0.1:0"]}, protocol="zmq", config=config)


def test_refused_clients_never_reach_the_handler():
    handled: list[Frame] = []

    def handler(frame: Frame) -> Frame:
        handled.append(frame)
        return frame

    options = ListenOptions(security=Security(token=TOKEN))
    with serving(handler, options) as listener:
        for presented in (None, b"wrong-token-of-32-bytes-length!!"):
            with channel_to(listener.address, Security(token=presented)) as channel:
                started = time.monotonic()
                with pytest.raises(errors.UnauthenticatedError):
                    channel.call(Frame(b"no", [np.zeros(1 << 20, np.uint8)]), timeout=10)
                assert time.monotonic() - started < 2  # refused at once, not at the deadline
        assert handled == []
        with channel_to(listener.address, Security(token=TOKEN)) as channel:
            assert bytes(channel.call(Frame(b"yes", [b"1"]), timeout=10).header) == b"yes"
        assert len(handled) == 1


def test_a_client_with_a_token_may_use_an_open_listener():
    with serving() as listener, channel_to(listener.address, Security(token=TOKEN)) as channel:
        assert bytes(channel.call(Frame(b"open", []), timeout=10).header) == b"open"


def test_sessions_with_and_without_the_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    config = {"auth_token_file": str(token_file)}
    with Server({"w": ["127.0.0.1:0"]}, protocol="zmq", config=config) as server:
        assert server.secure
        with Session(server.target, config=config, timeout=10) as session:
            session.put("x", 5)
            assert session.get("x") == 5
        with Session(server.target, timeout=10) as stranger:
            started = time.monotonic()
            with pytest.raises(errors.UnauthenticatedError):
                stranger.get("x")
            assert time.monotonic() - started < 2  # not retried until the deadline


def test_tokens_longer_than_plain_allows_are_invalid():
    with pytest.raises(errors.InvalidArgumentError, match="255"), \
            channel_to("127.0.0.1:1", Security(token=b"t" * 256)) as channel:
        channel.call(Frame(b"", []), timeout=1)


@pytest.mark.parametrize("request_frames,status", [
    ([b"1.0", b"7", b"clusterwire", b"127.0.0.1", b"", b"PLAIN", b"clusterwire", TOKEN], b"200"),
    ([b"1.0", b"7", b"clusterwire", b"127.0.0.1", b"", b"PLAIN", b"clusterwire", b"x"], b"400"),
    ([b"1.0", b"7", b"clusterwire", b"127.0.0.1", b"", b"NULL"], b"400"),
    ([b"1.0", b"7", b"clusterwire", b"127.0.0.1", b"", b"PLAIN", b"only-user"], b"400"),
    ([b"1.0"], b"400"),
    ([], b"400"),
])
def test_the_zap_handler_answers_every_request_shape(request_frames, status):
    context = zmq.Context()
    try:
        gate = auth.TokenGate(context, Security(token=TOKEN))
        try:
            reply = gate.answer(request_frames)
        finally:
            gate.close()
    finally:
        context.term()
    assert reply[2] == status and len(reply) == 6
