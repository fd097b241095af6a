"""``hangwatch status`` says, per rank, whether its hook records calls in C or in Python and why,
and when a hook turned its call capture off (issue 36): each rank tells the first in its
registration (``hook_version``), the second in its ring (a ``capture_off`` marker).

Real sessions (their rings, their identities as a rank registers them) over a fake c10d; a real
coordinator takes their registrations and what their rings hold; the real CLI renderer.
"""

from __future__ import annotations

import dataclasses
import io

import pytest

from hangwatch import native
from hangwatch.cli.render import render_status
from hangwatch.client import capture
from hangwatch.client import session as session_mod
from hangwatch.client.session import Session
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import RingReader
from tests.client.fakes import FakeC10d, SlotDecoder, make_session


def _registered(c: Coordinator, rank: int, monkeypatch: pytest.MonkeyPatch, native_env: str) -> Session:
    monkeypatch.setenv("HANGWATCH_NATIVE", native_env)
    s = make_session(rank=rank, c10d=FakeC10d(rank, world_size=2))
    s.identity = dataclasses.replace(s.identity, session=f"s{rank}", hook_version=session_mod.hook_version())
    c.accept_registration(s.identity)
    return s


def _ship(c: Coordinator, s: Session) -> None:
    """What the rank's ring holds, to the coordinator, as its node agent would send it."""
    reader = RingReader(s.sink.fd)
    events = SlotDecoder(s.identity.rank).decode(reader.poll())
    reader.close()
    c.report(pb.ReportBatch(session=s.identity.session, rank=s.identity.rank), events)


def test_status_tells_each_ranks_hook_path_and_a_capture_turned_off(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _registered(coordinator, 0, monkeypatch, "1")
    b = _registered(coordinator, 1, monkeypatch, "0")
    capture.set_session(b)  # b's hook records calls, then turns itself off
    b.fail("recording a call", ValueError("a broken memo"))
    b.fail("recording a call", ValueError("a broken memo"))  # off already: said once
    assert capture.active_session() is None
    for s in (a, b):
        _ship(coordinator, s)
    data = coordinator.status()
    assert data is not None
    ranks = {rk["rank"]: rk for rk in data["ranks"]}
    built = native.module() is not None
    assert ranks[0]["hook"] == ("native" if built else native.describe()) and ranks[0]["capture_off"] is None
    assert ranks[1]["hook"] == "python: HANGWATCH_NATIVE=0"
    assert ranks[1]["capture_off"] == "internal error while recording a call (ValueError: a broken memo)"
    out = io.StringIO()
    render_status(data, out)
    text = out.getvalue()
    assert "hook: rank 1 record calls in Python, not C: HANGWATCH_NATIVE=0" in text
    assert "capture off: rank 1 stopped recording calls: internal error while recording a call" in text
    assert ("hook: rank 0" in text) is not built


def test_a_free_threaded_interpreter_never_loads_the_c_build_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading it would turn the GIL back on for the whole process: the hook records in Python,
    logs one line, and the rank says why."""
    monkeypatch.setattr(native.sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else None)
    native._reset()
    try:
        for _ in range(3):
            assert native.module() is None
        why = "a free-threaded interpreter (the C fast path relies on the GIL)"
        assert native.describe() == f"python: {why}"
        assert session_mod.hook_version().endswith(f"(python: {why})")
    finally:
        native._reset()  # loaded again, as it is, by the next test
    assert [rec.getMessage() for rec in caplog.records] == [f"hangwatch: {why}: the hook records in Python"]
