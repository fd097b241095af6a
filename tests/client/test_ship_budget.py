"""The hook's CPU budget where a rank ships its own records (issue 16): above ``SHIP_BUDGET`` of a
core, the sender ships less often (larger batches, longer runs), says so, and comes back to the
usual pace once well below it. ``ShipBudget`` alone, on clocks the test drives."""

from __future__ import annotations

from hangwatch.client.sender import MAX_INTERVAL_S, SHIP_BUDGET, ShipBudget


def _window(budget: ShipBudget, share: float, t: list[float], cpu: list[float]) -> float:
    """One budget window in which the thread used ``share`` of a core."""
    t[0] += budget.window_s
    cpu[0] += share * budget.window_s
    return budget.observe(cpu[0], t[0])


def test_over_budget_the_sender_ships_less_often_and_says_so() -> None:
    budget = ShipBudget(0.2)
    t, cpu = [100.0], [1.0]
    assert budget.observe(cpu[0], t[0]) == 0.2 and budget.note == ""
    assert _window(budget, SHIP_BUDGET / 2, t, cpu) == 0.2 and budget.note == ""  # within it: as usual
    seen = [_window(budget, SHIP_BUDGET * 3, t, cpu) for _ in range(8)]
    assert seen[:3] == [0.4, 0.8, 1.6]
    assert max(seen) == MAX_INTERVAL_S  # bounded: a rank still ships every few seconds
    assert "records shipped every 5 s, not every 0.2 s" in budget.note
    assert "6.0% of a core (kept under 2%)" in budget.note


def test_well_below_budget_it_comes_back_to_the_usual_pace() -> None:
    budget = ShipBudget(1.0)
    t, cpu = [0.0], [0.0]
    budget.observe(cpu[0], t[0])
    for _ in range(2):
        _window(budget, SHIP_BUDGET * 2, t, cpu)
    assert budget.interval_s == 4.0
    _window(budget, SHIP_BUDGET / 2, t, cpu)  # under the budget, not well under: it stays
    assert budget.interval_s == 4.0
    back = [_window(budget, SHIP_BUDGET / 10, t, cpu) for _ in range(3)]
    assert back == [2.0, 1.0, 1.0] and budget.note == ""


def test_a_window_is_judged_whole() -> None:
    budget = ShipBudget(0.2)
    budget.observe(0.0, 0.0)
    assert budget.observe(1.0, 1.0) == 0.2  # a whole core for a second, but the window is 5 s
    assert budget.observe(1.0, 5.0) == 0.4  # 1 s of CPU over 5 s: 20 %
