"""clusterwire's error hierarchy: the names and codes of ``tf.errors``.

Every layer raises these; a user never sees a transport's own exception (for
example a raw ``grpc.RpcError``). Codes equal gRPC's status codes, so mapping
to and from a transport status is the identity on the number.

Like TensorFlow's, the constructors accept ``(node_def, op, message)``; as a
convenience a single argument, or the keyword ``message``, is taken as the message.
"""

from __future__ import annotations

from typing import Any

OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16
#: The codes' names ("OK", "NOT_FOUND", ...), by code.
CODE_NAMES: dict[int, str] = {code: name for name, code in dict(globals()).items()
                              if name.isupper() and isinstance(code, int)}


class OpError(Exception):
    """The base of every clusterwire error; ``error_code`` is a tf.errors code.

    ``retry_later``: the server refused the request only because a table of its is full
    now (nothing of the request was done), so the same request may succeed later; carried
    over the wire as the status's ``retry_later``, so callers decide by it, never by text.
    """

    error_code: int = UNKNOWN

    def __init__(self, *args: Any, message: Any = None, error_code: int | None = None,
                 retry_later: bool = False):
        if message is not None and not args:  # as torch's DataLoader re-raises a worker's error
            args = (message,)
        if len(args) == 1:
            node_def, op, message = None, None, args[0]
        elif len(args) >= 3:
            node_def, op, message = args[0], args[1], args[2]
            if len(args) >= 4 and error_code is None and type(self) is OpError:
                error_code = args[3]
        else:
            raise TypeError("OpError takes (message) or (node_def, op, message[, error_code])")
        super().__init__(message)
        self._node_def = node_def
        self._op = op
        self._message = str(message)
        if error_code is not None:
            self.error_code = int(error_code)
        self.retry_later = bool(retry_later)

    @property
    def message(self) -> str:
        """The error message."""
        return self._message

    @property
    def node_def(self):
        """Kept for TensorFlow compatibility; always None in clusterwire."""
        return self._node_def

    @property
    def op(self):
        """Kept for TensorFlow compatibility; always None in clusterwire."""
        return self._op

    def __str__(self) -> str:
        return self._message

    def __reduce__(self):
        return (error_from_code, (self.error_code, self._message, self.retry_later))


class CancelledError(OpError):
    """The operation was cancelled (for example by ``Server.stop``)."""

    error_code = CANCELLED


class UnknownError(OpError):
    """An error of no known kind, including an exception raised by a remote function."""

    error_code = UNKNOWN


class InvalidArgumentError(OpError):
    """An argument was invalid; the message names it and the fix."""

    error_code = INVALID_ARGUMENT


class DeadlineExceededError(OpError):
    """A deadline passed before the operation completed."""

    error_code = DEADLINE_EXCEEDED


class NotFoundError(OpError):
    """A named entity (tensor, function, protocol, job) does not exist."""

    error_code = NOT_FOUND


class AlreadyExistsError(OpError):
    """An entity that should be created already exists."""

    error_code = ALREADY_EXISTS


class PermissionDeniedError(OpError):
    """The caller may not run the operation."""

    error_code = PERMISSION_DENIED


class ResourceExhaustedError(OpError):
    """A limit (message size, memory, concurrency) was reached."""

    error_code = RESOURCE_EXHAUSTED


class FailedPreconditionError(OpError):
    """The system is not in a state that allows the operation."""

    error_code = FAILED_PRECONDITION


class AbortedError(OpError):
    """The operation was aborted, for example by a concurrent conflict."""

    error_code = ABORTED


class OutOfRangeError(OpError):
    """An iteration or index went past the valid range."""

    error_code = OUT_OF_RANGE


class UnimplementedError(OpError):
    """The operation is not implemented or not supported by this transport."""

    error_code = UNIMPLEMENTED


class InternalError(OpError):
    """An internal invariant was broken."""

    error_code = INTERNAL


class UnavailableError(OpError):
    """The peer is unreachable or not (yet) serving; retrying may succeed."""

    error_code = UNAVAILABLE


class DataLossError(OpError):
    """Data was lost or corrupted."""

    error_code = DATA_LOSS


class UnauthenticatedError(OpError):
    """The request lacks valid credentials."""

    error_code = UNAUTHENTICATED


class RemoteFunctionError(UnknownError):
    """A remote function raised; carries the remote exception's type and traceback text."""

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = f"{self.remote_type}: {self._message}" if self.remote_type else self._message
        if self.remote_traceback:
            text += "\n\nRemote traceback:\n" + self.remote_traceback
        return text

    def __reduce__(self):
        return (RemoteFunctionError, (self._message, self.remote_type, self.remote_traceback))


_BY_CODE: dict[int, type[OpError]] = {
    cls.error_code: cls
    for cls in (
        CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError,
        NotFoundError, AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError,
        FailedPreconditionError, AbortedError, OutOfRangeError, UnimplementedError,
        InternalError, UnavailableError, DataLossError, UnauthenticatedError,
    )
}


def exception_type_from_error_code(error_code: int) -> type[OpError]:
    """The error class for a tf.errors / gRPC status code (as ``tf.errors`` has)."""
    return _BY_CODE.get(int(error_code), UnknownError)


def error_code_from_exception_type(cls: type[OpError]) -> int:
    """The tf.errors code of an error class."""
    return cls.error_code


def error_from_code(error_code: int, message: str, retry_later: bool = False) -> OpError:
    """An error instance of the class that matches ``error_code``."""
    return exception_type_from_error_code(error_code)(message, retry_later=retry_later)
