"""What the benchmarks report about the machine they ran on."""

from __future__ import annotations

import contextlib


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("?" where there is none)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"
