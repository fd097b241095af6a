"""A send against the recv paired with it (hangwatch.diagnosis.rules.p2p)."""

from __future__ import annotations

from hangwatch.diagnosis.rules import match_p2p
from tests.diagnosis.rules._calls import F64, call, objs, t


def test_match_p2p_same_numel_is_fine() -> None:
    send = call(0, "send", ins=[t(2, 5)], peer=1, seq=3)
    recv = call(1, "recv", ins=[t(10)], peer=0, seq=3)
    assert match_p2p(send, recv) is None


def test_match_p2p_size() -> None:
    send = call(0, "isend", ins=[t(10)], peer=1, seq=3, site="a.py:1")
    recv = call(1, "irecv", ins=[t(20)], peer=0, seq=3, site="b.py:2")
    m = match_p2p(send, recv)
    assert m is not None
    assert m.kind == "p2p_mismatch"
    assert m.culprit_ranks == (0, 1)
    assert m.summary == (
        "p2p mismatch in group 0 (pair seq 3): rank 0 sends [10] float32 (10 elements) to rank 1, "
        "but rank 1 receives [20] float32 (20 elements) (sizes differ)"
    )
    assert "a.py:1 on rank 0" in m.hint and "b.py:2 on rank 1" in m.hint
    assert set(m.details) == {0, 1}


def test_match_p2p_dtype() -> None:
    m = match_p2p(call(0, "send", ins=[t(4)], peer=1), call(1, "recv", ins=[t(4, dtype=F64)], peer=0))
    assert m is not None and "dtypes differ" in m.summary


def test_match_p2p_object_lists() -> None:
    send = call(0, "send_object_list", ins=[objs(2)], peer=1)
    assert match_p2p(send, call(1, "recv_object_list", ins=[objs(2)], peer=0)) is None
    m = match_p2p(send, call(1, "recv_object_list", ins=[objs(3)], peer=0))
    assert m is not None and "lengths differ" in m.summary


def test_match_p2p_unrecorded_tensors() -> None:
    assert match_p2p(call(0, "send", peer=1), call(1, "recv", ins=[t(3)], peer=0)) is None
