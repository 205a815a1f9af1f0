"""Durations as people read them: ``format_duration(3600) == "1 h"`` (not ``3.6e+03 s``)."""

from __future__ import annotations

_UNITS = ((86_400.0, "d"), (3_600.0, "h"), (60.0, "min"))


def format_duration(seconds: float) -> str:
    """``seconds`` in the largest unit it reaches (d, h, min, s), with at most three
    significant digits: ``0.25 s``, ``30 s``, ``1.5 min``, ``1 h``, ``2 d``."""
    seconds = float(f"{seconds:.3g}")  # 3599.98 s is "1 h", not "60 min"
    for size, unit in _UNITS:
        if abs(seconds) >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"
