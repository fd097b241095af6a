"""Who waits for whom: a job's hangs are the sinks and the cycles of one graph over its ranks.

A rank inside a collective waits for the members of its group that have not arrived; a rank in
a send or a recv waits for its peer, unless the peer is in the matching call (then both wait on
the transport, not on each other). A rank that waits for no one stops the waits that reach it:
it died, froze, ended, or is busy outside any call (a *sink*). Ranks that wait for each other
around a loop (two pipeline stages that both send first) are a *cycle*.

Each cycle, and each sink that some rank waits on, is one hang; every rank that reaches it is
upstream of it, and what they show (a barrier held up by a rank stuck elsewhere, a rank torch's
watchdog kills) is that hang's aftermath, not a root cause of its own.

The graph is built from plain facts (where each rank stands, and its waits); ``hangs`` walks it
once: Tarjan's strongly connected components, then the components nothing leaves.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class Stand(str, enum.Enum):
    """Where a rank stands: inside a call, or the reason it waits for no one."""

    WAITING = "waiting"  # inside a call (its waits say for whom)
    DIED = "died"  # ended by an exception or a signal, or its process is gone
    FROZEN = "frozen"  # alive, and silent: no heartbeat reaches the coordinator
    ENDED = "ended"  # ended cleanly: left the program
    BUSY = "busy"  # alive, outside any call of the group that waits for it
    UNKNOWN = "unknown"  # never heard from


#: The stands that stop a wait: a rank in one of them is a sink.
SINKS = frozenset({Stand.DIED, Stand.FROZEN, Stand.ENDED, Stand.BUSY, Stand.UNKNOWN})


@dataclass(frozen=True)
class Wait:
    """Ranks ``waiters`` are in ``op`` (``group``, ``seq``) and wait for ranks ``on`` to come.

    One wait stands for a whole call: a thousand ranks in a barrier that one rank has not
    reached are one wait, not a thousand edges."""

    group: str
    seq: int
    op: str
    waiters: tuple[int, ...]
    on: tuple[int, ...]


@dataclass(frozen=True)
class Hang:
    """One sink (a rank, with its stand) or one cycle (ranks; ``stand`` None), and who reaches it."""

    ranks: tuple[int, ...]
    stand: Stand | None
    upstream: tuple[int, ...]  # ranks whose waits lead here (the hang's own ranks excluded)

    @property
    def cycle(self) -> bool:
        return self.stand is None


#: A node of the graph: a rank (an int), or a wait (its index, as ``(index,)``).
_Node = int | tuple[int]


class Graph:
    """Ranks and their waits; ``hangs`` are the sinks and cycles that someone waits on."""

    def __init__(self, stands: Mapping[int, Stand], waits: Iterable[Wait]) -> None:
        self.stands: dict[int, Stand] = dict(stands)
        self.waits: list[Wait] = []
        self._out: dict[_Node, list[_Node]] = {}
        for wait in waits:
            on = tuple(rank for rank in wait.on if rank not in wait.waiters)  # a rank never waits for itself
            if not on or not wait.waiters:
                continue
            node: _Node = (len(self.waits),)
            self.waits.append(wait)
            self._out[node] = list(on)
            for rank in wait.waiters:
                self._out.setdefault(rank, []).append(node)
                self.stands.setdefault(rank, Stand.WAITING)
            for rank in on:
                self.stands.setdefault(rank, Stand.UNKNOWN)
        self._hangs: list[Hang] | None = None

    def stand(self, rank: int) -> Stand:
        return self.stands.get(rank, Stand.UNKNOWN)

    def waits_of(self, rank: int) -> list[Wait]:
        """The waits ``rank`` is in."""
        return [self.waits[node[0]] for node in self._out.get(rank, []) if isinstance(node, tuple)]

    def hangs(self) -> list[Hang]:
        """Every cycle, and every sink some rank waits on, in rank order."""
        if self._hangs is None:
            self._hangs = self._find()
        return self._hangs

    def reached(self, ranks: Iterable[int]) -> list[Hang]:
        """The hangs that the waits of ``ranks`` end in (a rank that is a hang's own: that hang)."""
        wanted = set(ranks)
        return [h for h in self.hangs() if wanted & set(h.ranks) or wanted & set(h.upstream)]

    def _find(self) -> list[Hang]:
        nodes: list[_Node] = [*sorted(self.stands), *((i,) for i in range(len(self.waits)))]
        components = _components(nodes, self._out)
        of = {node: index for index, component in enumerate(components) for node in component}
        behind: dict[_Node, list[_Node]] = {}
        for node, outs in self._out.items():
            for nxt in outs:
                behind.setdefault(nxt, []).append(node)
        hangs: list[Hang] = []
        for index, component in enumerate(components):
            if any(of[nxt] != index for node in component for nxt in self._out.get(node, [])):
                continue  # its waits go on elsewhere: the hang is downstream
            ranks = tuple(sorted(node for node in component if isinstance(node, int)))
            if not ranks:
                continue
            upstream = _upstream(component, behind)
            if len(component) > 1:
                hangs.append(Hang(ranks, None, upstream))  # its own ranks wait on it
            elif upstream and self.stand(ranks[0]) in SINKS:  # a sink nobody waits on is no hang
                hangs.append(Hang(ranks, self.stand(ranks[0]), upstream))
            # a rank in a call with nobody left to wait for waits on the transport: no rank holds
            # it up, and this graph has nothing to say of it
        hangs.sort(key=lambda h: h.ranks)
        return hangs


def _upstream(component: list[_Node], behind: Mapping[_Node, list[_Node]]) -> tuple[int, ...]:
    inside = set(component)
    seen: set[_Node] = set()
    todo = list(component)
    while todo:
        for node in behind.get(todo.pop(), []):
            if node not in seen and node not in inside:
                seen.add(node)
                todo.append(node)
    return tuple(sorted(node for node in seen if isinstance(node, int)))


def _components(nodes: list[_Node], out: Mapping[_Node, list[_Node]]) -> list[list[_Node]]:
    """Strongly connected components (Tarjan's, without recursion: a job has thousands of ranks)."""
    index: dict[_Node, int] = {}
    low: dict[_Node, int] = {}
    on_stack: set[_Node] = set()
    stack: list[_Node] = []
    found: list[list[_Node]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work: list[tuple[_Node, int]] = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            outs = out.get(node, [])
            if i < len(outs):
                work.append((node, i + 1))
                nxt = outs[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component: list[_Node] = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                found.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found
