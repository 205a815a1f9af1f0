"""What a tf.data service worker may run and read: default deny.

A dataset names its functions as ``module:qualname`` and its files as paths; both come from
whichever client reached the dispatcher. A worker runs a function only if the operator allowed
it, and reads a file only under a directory or URL prefix the operator configured
(``clusterwire.data.filesystems`` holds that rule):

* functions registered with ``@clusterwire.data.function`` in a module the worker's process
  imported (``clusterwire worker --import MODULE``);
* module-level functions defined in a module named in ``WorkerConfig.function_modules``
  (``--function-module MODULE``), which the worker imports when it starts;
* numpy's ufuncs (``numpy.square``, ...): element-wise arithmetic that cannot reach files,
  processes or the interpreter.

Modules that reach the interpreter, files or processes (``builtins``, ``os``, ``subprocess``,
``importlib``, ``sys``, ``pickle``, ...) are refused even when configured. A worker never
imports a module because a request names it: importing runs the module's code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from clusterwire.data.filesystems import check_prefixes, resolve_readable
from clusterwire.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError

F = TypeVar("F", bound=Callable[..., Any])

#: Modules (and their submodules) whose functions no worker runs, whatever its configuration.
DENIED_MODULES = frozenset({
    "builtins", "os", "posix", "nt", "subprocess", "importlib", "sys", "pickle", "_pickle",
    "marshal", "shutil", "ctypes", "runpy", "code", "codeop", "pty", "socket", "io", "_io",
    "pathlib", "tempfile", "multiprocessing", "signal", "threading", "gc", "inspect",
})

_registry: dict[str, Callable[..., Any]] = {}

_HOW_TO_ALLOW = (
    "Allow it on the workers: decorate it with @clusterwire.data.function in a module the "
    "worker imports (clusterwire worker --import MODULE), or name its module in "
    "WorkerConfig(function_modules=[...]) (--function-module MODULE).")


def _denied(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in DENIED_MODULES)


def function(fn: F) -> F:
    """Allow tf.data service workers to run ``fn`` (a decorator, like ``@clusterwire.remote``).

    Workers run only allowed functions; this one is allowed in every process that imports
    its module. It must be defined at module level, outside the modules workers never run.
    """
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", None) or ""
    if not callable(fn) or not module or not qualname or "<" in qualname:
        raise InvalidArgumentError(
            f"@clusterwire.data.function needs a module-level function, got {fn!r}: a lambda "
            "or nested function has no name that workers can look up.")
    if _denied(module):
        raise PermissionDeniedError(
            f"{module}:{qualname} is in module {module!r}, whose functions workers never run.")
    _registry[f"{module}:{qualname}"] = fn
    return fn


def _check_modules(modules: Iterable[str]) -> tuple[str, ...]:
    checked = []
    for module in modules:
        if not isinstance(module, str) or not module or module.startswith("."):
            raise InvalidArgumentError(
                f"function_modules takes importable module names, got {module!r}.")
        if _denied(module):
            raise PermissionDeniedError(
                f"function_modules names {module!r}: workers never run functions of "
                f"{', '.join(sorted(DENIED_MODULES))}. Wrap what you need in a function of "
                "your own module and allow that module.")
        checked.append(module)
    return tuple(checked)


class WorkerPermissions:
    """The functions and directories one worker allows (see the module docstring)."""

    def __init__(self, function_modules: Iterable[str] = (),
                 readable_dirs: Iterable[str] = ()):
        self.function_modules = _check_modules(function_modules)
        self.readable_dirs = check_prefixes(readable_dirs)
        for module in self.function_modules:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise NotFoundError(
                    f"Cannot import function module {module!r}: {err}. Install it or put it "
                    "on the worker's PYTHONPATH.") from None

    def function(self, name: str) -> Callable[..., Any]:
        """The allowed function ``name`` (``module:qualname``); PermissionDeniedError else."""
        module, sep, qualname = name.partition(":")
        if not sep or not module or not qualname:
            raise InvalidArgumentError(
                f"Malformed function reference {name!r}; expected 'module:qualname'.")
        if _denied(module):
            raise PermissionDeniedError(
                f"Function {name!r} is in module {module!r}, whose functions tf.data service "
                "workers never run. Wrap what you need in a function of your own module. "
                + _HOW_TO_ALLOW)
        registered = _registry.get(name)
        if registered is not None:
            return registered
        if module in self.function_modules:
            found = _module_function(module, qualname)
            if found is not None:
                return found
        if module == "numpy" and isinstance(getattr(np, qualname, None), np.ufunc):
            return getattr(np, qualname)
        raise PermissionDeniedError(
            f"Function {name!r} is not allowed on this tf.data service worker. " + _HOW_TO_ALLOW)

    def path(self, path: str) -> str:
        """``path`` made canonical (links and ``..`` resolved, or a canonical URL) if it lies
        under a readable dir or URL prefix; PermissionDeniedError else (filesystems' rule)."""
        return resolve_readable(path, self.readable_dirs)


def _module_function(module: str, qualname: str) -> Callable[..., Any] | None:
    """A function (or class) defined in ``module`` itself under ``qualname``; None else.

    Names the module merely imports (``module:os.system``) are not its own.
    """
    target: Any = importlib.import_module(module)  # imported at start: a dictionary look-up
    for part in qualname.split("."):
        if part.startswith("__"):
            return None
        target = getattr(target, part, None)
    if (callable(target) and getattr(target, "__module__", None) == module
            and getattr(target, "__qualname__", None) == qualname):
        return target
    return None
