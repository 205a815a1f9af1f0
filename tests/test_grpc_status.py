"""gRPC failures to clusterwire errors, by type: a clusterwire server's refusal carries its
error code (and "busy") in trailing metadata, which the client maps before anything else;
without them gRPC's status code maps type to type, and gRPC's own connection texts are
matched only for UNAVAILABLE."""

from __future__ import annotations

import grpc
import pytest

from clusterwire import errors
from clusterwire.transport import HandshakeFailed
from clusterwire.transports._grpc_common.status import (
    BUSY_KEY,
    ERROR_CODE_KEY,
    abort,
    grpc_error,
    is_busy,
)


class Failed(grpc.RpcError):
    """What a gRPC call raises: a status code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers=()):
        self._code, self._details, self._trailers = code, details, tuple(trailers)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._trailers


class Context:
    """The part of a ServicerContext that ``abort`` uses."""

    def set_trailing_metadata(self, metadata) -> None:
        self.trailers = metadata

    def abort(self, code: grpc.StatusCode, details: str):
        raise Failed(code, details, self.trailers)


def refused(error: errors.OpError, busy: bool = False) -> Failed:
    with pytest.raises(Failed) as caught:
        abort(Context(), error, busy)
    return caught.value


@pytest.mark.parametrize("error", [
    errors.ResourceExhaustedError("full"), errors.UnavailableError("failed to connect: x"),
    errors.UnimplementedError("wrong protocol"), errors.NotFoundError("gone"),
    errors.UnauthenticatedError("no token")])
def test_a_refusal_comes_back_as_the_error_it_was(error):
    failure = refused(error)
    assert failure.code().value[0] == error.error_code
    back = grpc_error(failure, "127.0.0.1:1")
    assert type(back) is type(error) and back.message == error.message
    assert not is_busy(failure)


def test_busy_is_metadata_not_text():
    assert is_busy(refused(errors.ResourceExhaustedError("all threads working"), busy=True))
    # gRPC's own RESOURCE_EXHAUSTED (a message too large) is not a refusal to retry, whatever
    # its text says.
    assert not is_busy(Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "Busy: the threads ..."))


def test_the_servers_code_wins_over_grpcs_status_and_text():
    failure = Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses",
                     [(ERROR_CODE_KEY, str(errors.FailedPreconditionError.error_code))])
    assert type(grpc_error(failure, "h:1")) is errors.FailedPreconditionError


@pytest.mark.parametrize("code", ["abc", "999", "", "-1"])
def test_a_malformed_code_falls_back_to_the_status(code):
    failure = Failed(grpc.StatusCode.NOT_FOUND, "gone", [(ERROR_CODE_KEY, code),
                                                          (BUSY_KEY, "yes")])
    assert type(grpc_error(failure, "h:1")) is errors.NotFoundError
    assert not is_busy(failure)


@pytest.mark.parametrize(("status", "expected"), [
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceededError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError),
    (grpc.StatusCode.UNIMPLEMENTED, errors.UnimplementedError),
    (grpc.StatusCode.INTERNAL, errors.InternalError),
    (grpc.StatusCode.CANCELLED, errors.CancelledError)])
def test_grpcs_own_failures_map_type_to_type(status, expected):
    assert type(grpc_error(Failed(status, "x"), "h:1")) is expected


def test_grpcs_connection_texts_are_matched_for_unavailable_only():
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:x: Socket closed"
    assert isinstance(grpc_error(Failed(grpc.StatusCode.UNAVAILABLE, closed), "h:1"),
                      HandshakeFailed)
    assert type(grpc_error(Failed(grpc.StatusCode.INTERNAL, closed), "h:1")) is \
        errors.InternalError
