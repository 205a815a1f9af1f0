"""Slurm's compressed lists: hostlists (``n[1-3,7]``) and tasks-per-node lists (``2(x3),1``).

Follows TensorFlow's ``expand_hostlist`` / ``expand_tasks_per_node``
(order kept, nothing deduplicated, zero padding from the width of the range's
start), and also accepts what Slurm itself writes and TF rejects: several
bracket groups in one name (``rack[1-2]-n[01-02]``, expanded with the first group
varying slowest) and text after a bracket group (``n[1-2]-ib``).
"""

from __future__ import annotations

import itertools
import re

from clusterwire.resolvers._support import ResolverValueError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_outside_brackets(text: str, what: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise ResolverValueError(f'Invalid {what} "{text}": nested "[".')
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ResolverValueError(f'Invalid {what} "{text}": "]" without "[".')
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ResolverValueError(f'Invalid {what} "{text}": unclosed "[".')
    parts.append("".join(current))
    return parts


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    values = []
    for part in ranges.split(","):
        match = _RANGE.match(part)
        if not match:
            raise ResolverValueError(
                f'Invalid hostlist format "{hostlist}": bad range "{part}" '
                "(expected N or N-M, e.g. n[1-3,7]).")
        start, end = match.group(1), match.group(2)
        if end is None:
            values.append(start)
            continue
        if int(end) < int(start):
            raise ResolverValueError(
                f'Invalid hostlist format "{hostlist}": range "{part}" runs backwards.')
        values.extend(str(i).zfill(len(start)) for i in range(int(start), int(end) + 1))
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist: ``"n[1-2],m5,o[009-010]"`` -> n1 n2 m5 o009 o010.

    Raises ValueError (a clusterwire InvalidArgumentError) naming the list for
    malformed input; ``""`` gives ``[]``.
    """
    if not hostlist:
        return []
    hosts: list[str] = []
    for part in _split_outside_brackets(hostlist, "hostlist format"):
        if not part:
            raise ResolverValueError(f'Invalid hostlist format "{hostlist}": empty host name.')
        # pieces alternate: literal text, range expression, literal text, ...
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [[piece] if i % 2 == 0 else _expand_ranges(piece, hostlist)
                   for i, piece in enumerate(pieces)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expand Slurm's tasks-per-node list: ``"3(x2),2,1"`` -> ``[3, 3, 2, 1]``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = _TASKS.match(part.strip())
        if not match:
            raise ResolverValueError(
                f'Invalid tasks-per-node list format "{tasks_per_node}": bad part "{part}" '
                "(expected N or N(xM), e.g. 2(x3),1).")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
