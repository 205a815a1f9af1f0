"""Functions that servers may run on behalf of remote callers.

Only functions registered here run remotely: a request names a function,
never ships code. ``@remote`` registers under the module-qualified name
(``"package.module.function"``); every server in the process serves the
registry, so a function must be imported (for ``clusterwire serve``:
``--import MODULE``) in the process of the task that should run it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from clusterwire.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError

F = TypeVar("F", bound=Callable[..., Any])

_registry: dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()


def qualified_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, the name it is registered under by default.

    A function of the script being run (module ``__main__``) is named after the script's
    importable module (``myscript.double``), which is what a task that imports the script
    (``clusterwire serve --import myscript``) registers.
    """
    module = fn.__module__
    if module == "__main__":
        module = _main_module_name() or module
    return f"{module}.{fn.__qualname__}"


def _main_module_name() -> str | None:
    """The name under which the running script's module can be imported, if it has one."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return spec.name  # python -m package.module
    path = getattr(main, "__file__", None)
    return os.path.splitext(os.path.basename(path))[0] if path else None


def remote(fn: F | None = None, *, name: str | None = None) -> F | Callable[[F], F]:
    """Register ``fn`` as callable through ``Session.call``; usable as ``@remote``.

    ``@remote(name="train.step")`` chooses the name. Registering another
    function under a taken name raises AlreadyExistsError.
    """

    def register(func: F) -> F:
        if not callable(func):
            raise InvalidArgumentError(f"@remote needs a function, got {func!r}")
        key = name or qualified_name(func)
        if "<locals>" in key or "<lambda>" in key:
            raise InvalidArgumentError(
                f"Cannot register {key!r}: a lambda or nested function has no importable name "
                "that other processes share. Define it at module level, or pass name=...")
        with _lock:
            existing = _registry.get(key)
            if existing is not None and existing is not func and (
                    qualified_name(existing) != qualified_name(func)):
                raise AlreadyExistsError(f"A different function is already registered as {key!r}.")
            _registry[key] = func
        func.__clusterwire_name__ = key  # type: ignore[attr-defined]
        return func

    return register(fn) if fn is not None else register


def name_of(fn_or_name: Callable[..., Any] | str) -> str:
    """The registered name for a function or a name."""
    if isinstance(fn_or_name, str):
        return fn_or_name
    if callable(fn_or_name):
        return getattr(fn_or_name, "__clusterwire_name__", None) or qualified_name(fn_or_name)
    raise InvalidArgumentError(f"Expected a function or a function name, got {fn_or_name!r}")


def lookup(name: str) -> Callable[..., Any]:
    """The function registered as ``name``; NotFoundError listing what is registered."""
    fn = _registry.get(name)  # a dict read needs no lock
    if fn is not None:
        return fn
    with _lock:
        fn = _registry.get(name)
        if fn is None:
            known = ", ".join(sorted(_registry)[:20]) or "none"
            raise NotFoundError(
                f"No remote function registered as {name!r} on this task (registered: {known}). "
                "Decorate it with @clusterwire.remote and import its module in the task's "
                "process (clusterwire serve --import MODULE).")
        return fn


def registered() -> list[str]:
    """Names of all registered functions, sorted."""
    with _lock:
        return sorted(_registry)
