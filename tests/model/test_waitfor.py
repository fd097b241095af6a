"""The wait-for graph: its sinks and cycles are the hangs; everything upstream is their aftermath."""

from __future__ import annotations

import random

from hangwatch.model.waitfor import Graph, Hang, Stand, Wait


def _in(waiter: int, on: list[int], group: str = "0", seq: int = 5, op: str = "all_reduce") -> list[Wait]:
    return [Wait(group, seq, op, (waiter,), tuple(on))]


def test_a_rank_busy_outside_the_collective_is_the_one_hang() -> None:
    graph = Graph({1: Stand.BUSY}, [Wait("0", 5, "all_reduce", (0, 2, 3), (1,))])
    assert graph.hangs() == [Hang((1,), Stand.BUSY, (0, 2, 3))]
    assert graph.waits_of(2) == [Wait("0", 5, "all_reduce", (0, 2, 3), (1,))]


def test_a_wait_is_one_node_however_many_ranks_are_in_it() -> None:
    # 8,191 ranks in a barrier one rank has not reached: one wait, one hang
    waiters = tuple(range(1, 8192))
    graph = Graph({0: Stand.BUSY}, [Wait("0", 9, "barrier", waiters, (0, *waiters))])
    (hang,) = graph.hangs()
    assert hang.ranks == (0,) and len(hang.upstream) == 8191


def test_a_hang_on_one_group_holds_up_another_through_the_rank_waiting_in_it() -> None:
    # ranks 2 and 3 wait in the world barrier for 0 and 1; rank 0 waits in group 1 for rank 1
    waits = _in(2, [0, 1], "0", 5, "barrier") + _in(3, [0, 1], "0", 5, "barrier") + _in(0, [1], "1", 5)
    graph = Graph({1: Stand.BUSY}, waits)
    (hang,) = graph.hangs()
    assert hang == Hang((1,), Stand.BUSY, (0, 2, 3))
    assert graph.reached([0, 1]) == [hang]  # the barrier's absent ranks lead to the one hang


def test_two_stages_that_both_send_first_are_one_cycle() -> None:
    waits = _in(0, [1], "0", 1, "send") + _in(1, [0], "0", 1, "send") + _in(2, [0], "0", 9, "barrier")
    (hang,) = Graph({}, waits).hangs()
    assert hang.cycle and hang.ranks == (0, 1) and hang.upstream == (2,)


def test_each_sink_is_its_own_hang_and_a_rank_waiting_on_both_reaches_both() -> None:
    graph = Graph({1: Stand.DIED, 2: Stand.ENDED}, _in(0, [1, 2]) + _in(3, [2], "1", 2))
    assert [(h.ranks, h.stand, h.upstream) for h in graph.hangs()] == [
        ((1,), Stand.DIED, (0,)),
        ((2,), Stand.ENDED, (0, 3)),
    ]
    assert [h.ranks for h in graph.reached([0])] == [(1,), (2,)]
    assert [h.ranks for h in graph.reached([3])] == [(2,)]


def test_a_chain_ends_at_its_last_rank() -> None:
    waits = _in(0, [1], "a") + _in(1, [2], "b") + _in(2, [3], "c")
    (hang,) = Graph({3: Stand.FROZEN}, waits).hangs()
    assert hang == Hang((3,), Stand.FROZEN, (0, 1, 2))


def test_a_rank_never_heard_from_is_a_sink_of_its_own() -> None:
    (hang,) = Graph({0: Stand.WAITING}, _in(0, [7])).hangs()
    assert hang == Hang((7,), Stand.UNKNOWN, (0,))


def test_nothing_is_a_hang_that_nobody_waits_on() -> None:
    # a rank that ended cleanly with nobody waiting; ranks waiting only on the transport (no waits)
    assert Graph({0: Stand.ENDED, 1: Stand.WAITING, 2: Stand.WAITING}, []).hangs() == []


def test_a_cycle_that_waits_further_on_is_not_itself_the_hang() -> None:
    # 0 and 1 wait for each other and 1 also for 2, which is busy: the waits end at 2
    waits = _in(0, [1], "p") + _in(1, [0, 2], "p")
    (hang,) = Graph({2: Stand.BUSY}, waits).hangs()
    assert hang == Hang((2,), Stand.BUSY, (0, 1))


def test_components_match_a_brute_force_reachability_on_random_graphs() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 12)
        pairs = [(a, b) for a in range(n) for b in range(n) if a != b and rng.random() < 0.15]
        waits = [Wait("0", 1, "x", (a,), (b,)) for a, b in pairs]
        stands = {rank: rng.choice(list(Stand)) for rank in range(n)}
        graph = Graph(stands, waits)
        reach = {a: _reach(a, pairs) for a in range(n)}
        for hang in graph.hangs():
            inside = set(hang.ranks)
            # a hang's ranks reach each other and nothing outside
            for rank in inside:
                assert reach[rank] - {rank} <= inside
                assert inside - {rank} <= reach[rank]
            assert set(hang.upstream) == {a for a in range(n) if a not in inside and reach[a] & inside}
            if len(inside) == 1:
                assert graph.stand(hang.ranks[0]) in (Stand.DIED, Stand.FROZEN, Stand.ENDED, Stand.BUSY, Stand.UNKNOWN)
        # every rank that waits reaches some hang, unless its waits end on ranks that wait on no one
        for a in range(n):
            ends = {b for b in reach[a] | {a} if not any(w == b for w, _ in pairs)}
            sinks = {b for b in ends if graph.stand(b) is not Stand.WAITING and b != a}
            if sinks:
                assert graph.reached([a])


def _reach(start: int, pairs: list[tuple[int, int]]) -> set[int]:
    seen: set[int] = set()
    todo = [start]
    while todo:
        node = todo.pop()
        for waiter, on in pairs:
            if waiter == node and on not in seen:
                seen.add(on)
                todo.append(on)
    return seen


def test_a_cycle_is_a_hang_though_no_other_rank_waits_on_it() -> None:
    (hang,) = Graph({}, _in(0, [1], "0", 1, "send") + _in(1, [0], "0", 1, "send")).hangs()
    assert hang.cycle and hang.ranks == (0, 1) and hang.upstream == ()
