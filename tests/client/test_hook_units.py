"""The hook's own machinery, directly: the bounded ring, the post-import hook, idempotent
instrument/uninstrument, internal errors contained, and the explicit step API."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest

from hangwatch import records as r
from hangwatch.client import capture, importhook
from hangwatch.client.ops import OPS_BY_NAME
from hangwatch.client.ringsink import RingSink
from tests.client.fakes import RingTap


def test_the_ring_overwrites_the_oldest_and_counts_instead_of_blocking() -> None:
    sink = RingSink(capacity=3)
    tap = RingTap(sink)
    for i in range(10):
        sink.put(r.StepEvent(0, i, 0.0))
    assert [e.step for e in tap.drain()] == [7, 8, 9] and tap.lost == 7  # what the rank did last
    assert tap.drain() == []


def test_post_import_hook_runs_once_after_the_module_executes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hw_probe_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    importhook.when_imported("hw_probe_mod", lambda m: seen.append(m.VALUE))  # type: ignore[attr-defined]
    assert seen == []
    import hw_probe_mod  # type: ignore[import-not-found]  # noqa: F401

    assert seen == [42]
    importhook.when_imported("hw_probe_mod", lambda m: seen.append(0))  # already imported: runs now
    assert seen == [42, 0]
    sys.modules.pop("hw_probe_mod", None)


def test_instrument_is_idempotent_and_uninstrument_restores() -> None:
    import torch.distributed as dist

    original = dist.all_reduce
    was = capture.is_instrumented()
    try:
        assert capture.instrument() and capture.instrument()
        wrapped = dist.all_reduce
        assert getattr(wrapped, "__hangwatch_original__", None) is not None
        assert capture.instrument() and dist.all_reduce is wrapped  # not wrapped twice
        capture.uninstrument()
        capture.uninstrument()
        assert getattr(dist.all_reduce, "__hangwatch_original__", None) is None
    finally:
        if was:
            capture.instrument()
        else:
            capture.uninstrument()
    assert (dist.all_reduce is original) or was


class _BrokenRecorder:
    def enter(self, spec: Any, params: Any) -> Any:
        raise RuntimeError("bug in the hook")


def test_an_internal_error_is_logged_once_disables_capture_and_never_reaches_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from hangwatch.client.session import Session

    calls: list[Any] = []

    def original(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> str:
        calls.append(tensor)
        return "result"

    session = types.SimpleNamespace(recorder=_BrokenRecorder(), _failures=set())
    session.fail = types.MethodType(Session.fail, session)
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], original)
    capture.set_session(session)
    try:
        with caplog.at_level(logging.WARNING, logger="hangwatch.client"):
            assert wrapped("t1") == "result"
            assert wrapped("t2") == "result"
        assert calls == ["t1", "t2"]  # the user's call always ran
        assert capture.active_session() is None  # capture turned itself off
        assert sum("internal error" in rec.message for rec in caplog.records) == 1
    finally:
        capture.set_session(None)


def test_step_api_is_a_no_op_without_a_session() -> None:
    import hangwatch

    hangwatch.step()  # no session: nothing happens, nothing raises
    hangwatch.step(10)
