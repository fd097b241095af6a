"""A job's wait-for graph as its state stands now (``hangwatch.model.waitfor``), and its JSON.

Each rank's stand is the word ``status`` shows for it (``views.rank_state``); each call a rank is
open in waits for the members of its group that have not entered it (a collective), or for its
peer unless the peer is in the matching call (a send or a recv). Read only: built on demand.
"""

from __future__ import annotations

from typing import Any

from hangwatch import records as r
from hangwatch.diagnosis.state import JobState, RankState
from hangwatch.diagnosis.views import rank_state
from hangwatch.model.waitfor import Graph, Stand, Wait

#: ``status`` words -> stands.
STANDS = {
    "waiting": Stand.WAITING,
    "died": Stand.DIED,
    "frozen": Stand.FROZEN,
    "exited": Stand.ENDED,
    "running": Stand.BUSY,
}
#: Open calls of one rank looked at, oldest first (async work in flight is bounded by the hook).
OPEN_LOOKED_AT = 8


def graph(job: JobState, now: float, silence_after: float) -> Graph:
    """Who waits for whom in ``job`` now."""
    stands = {rank: STANDS[rank_state(st, now, silence_after)[0]] for rank, st in job.ranks.items()}
    in_slot: dict[tuple[str, int], tuple[str, list[int]]] = {}
    waits: list[Wait] = []
    for rank, st in sorted(job.ranks.items()):
        if stands[rank] is not Stand.WAITING:
            continue  # a rank that died or froze in a call waits for no one: others wait for it
        for call in _open(st):
            if call.kind is r.OpKind.P2P:
                if call.peer is not None and not _matched(job, call):
                    waits.append(Wait(call.group, call.seq, call.op, (rank,), (call.peer,)))
                continue
            op, waiters = in_slot.setdefault((call.group, call.seq), (call.op, []))
            waiters.append(rank)
    for (group, seq), (op, waiters) in in_slot.items():
        slots = job.slots.get(group)
        slot = slots.get(seq) if slots is not None else None
        if slot is None:
            continue  # a call held in a run on its device: its slot is not made, nor its absentees known
        absent = tuple(m for m in job.members(group) if m not in slot.calls)
        if absent:
            waits.append(Wait(group, seq, op, tuple(waiters), absent))
    return Graph(stands, waits)


def graph_json(g: Graph) -> dict[str, Any]:
    """The graph as ``status --json`` gives it: each wait, and each hang with who reaches it."""
    return {
        "waits": [
            {"group": w.group, "seq": w.seq, "op": w.op, "ranks": list(w.waiters), "waits_for": list(w.on)}
            for w in g.waits
        ],
        "hangs": [
            {"ranks": list(h.ranks), "stand": h.stand.value if h.stand else "cycle", "upstream": list(h.upstream)}
            for h in g.hangs()
        ],
    }


def _open(st: RankState) -> list[r.CallRecord]:
    calls = sorted(st.open_calls.values(), key=lambda c: c.enter_time)
    return calls[:OPEN_LOOKED_AT]


def _matched(job: JobState, call: r.CallRecord) -> bool:
    """Whether the peer is in the call that matches ``call`` (then both wait on the transport)."""
    assert call.peer is not None
    peer = job.ranks.get(call.peer)
    if peer is None:
        return False
    other = r.RECV_OPS if call.op in r.SEND_OPS else r.SEND_OPS
    return any(c.op in other and c.peer == call.rank and c.group == call.group for c in _open(peer))


def hosts_of(job: JobState) -> dict[str, list[int]]:
    """Each node's ranks (what the graph's views group by)."""
    out: dict[str, list[int]] = {}
    for rank, st in sorted(job.ranks.items()):
        out.setdefault(st.identity.host, []).append(rank)
    return out


def incident_graph(g: Graph, culprits: list[int], hosts: dict[str, list[int]]) -> dict[str, Any] | None:
    """The part of the graph an incident is about: the hangs its culprits' waits end in, every
    wait upstream of them, and the nodes of the ranks in them (None: no wait leads there)."""
    hangs = g.reached(culprits)
    if not hangs:
        return None
    inside = {rank for h in hangs for rank in (*h.ranks, *h.upstream)}
    waits = [w for w in g.waits if inside & set(w.waiters)]
    full = graph_json(Graph(g.stands, waits))
    full["hangs"] = [
        {"ranks": list(h.ranks), "stand": h.stand.value if h.stand else "cycle", "upstream": list(h.upstream)}
        for h in hangs
    ]
    full["hosts"] = {host: [rk for rk in ranks if rk in inside] for host, ranks in hosts.items()}
    full["hosts"] = {host: ranks for host, ranks in full["hosts"].items() if ranks}
    return full
