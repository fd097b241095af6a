"""``report --graph``: an incident's wait-for graph as text grouped by node, and as Graphviz."""

from __future__ import annotations

from hangwatch.cli import graphs

#: Ranks 2-3 on node-b in a world barrier wait for ranks 0-1 on node-a; rank 0 waits in a
#: subgroup's all_reduce for rank 1, busy in its own work: the sink, holding up the rest.
HELD_UP = {
    "waits": [
        {"group": "0", "seq": 5, "op": "barrier", "ranks": [2, 3], "waits_for": [0, 1]},
        {"group": "1", "seq": 5, "op": "all_reduce", "ranks": [0], "waits_for": [1]},
    ],
    "hangs": [{"ranks": [1], "stand": "busy", "upstream": [0, 2, 3]}],
    "hosts": {"node-a": [0, 1], "node-b": [2, 3]},
}

#: Two pipeline stages that both send first: a cycle.
CYCLE = {
    "waits": [
        {"group": "0", "seq": 1, "op": "send", "ranks": [0], "waits_for": [1]},
        {"group": "0", "seq": 1, "op": "send", "ranks": [1], "waits_for": [0]},
    ],
    "hangs": [{"ranks": [0, 1], "stand": "cycle", "upstream": []}],
    "hosts": {"node-a": [0], "node-b": [1]},
}


def test_the_text_says_who_waits_for_whom_by_node_and_where_the_waits_end() -> None:
    assert graphs.text(HELD_UP) == [
        "ranks 2, 3 (node-b) wait in barrier (group 0, seq 5) for ranks 0, 1 (node-a)",
        "rank 0 (node-a) waits in all_reduce (group 1, seq 5) for rank 1 (node-a)",
        "-> rank 1 is busy outside the call, holding up ranks 0, 2, 3 [node-a: 1]",
    ]


def test_a_thousand_ranks_are_a_few_lines() -> None:
    big = {
        "waits": [
            {"group": "0", "seq": 9, "op": "all_reduce", "ranks": [*range(513), *range(514, 1024)], "waits_for": [513]}
        ],
        "hangs": [{"ranks": [513], "stand": "busy", "upstream": [*range(513), *range(514, 1024)]}],
        "hosts": {f"node-{n:03d}": list(range(8 * n, 8 * n + 8)) for n in range(128)},
    }
    lines = graphs.text(big)
    assert len(lines) == 2
    assert lines[0] == (
        "ranks 0-512, 514-1023 on 128 nodes (node-000 to node-127) wait in all_reduce (group 0, seq 9) "
        "for rank 513 (node-064)"
    )
    assert lines[1] == "-> rank 513 is busy outside the call, holding up ranks 0-512, 514-1023 [node-064: 513]"


def test_the_dot_draws_the_sink_apart_and_the_cycle_in_red() -> None:
    drawn = graphs.dot(HELD_UP, "inc-0003")
    assert drawn == (
        'digraph "inc-0003" {\n'
        "  rankdir=LR;\n"
        '  node [shape=box, fontname="monospace"];\n'
        '  n0 [label="ranks 2, 3\\nnode-b"];\n'
        '  n1 [label="rank 0\\nnode-a"];\n'
        '  n0 -> n1 [label="barrier (group 0, seq 5)"];\n'
        '  n2 [label="rank 1\\nnode-a\\nbusy", shape=doubleoctagon, color=red];\n'
        '  n0 -> n2 [label="barrier (group 0, seq 5)"];\n'
        '  n1 -> n2 [label="all_reduce (group 1, seq 5)"];\n'
        "}\n"
    )
    cycle = graphs.dot(CYCLE, 'inc "4"')
    assert cycle.startswith('digraph "inc \\"4\\"" {')
    assert '  n0 -> n1 [label="send (group 0, seq 1)", color=red];' in cycle
    assert '  n1 -> n0 [label="send (group 0, seq 1)", color=red];' in cycle


def test_a_strided_group_is_told_by_its_stride() -> None:
    """A data-parallel group of a 1,024-rank job (every 8th rank), its culprit taken out."""
    dp = [r for r in range(1, 1024, 8) if r != 513]
    graph = {
        "waits": [{"group": "130", "seq": 13, "op": "all_reduce", "ranks": dp, "waits_for": [513]}],
        "hangs": [{"ranks": [513], "stand": "busy", "upstream": dp}],
        "hosts": {f"sim-node-{n}": list(range(8 * n, 8 * n + 8)) for n in range(128)},
    }
    assert graphs.text(graph) == [
        "ranks 1-1017 every 8 but 513 (127 ranks) on 127 nodes (sim-node-0 to sim-node-127) wait in all_reduce "
        "(group 130, seq 13) for rank 513 (sim-node-64)",
        "-> rank 513 is busy outside the call, holding up ranks 1-1017 every 8 but 513 (127 ranks) [sim-node-64: 513]",
    ]
    drawn = graphs.dot(graph, "inc-0001")
    assert '  n0 [label="ranks 1-1017 every 8 but 513 (127 ranks)\\n127 nodes"];' in drawn
    assert drawn.count(" -> ") == 1
