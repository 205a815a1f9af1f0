"""User functions of a dataset as they travel: importable ``module:qualname`` references.

A worker imports the module and looks the name up, so no code is shipped.
A lambda, a nested function or a function of ``__main__`` has no name that a
worker could import: that is an error explaining the fix, unless cloudpickle
is explicitly allowed on the dispatcher and the workers (``allow_cloudpickle``;
unsafe: unpickling runs arbitrary code from whoever can reach the service).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from clusterwire.errors import InvalidArgumentError, NotFoundError

_FIX = ("Define it at module level in a module the workers can import (then it travels as "
        "'module:qualname'), or start the dispatcher and workers with allow_cloudpickle=True "
        "(--allow-cloudpickle; unsafe: workers then run pickled code from any client).")


def reference(fn: Callable[..., Any]) -> str | None:
    """``"module:qualname"`` if a worker can import ``fn`` back, else None."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        return f"{module}:{qualname}" if resolve(f"{module}:{qualname}") is fn else None
    except (NotFoundError, InvalidArgumentError):
        return None


def describe(fn: Callable[..., Any]) -> str:
    """A short human name of ``fn`` for error messages."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{getattr(fn, '__module__', '?')}.{name}"


def not_importable(fn: Callable[..., Any]) -> InvalidArgumentError:
    """The error for a function that cannot travel by reference."""
    return InvalidArgumentError(
        f"Function {describe(fn)} cannot be sent to tf.data service workers: it is a lambda, "
        f"a nested function or defined in __main__, so workers cannot import it. {_FIX}")


@functools.lru_cache(maxsize=256)
def resolve(name: str) -> Callable[..., Any]:
    """The function a ``module:qualname`` reference names."""
    module_name, sep, qualname = name.partition(":")
    if not sep or not module_name or not qualname:
        raise InvalidArgumentError(f"Malformed function reference {name!r}; expected "
                                   "'module:qualname'.")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise NotFoundError(
            f"Cannot import module {module_name!r} for function {name!r}: {err}. Install or "
            "put that module on the worker's PYTHONPATH.") from None
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise NotFoundError(f"Module {module_name!r} has no {qualname!r} (for function "
                                f"{name!r}).") from None
    if not callable(target):
        raise InvalidArgumentError(f"{name!r} is not callable.")
    return target


def pickle_function(fn: Callable[..., Any]) -> bytes:
    """cloudpickle bytes of ``fn`` (for servers that allow cloudpickle)."""
    try:
        import cloudpickle
    except ImportError:
        raise not_importable(fn) from None
    return cloudpickle.dumps(fn)


def not_allowed(what: str) -> InvalidArgumentError:
    """The error for a pickled function reaching a server that does not allow cloudpickle."""
    return InvalidArgumentError(
        f"The dataset's function {what} is a lambda, a nested function or defined in "
        f"__main__ (sent pickled), and this tf.data service does not allow cloudpickle. {_FIX}")


def unpickle_function(data: bytes, allowed: bool, what: str) -> Callable[..., Any]:
    """The function pickled in ``data``; InvalidArgumentError unless ``allowed``."""
    if not allowed:
        raise not_allowed(what)
    try:
        import cloudpickle
    except ImportError:
        raise InvalidArgumentError(
            "allow_cloudpickle is set but cloudpickle is not installed here: "
            "pip install 'clusterwire[cloudpickle]'.") from None
    return cloudpickle.loads(data)
