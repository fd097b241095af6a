"""An incident's wait-for graph, drawn: text grouped by node, or Graphviz (``report --graph``).

The graph is what the coordinator kept when it told the incident (``details.graph``): each wait
(ranks in one call, the ranks they wait for), the hangs they end in, and each node's ranks.
Ranks are collapsed into ranges and split by node, so a hang of a thousand ranks is a few lines.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from hangwatch.wording import conj, format_ranks, ranks_label
from hangwatch.wording.stories import hang_line


def _by_host(ranks: Iterable[int], host_of: Mapping[int, str]) -> list[tuple[str, list[int]]]:
    """``ranks`` split by node, in the order their nodes first appear."""
    out: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        out.setdefault(host_of.get(rank, ""), []).append(rank)
    return list(out.items())


#: Nodes named one by one in a line; more are counted.
HOSTS_SHOWN = 4


#: A list of ranks longer than this is told by its stride (a data-parallel group's ranks).
LABEL_CHARS = 60


def _compact(ranks: list[int]) -> str:
    """``ranks 0-7`` as ranges, or, where ranges are long, by their stride: ``ranks 1-1017 every
    8 but 513 (127 ranks)``; else the first few and a count."""
    label = ranks_label(ranks)
    if len(label) <= LABEL_CHARS or len(ranks) < 3:
        return label
    steps = [b - a for a, b in itertools.pairwise(ranks)]
    step = max(set(steps), key=steps.count)
    grid = range(ranks[0], ranks[-1] + 1, step)
    missing = sorted(set(grid) - set(ranks))
    if step > 1 and set(ranks) <= set(grid) and len(missing) <= 3:
        but = f" but {', '.join(map(str, missing))}" if missing else ""
        return f"ranks {ranks[0]}-{ranks[-1]} every {step}{but} ({len(ranks)} ranks)"
    return f"ranks {', '.join(map(str, ranks[:6]))}, ... ({len(ranks)} ranks)"


def _named(ranks: Iterable[int], host_of: Mapping[int, str]) -> str:
    groups = _by_host(ranks, host_of)
    if len(groups) > HOSTS_SHOWN:
        every = sorted(rank for _, rs in groups for rank in rs)
        return f"{_compact(every)} on {len(groups)} nodes ({groups[0][0]} to {groups[-1][0]})"
    return "; ".join(f"{_compact(rs)} ({host})" if host else _compact(rs) for host, rs in groups)


def _host_of(graph: Mapping[str, Any]) -> dict[int, str]:
    return {int(rank): str(host) for host, ranks in (graph.get("hosts") or {}).items() for rank in ranks}


def text(graph: Mapping[str, Any]) -> list[str]:
    """Who waits for whom, a line per wait, then where the waits end."""
    host_of = _host_of(graph)
    lines = []
    for w in graph.get("waits") or []:
        waiters = w["ranks"]
        verb = conj("wait", waiters)
        lines.append(
            f"{_named(waiters, host_of)} {verb} in {w['op']} (group {w['group']}, seq {w['seq']}) "
            f"for {_named(w['waits_for'], host_of)}"
        )
    for h in graph.get("hangs") or []:
        where = "; ".join(f"{host}: {format_ranks(rs)}" for host, rs in _by_host(h["ranks"], host_of) if host)
        line = hang_line(h["ranks"], h["stand"], h["upstream"])
        upstream = ranks_label(h["upstream"])
        if len(upstream) > LABEL_CHARS:
            line = line.replace(upstream, _compact(h["upstream"]))
        lines.append("-> " + line + (f" [{where}]" if where else ""))
    return lines


def _quote(s: str) -> str:
    """A Graphviz string: its quotes and backslashes escaped, its newlines Graphviz's."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot(graph: Mapping[str, Any], name: str) -> str:
    """The graph in Graphviz's language: a box per node's share of a wait's ranks, an edge per
    wait, the sinks and cycles drawn apart."""
    host_of = _host_of(graph)
    sinks: dict[int, str] = {}
    cycle: set[int] = set()
    for h in graph.get("hangs") or []:
        for rank in h["ranks"]:
            if h["stand"] == "cycle":
                cycle.add(rank)
            else:
                sinks[rank] = h["stand"]
    ids: dict[tuple[str, tuple[int, ...]], str] = {}
    out = [f"digraph {_quote(name)} {{", "  rankdir=LR;", '  node [shape=box, fontname="monospace"];']

    def node(host: str, ranks: list[int]) -> str:
        key = (host, tuple(ranks))
        if key not in ids:
            ids[key] = f"n{len(ids)}"
            label = _compact(ranks) + (f"\n{host}" if host else "")
            attrs = ""
            if ranks[0] in sinks:  # a part is of one stand (``parts``)
                label += "\n" + sinks[ranks[0]]
                attrs = ", shape=doubleoctagon, color=red"
            elif set(ranks) <= cycle:
                attrs = ", color=red"
            out.append(f"  {ids[key]} [label={_quote(label)}{attrs}];")
        return ids[key]

    def parts(ranks: list[int]) -> list[tuple[str, list[int]]]:
        """``ranks`` split by node (one box past ``HOSTS_SHOWN`` nodes), and a node's sinks of one
        stand apart from the rest."""
        out: list[tuple[str, list[int]]] = []
        groups = _by_host(ranks, host_of)
        if len(groups) > HOSTS_SHOWN and not any(r in sinks for r in ranks):
            return [(f"{len(groups)} nodes", sorted(ranks))]
        for host, rs in groups:
            by_stand: dict[str, list[int]] = {}
            for r in rs:
                by_stand.setdefault(sinks.get(r, ""), []).append(r)
            out += [(host, group) for group in by_stand.values()]
        return out

    for w in graph.get("waits") or []:
        label = _quote(f"{w['op']} (group {w['group']}, seq {w['seq']})")
        for host, waiters in parts(w["ranks"]):
            source = node(host, waiters)
            for other, on in parts(w["waits_for"]):
                red = ", color=red" if set(waiters) <= cycle and set(on) <= cycle else ""
                out.append(f"  {source} -> {node(other, on)} [label={label}{red}];")
    out.append("}")
    return "\n".join(out) + "\n"
