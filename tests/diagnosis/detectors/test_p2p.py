"""Detector ``p2p``: sends and receives that disagree or wait for the wrong peer.

On constructed record sequences with an explicit clock (``tests.factories.SimJob``); split
from the former test_detectors.py, one file per detector module.
"""

from __future__ import annotations

from hangwatch.diagnosis.detectors import p2p
from tests.factories import T0, SimJob, only


def test_p2p_size_mismatch() -> None:
    sim = SimJob(2)
    sim.call(0, T0 + 1, op="send", peer=1, shape=(4,), site="pipe.py:10 in forward")
    sim.call(1, T0 + 1, op="recv", peer=0, shape=(8,), site="pipe.py:20 in forward")
    f = only(p2p.detect(sim.job, sim.ctx(T0 + 1.5)), "p2p_mismatch")
    assert f.culprit_ranks == [0, 1]
    assert "sizes differ" in f.summary


def test_p2p_matching_sizes_is_fine() -> None:
    sim = SimJob(2)
    sim.call(0, T0 + 1, op="send", peer=1, shape=(2, 4))
    sim.call(1, T0 + 1, op="recv", peer=0, shape=(8,))
    assert p2p.detect(sim.job, sim.ctx(T0 + 30)) == []


def test_p2p_wrong_peer_after_grace() -> None:
    sim = SimJob(3)
    sim.call(0, T0 + 1, op="send", peer=1)
    sim.call(1, T0 + 1, op="recv", peer=2)
    assert p2p.detect(sim.job, sim.ctx(T0 + 2)) == []  # within the grace
    f = only(p2p.detect(sim.job, sim.ctx(T0 + 4)), "p2p_mismatch")
    assert f.culprit_ranks == [0, 1]
    assert "rank 0 sends to rank 1, but rank 1 is receiving from rank 2" in f.summary
    engine = sim.engine()
    sim.beat(T0 + 4)
    engine.tick(T0 + 4)
    sim.beat(T0 + 5)
    engine.tick(T0 + 5)
    assert [inc.kind for inc in engine.incidents.values()] == ["p2p_mismatch"]
