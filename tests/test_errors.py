"""The error hierarchy has tf.errors' names and codes (= gRPC status codes)."""

from __future__ import annotations

import pickle

import pytest

from clusterwire import errors

TF_CODES = {
    "CancelledError": 1, "UnknownError": 2, "InvalidArgumentError": 3,
    "DeadlineExceededError": 4, "NotFoundError": 5, "AlreadyExistsError": 6,
    "PermissionDeniedError": 7, "ResourceExhaustedError": 8, "FailedPreconditionError": 9,
    "AbortedError": 10, "OutOfRangeError": 11, "UnimplementedError": 12, "InternalError": 13,
    "UnavailableError": 14, "DataLossError": 15, "UnauthenticatedError": 16,
}


@pytest.mark.parametrize("name,code", sorted(TF_CODES.items()))
def test_names_codes_and_mapping(name, code):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.OpError)
    assert cls.error_code == code
    assert errors.exception_type_from_error_code(code) is cls
    assert errors.error_code_from_exception_type(cls) == code
    err = errors.error_from_code(code, "boom")
    assert type(err) is cls and err.message == "boom" and str(err) == "boom"


def test_tf_style_constructor_and_message_only():
    err = errors.NotFoundError(None, None, "missing")
    assert (err.node_def, err.op, err.message) == (None, None, "missing")
    assert errors.OpError(None, None, "x", errors.ABORTED).error_code == errors.ABORTED
    with pytest.raises(TypeError):
        errors.OpError("a", "b")


def test_message_as_a_keyword_as_torch_dataloader_reraises():
    err = errors.FailedPreconditionError(message="Caught it in DataLoader worker process 0.")
    assert err.message == str(err) == "Caught it in DataLoader worker process 0."
    assert err.error_code == errors.FAILED_PRECONDITION
    assert str(errors.RemoteFunctionError(message="raised")) == "raised"


def test_unknown_code_maps_to_unknown_error():
    assert errors.exception_type_from_error_code(99) is errors.UnknownError


def test_errors_pickle_with_their_class_and_message():
    err = pickle.loads(pickle.dumps(errors.UnavailableError("down")))
    assert type(err) is errors.UnavailableError and err.message == "down"
    remote = errors.RemoteFunctionError("bad", "builtins.ValueError", "Traceback ...")
    again = pickle.loads(pickle.dumps(remote))
    assert (again.remote_type, again.remote_traceback) == ("builtins.ValueError", "Traceback ...")
    assert isinstance(again, errors.UnknownError)


@pytest.mark.parametrize("retry_later", [False, True])
def test_retry_later_crosses_the_wire_and_pickles(retry_later):
    """A refusal for now is told by the status's retry_later flag, not by its text."""
    from clusterwire.rpc import parse_response, raise_for_status
    from clusterwire.shell import error_response

    sent = errors.ResourceExhaustedError("over its stream limits", retry_later=retry_later)
    with pytest.raises(errors.ResourceExhaustedError) as caught:
        raise_for_status(parse_response(error_response(sent)))
    assert caught.value.retry_later is retry_later
    assert caught.value.message == "over its stream limits"
    assert pickle.loads(pickle.dumps(sent)).retry_later is retry_later
    assert errors.ResourceExhaustedError("full").retry_later is False
