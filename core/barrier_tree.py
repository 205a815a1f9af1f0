"""The combining tree a large job's barrier rounds travel: its shape, from the membership view.

Every task computes the same tree from the job's tasks and addresses, so agreeing on it costs
no message. Tasks are grouped by host (the host part of their address); the lowest index of
a host is its leader; the hosts' leaders form a tree of fan-in ``fan_in - 1`` under the job's
lowest index (the root), so each leader keeps at least one slot for its own host; a host's
other tasks fill the free slots of their leader and then of each other, breadth first (sub-
leaders on the same host), so no task has more than ``fan_in`` children, whatever the layout.
A task then handles at most ``fan_in + 1`` arrivals per round: its own and one per child.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

from clusterwire import errors
from clusterwire.addressing import split_host_port

#: Children per task in a barrier tree.
FAN_IN = 32


@dataclasses.dataclass(frozen=True)
class Tree:
    """Parent and children of each task index of one job."""

    root: int
    parent: Mapping[int, int | None]
    children: Mapping[int, tuple[int, ...]]
    height: int  # the most hops from a task up to the root

    def question_timeouts(self, index: int) -> int:
        """How many peer timeouts task ``index`` may take to say which tasks of its subtree
        are missing, when tasks below it are cut off: it asks its children at once and,
        for each that does not answer within its own such time plus one peer timeout, the
        grandchildren in its place."""
        asking = [0] * (self.height + 3)  # by depth: the time to ask a task there
        for depth in range(self.height, -1, -1):
            asking[depth] = asking[depth + 1] + asking[depth + 2] + 1
        depth = self.depth(index)
        return asking[depth + 1] + asking[depth + 2]

    def depth(self, index: int) -> int:
        """Hops from ``index`` up to the root."""
        hops = 0
        while (up := self.parent[index]) is not None:
            index, hops = up, hops + 1
        return hops


def host_of(address: str) -> str:
    """The host part of a task's address (the address itself if it has no port)."""
    try:
        return split_host_port(address)[0]
    except errors.InvalidArgumentError:
        return address


def build(addresses: Mapping[int, str], fan_in: int = FAN_IN) -> Tree:
    """The tree of a job whose task ``index`` is at ``addresses[index]``."""
    if fan_in < 2:
        raise errors.InvalidArgumentError(f"A barrier tree needs a fan-in >= 2, got {fan_in}.")
    if not addresses:
        raise errors.InvalidArgumentError("A barrier tree needs at least one task.")
    hosts: dict[str, list[int]] = collections.defaultdict(list)
    for index in sorted(addresses):
        hosts[host_of(addresses[index])].append(index)
    groups = sorted(hosts.values())  # by leader: the root's host first
    leaders = [group[0] for group in groups]
    parent: dict[int, int | None] = {leaders[0]: None}
    children: dict[int, list[int]] = {index: [] for index in addresses}
    for position, leader in enumerate(leaders[1:], start=1):
        up = leaders[(position - 1) // (fan_in - 1)]
        parent[leader] = up
        children[up].append(leader)
    for group in groups:
        # Breadth first: fill the leader's free slots, then each placed task's, in order.
        open_slots = collections.deque([group[0]])
        for index in group[1:]:
            while len(children[open_slots[0]]) >= fan_in:
                open_slots.popleft()
            up = open_slots[0]
            parent[index] = up
            children[up].append(index)
            open_slots.append(index)
    tree = Tree(root=leaders[0], parent=parent, height=0,
                children={index: tuple(below) for index, below in children.items()})
    height = max(tree.depth(index) for index in addresses)
    return dataclasses.replace(tree, height=height)
