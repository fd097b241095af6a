"""A node agent holds a batch's trailing call under way back for one read (``RingEncoder._hold``,
runs of alike calls): the call must still reach the coordinator when the rank writes nothing more
(frozen inside it: no status rewrites, so no heartbeat is due), and a batch the coordinator
refused and that is sent again must carry what it carried the first time. Both found by an
independent review of issue 16's runs. Real ``RingServer``/``Shipper`` (``tests.agent.test_shipper``)."""

from __future__ import annotations

from typing import Any

import pytest

from hangwatch import link
from hangwatch import records as r
from hangwatch.agent.shipper import STEADY_S, TICK_S
from hangwatch.client.ringsink import RingSink
from hangwatch.ring import Kind, RingReader, RingWriter
from hangwatch.ringwire import RingEncoder, call_blob
from hangwatch.testing import wait_for
from tests.agent.test_shipper import Intake, agent  # noqa: F401

META = (r.TensorMeta((4,), "float32"),)


def _ids(events: list[r.RankEvent]) -> list[int]:
    out: list[int] = []
    for e in events:
        if isinstance(e, r.CallRecord):
            out.append(e.call_id)
        elif isinstance(e, r.CallRun):
            out.extend(range(e.first_call_id, e.first_call_id + len(e.enters)))
    return out


class RunsIntake(Intake):
    def accept_registration(self, identity: r.RankIdentity, via: str = "direct") -> Any:
        reply = super().accept_registration(identity, via)
        reply.takes_runs = True  # a coordinator that takes runs (the default)
        return reply


def _call(call_id: int, done: bool = True) -> r.CallRecord:
    t = float(call_id)
    return r.CallRecord(0, call_id, "all_reduce", "0", call_id, META, META, "sum", enter_time=t,
                        exit_time=t + 0.5 if done else None, call_site="t.py:1")  # fmt: skip


@pytest.mark.parametrize("runs", [False, True])
def test_a_rank_frozen_inside_a_steady_call_has_that_call_sent(agent: Any, runs: bool) -> None:  # noqa: F811
    server, shipper, intake = agent
    if runs:
        intake.__class__ = RunsIntake
    sink = RingSink(256, rank=0)
    sock = link.connect(server.path, {"job_id": "j", "rank": 0, "world_size": 2, "session": "s0"}, [sink.fd])
    try:
        wait_for(lambda: server.links(), 5, 0.02, "the link")
        sink.set_status("t.py:1 in step\nt.py:1 in step", 1.0)  # written once: then it freezes
        sink.put(_call(1))
        shipper.tick()
        shipper.tick()
        for i in range(2, 6):
            sink.put(_call(i))
        sink.put(_call(6, done=False))  # the call it freezes in: the rank writes nothing more

        def sent() -> bool:  # ticks as the agent's loop makes them (a steady rank is read every STEADY_S)
            shipper.tick()
            return _ids(intake.events.get(0, [])) == [1, 2, 3, 4, 5, 6]

        wait_for(sent, 2 * STEADY_S + 1.0, TICK_S, "the call it froze in")
    finally:
        sock.close()
        sink.close()


def test_a_batch_sent_again_carries_what_it_carried() -> None:
    """The shipper sends the same read again after the coordinator asked the rank to register
    (``held_mark``/``held_restore`` around the refused attempt): no call lost, none reordered."""
    w = RingWriter(capacity=1024, blob_bytes=1 << 16, rank=0)
    ref = w.blob(call_blob(r.CallRecord(0, 0, "all_reduce", "0", 0, META, META, "sum", call_site="t.py:1")))
    reader, enc = RingReader(w.fd), RingEncoder()
    enc.hold = True

    def call(i: int, done: bool = True) -> None:
        w.write(Kind.ENTER, 0, 0, ref, i, i, 0, 0, float(i))
        if done:
            w.write(Kind.EXIT, 0, 1, 0, i, 0, 0, 0, i + 0.5)

    call(1)
    seen = _ids(enc.decode(reader.poll(100), 0))  # the first call, alone
    call(2)
    call(3)
    call(4, done=False)  # read while call 4 is under way: held back
    seen += _ids(enc.decode(reader.poll(100), 0))
    assert seen == [1, 2, 3]
    w.write(Kind.EXIT, 0, 1, 0, 4, 0, 0, 0, 4.5)
    call(5)
    call(6, done=False)
    pending = reader.poll(100)
    mark = enc.held_mark()
    enc.decode(pending, 0)  # refused by the coordinator: not applied
    enc.held_restore(mark)
    seen += _ids(enc.decode(pending, 0))  # registered again: the same records again
    assert seen == [1, 2, 3, 4, 5]  # 6 waits for the next read
    assert _ids(enc.decode(reader.poll(100), 0)) == [6]
    w.close()
    reader.close()
