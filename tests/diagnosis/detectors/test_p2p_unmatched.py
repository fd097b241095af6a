"""Blocked sends/recvs whose peer is busy elsewhere (hangwatch.diagnosis.detectors.p2p_unmatched)."""

from __future__ import annotations

import pytest

from hangwatch.diagnosis.detectors.p2p_unmatched import unmatched_p2p
from hangwatch.records import CallRecord
from tests.diagnosis.rules._calls import call, t


def _p2p(rank: int, op: str, peer: int, *, enter: float = 0.0, group: str = "0", cid: int = 1) -> CallRecord:
    return call(rank, op, ins=[t(4)], peer=peer, enter=enter, group=group, call_id=cid, site=f"p.py:{rank}")


def test_unmatched_send_to_busy_receiver() -> None:
    calls = [_p2p(1, "send", 2), _p2p(2, "recv", 0)]
    found = [m for _, m in unmatched_p2p(calls, now=100.0, grace_s=10.0)]
    assert len(found) == 1
    assert unmatched_p2p(calls, now=100.0, grace_s=10.0)[0][0] is calls[0]  # the call it starts from
    m = found[0]
    assert m.kind == "p2p_mismatch"
    assert "rank 1 sends to rank 2, but rank 2 is receiving from rank 0" in m.summary
    assert m.culprit_ranks == (1, 2)


def test_unmatched_send_send_deadlock_reported_once() -> None:
    found = [m for _, m in unmatched_p2p([_p2p(0, "send", 1), _p2p(1, "send", 0)], now=100.0, grace_s=10.0)]
    assert len(found) == 1
    assert "rank 0 sends to rank 1, but rank 1 is also sending to rank 0" in found[0].summary
    assert "receives first" in found[0].hint


def test_unmatched_recv_recv_deadlock() -> None:
    found = [m for _, m in unmatched_p2p([_p2p(0, "recv", 1), _p2p(1, "irecv", 0)], now=100.0, grace_s=10.0)]
    assert len(found) == 1
    assert "also receiving from rank 0" in found[0].summary


def test_unmatched_different_group() -> None:
    found = [m for _, m in unmatched_p2p([_p2p(0, "send", 1), _p2p(1, "recv", 0, group="7")], now=100.0, grace_s=10.0)]
    assert len(found) == 1  # one disagreement, seen from both sides
    assert "rank 0 sends to rank 1, but rank 1 is receiving from rank 0 in group 7" in found[0].summary


@pytest.mark.parametrize(
    "calls",
    [
        pytest.param([_p2p(0, "send", 1), _p2p(1, "recv", 0)], id="in flight"),
        pytest.param([_p2p(0, "isend", 1), _p2p(1, "irecv", 0)], id="in flight async"),
        pytest.param([_p2p(0, "send", 1, enter=95.0), _p2p(1, "recv", 2, enter=95.0)], id="young"),
        pytest.param([_p2p(0, "send", 1)], id="peer not in p2p"),
        pytest.param(
            [
                _p2p(0, "isend", 1, cid=1),
                _p2p(0, "irecv", 1, cid=2),
                _p2p(1, "isend", 0, cid=1),
                _p2p(1, "irecv", 0, cid=2),
            ],
            id="batched exchange",
        ),
        pytest.param([_p2p(0, "all_reduce", 1), _p2p(1, "recv", 2)], id="not p2p"),
    ],
)
def test_unmatched_p2p_none(calls: list[CallRecord]) -> None:
    assert unmatched_p2p(calls, now=100.0, grace_s=10.0) == []


def test_unmatched_p2p_ignores_finished_calls() -> None:
    done = call(2, "recv", ins=[t(4)], peer=0, exit_time=50.0)
    assert unmatched_p2p([_p2p(1, "send", 2), done], now=100.0, grace_s=10.0) == []
