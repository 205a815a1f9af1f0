"""A transport's options (plugins.toml ``[options.<protocol>]``), read with one set of checks.

Every transport factory reads its options through ``OptionReader``, so a bad value or an
unknown name is the same ``InvalidArgumentError`` everywhere, naming the protocol, the
option and what it accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clusterwire.errors import InvalidArgumentError


class OptionReader:
    """Reads each option once; ``finish()`` refuses any the transport did not read."""

    def __init__(self, protocol: str, options: Mapping[str, Any] | None):
        self._protocol = protocol
        self._left = dict(options or {})
        self._known: list[str] = []

    def _take(self, name: str, default: Any) -> Any:
        self._known.append(name)
        return self._left.pop(name, default)

    def _refuse(self, name: str, value: Any, wanted: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{self._protocol} option {name} must be {wanted}, got {value!r}.")

    def positive(self, name: str, default: float, integer: bool = False) -> Any:
        """A number above 0; an int with ``integer``."""
        value = self._take(name, default)
        if not _is_number(value, integer) or value <= 0:
            raise self._refuse(name, value, f"a positive {'integer' if integer else 'number'}")
        return value if integer else float(value)

    def number(self, name: str, default: float, low: float, high: float,
               integer: bool = False) -> Any:
        """A number in [``low``, ``high``]; an int with ``integer``."""
        value = self._take(name, default)
        if not _is_number(value, integer) or not low <= value <= high:
            raise self._refuse(name, value, f"{'an integer' if integer else 'a number'} in "
                                            f"[{low:g}, {high:g}]")
        return value if integer else float(value)

    def flag(self, name: str, default: bool) -> bool:
        """``true`` or ``false``."""
        value = self._take(name, default)
        if not isinstance(value, bool):
            raise self._refuse(name, value, "true or false")
        return value

    def choice(self, name: str, default: str, choices: Sequence[str]) -> str:
        """One of ``choices``."""
        value = self._take(name, default)
        if value not in choices:
            raise self._refuse(name, value, f"one of {', '.join(map(repr, choices))}")
        return value

    def text(self, name: str, default: str | None = None) -> str | None:
        """A string (or the default, which may be None)."""
        value = self._take(name, default)
        if value is not None and not isinstance(value, str):
            raise self._refuse(name, value, "a string")
        return value

    def finish(self) -> None:
        """InvalidArgumentError naming any option that was not read (unknown to the transport)."""
        if self._left:
            raise InvalidArgumentError(
                f"Unknown option(s) for {self._protocol}: {sorted(self._left)}; known: "
                f"{', '.join(self._known)}.")


def _is_number(value: Any, integer: bool) -> bool:
    return not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
