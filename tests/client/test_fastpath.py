"""The wrapper's fast path (issue 16): a call site that repeats its call is recorded from what was
remembered of it. What it writes must be what the general path writes, call for call; anything
that differs (a shape, a dtype, another argument, another group, an error) must be seen. Every
test runs with the fast path in C (``_fastpath.c``, where built) and in Python
(``HANGWATCH_NATIVE=0``); the C one must write the Python one's slots byte for byte.

Seams faked as in ``test_recorder``: torch's c10d (``FakeC10d``), its tensors and reduce ops
(``ones``, ``REDUCE_MAX``) and the backend call (a function that advances the group's sequence
number as the backend would). The real wrapper, the real ``Recorder`` and its ring, read back
through ``recorded``. No torch: ``scripts/check_native.py`` runs these on every Python the machine
has; the one test that instruments torch itself skips without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hangwatch import records as r
from hangwatch.client import capture
from hangwatch.client.ops import OPS_BY_NAME
from hangwatch.client.session import Session
from tests.client.fakes import FLOAT64, REDUCE_MAX, FakeC10d, make_session, ones, recorded

NATIVE = [True, False] if capture._native is not None else [False]


@pytest.fixture(params=NATIVE, ids=lambda native: "C" if native else "Python")
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Which fast path the wrappers made in the test take."""
    monkeypatch.setenv("HANGWATCH_NATIVE", "1" if request.param else "0")
    return bool(request.param)


@pytest.fixture
def linked(native: bool) -> Iterator[Session]:
    """A session as a linked rank has it: Flight Recorder read from outside (``covers`` off)."""
    session = make_session(c10d=FakeC10d(0, world_size=2))
    session.recorder.covers = False
    capture.set_session(session)
    yield session
    capture.set_session(None)


def _backend(session: Session, fail: bool = False) -> Callable[..., Any]:
    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        pg = group if group is not None else session.recorder.default_pg
        pg.seq += 1
        if fail:
            raise RuntimeError("Connection closed by peer")

    return all_reduce


def _calls(events: list[r.RankEvent]) -> list[tuple[Any, ...]]:
    return [
        (e.op, e.group, e.seq, e.inputs, e.reduce_op, e.call_site, e.step)
        for e in events
        if isinstance(e, r.CallRecord)
    ]


def _exits(events: list[r.RankEvent]) -> list[tuple[int, str | None]]:
    return [(e.seq_count, e.error) for e in events if isinstance(e, r.CallExit)]


def test_a_repeated_call_is_recorded_as_the_general_path_records_it(linked: Session) -> None:
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    line = sys._getframe().f_lineno + 2
    for _ in range(5):
        wrapped(t)  # one call site: the first call is remembered, the next four take the fast path
    assert len(linked.recorder.memo) == 1
    fast = recorded(linked.recorder)
    for _ in range(5):
        linked.recorder.memo.clear()  # the general path every time
        wrapped(t)
    general = recorded(linked.recorder)
    f32 = (r.TensorMeta((4,), "float32", "cpu"),)
    assert [c[:5] for c in _calls(fast)] == [("all_reduce", "0", seq, f32, "sum") for seq in range(1, 6)]
    assert [c[:5] for c in _calls(general)] == [("all_reduce", "0", seq, f32, "sum") for seq in range(6, 11)]
    site = f"test_fastpath.py:{line} in test_a_repeated_call_is_recorded_as_the_general_path_records_it"
    assert {c[5] for c in _calls(fast)} == {site}
    assert _exits(fast) == _exits(general) == [(1, None)] * 5


@pytest.mark.parametrize(
    "change",
    [
        lambda t: ((ones(5),), {}),  # another shape
        lambda t: ((ones(4, dtype=FLOAT64),), {}),  # another dtype
        lambda t: ((t,), {"op": REDUCE_MAX}),  # another argument
        lambda t: ((t, REDUCE_MAX), {}),  # the same, positional
    ],
)
def test_a_call_that_differs_is_seen(
    linked: Session, change: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]]
) -> None:
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    calls = []
    for i in range(4):
        args, kwargs = ((t,), {}) if i < 3 else change(t)
        calls.append((args, kwargs))
        wrapped(*args, **kwargs)  # one call site for all four
    recorded_calls = [e for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]
    last = recorded_calls[-1]
    args, kwargs = calls[-1]
    tensor = args[0]
    op = kwargs.get("op", args[1] if len(args) > 1 else None)
    assert last.inputs == (r.TensorMeta(tuple(tensor.shape), str(tensor.dtype)[6:], "cpu"),)
    assert last.reduce_op == ("max" if op is not None else "sum")
    assert [c.seq for c in recorded_calls] == [1, 2, 3, 4]


def test_another_group_at_the_same_call_site_is_seen(linked: Session) -> None:
    c10d = linked.recorder.c10d
    pair = c10d.new_group("1", [0, 1], desc="pair")
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    for group in (None, None, pair, pair, None):
        wrapped(t, group=group)
    groups = [(e.group, e.seq) for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]
    assert groups == [("0", 1), ("0", 2), ("1", 1), ("1", 2), ("0", 3)]


def test_an_error_on_the_fast_path_is_recorded_and_raised(linked: Session) -> None:
    ok = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    failing = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked, fail=True))
    t = ones(4)
    for fn in (ok, ok, failing):
        try:
            fn(t)  # one call site: the third call takes the fast path into a failing backend
        except RuntimeError as e:
            assert "closed by peer" in str(e)
    exits = _exits(recorded(linked.recorder))
    assert exits[:2] == [(1, None), (1, None)]
    assert exits[2][1] is not None and "Connection closed by peer" in exits[2][1]


def test_the_memo_is_forgotten_when_a_group_is_destroyed(linked: Session) -> None:
    from hangwatch.client import session as session_mod

    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    wrapped(ones(4))
    assert linked.recorder.memo
    previous, session_mod._session = session_mod._session, linked
    try:
        session_mod.before_destroy(linked.recorder.c10d.new_group("2", [0, 1]))
    finally:
        session_mod._session = previous
    assert not linked.recorder.memo


def test_a_broken_memo_never_reaches_the_callers_code(linked: Session) -> None:
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    wrapped(t)
    ((key, _),) = linked.recorder.memo.items()
    linked.recorder.memo[key] = ("garbage",)  # type: ignore[assignment]
    wrapped(t)  # the general path takes it: no exception
    assert len([e for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]) == 2


def test_a_rank_reading_flight_recorder_itself_keeps_the_general_path(linked: Session) -> None:
    linked.recorder.covers = True  # no agent reads its Flight Recorder: its Python seqs are kept
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    for _ in range(3):
        wrapped(t)
    assert [hi for _, hi in linked.recorder.python_seqs["0"]] == [1, 2, 3]


# ---- the C fast path ------------------------------------------------------------------------

needs_native = pytest.mark.skipif(capture._native is None, reason="the C fast path is not built here")


def _slots(session: Session) -> list[tuple[Any, ...]]:
    """The raw slots ``session``'s rank wrote since the last look, times and stamps left out
    (they differ from one run to the next), call ids made relative to the first."""
    from hangwatch.ring import RingReader

    reader = RingReader(session.sink.fd)
    slots = reader.poll().slots
    reader.close()
    first = next((s.call_id for s in slots if s.kind == 1), 0)
    return [(s.kind, s.flags, s.aux, s.ref, s.call_id - first, s.seq, s.step, s.arg) for s in slots]


def _program(wrapped: Callable[..., Any], session: Session) -> None:
    """A loop a user could write: one call site, steps, a group that changes, a new shape."""
    c10d = session.recorder.c10d
    pair = c10d.new_group("1", [0, 1], desc="pair")
    t, u = ones(4), ones(2, 3)
    for step in range(6):
        session.recorder.step = step
        group = pair if step == 3 else None
        tensor = u if step == 4 else t
        wrapped(tensor, group=group)
        wrapped(tensor, op=REDUCE_MAX, group=group)


@needs_native
def test_the_c_fast_path_writes_the_python_fast_paths_slots_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = {}
    for native in (True, False):
        monkeypatch.setenv("HANGWATCH_NATIVE", "1" if native else "0")
        session = make_session(c10d=FakeC10d(0, world_size=2))
        session.recorder.covers = False
        capture.set_session(session)
        try:
            wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(session))
            _program(wrapped, session)
            runs[native] = (_slots(session), getattr(wrapped, "served", None))
        finally:
            capture.set_session(None)
    (c_slots, served), (py_slots, none) = runs[True], runs[False]
    assert none is None  # HANGWATCH_NATIVE=0: the Python wrapper
    assert served == 4  # the repeats the C path took itself: steps 1 and 2 of each call site
    assert len(c_slots) > 20 and c_slots == py_slots


@needs_native
def test_the_c_fast_path_serves_the_repeats(linked: Session, native: bool) -> None:
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    for _ in range(10):
        wrapped(t)
    assert getattr(wrapped, "served", None) == (9 if native else None)  # all but the first


@needs_native
def test_the_c_wrapper_passes_for_the_function_it_wraps(linked: Session, native: bool) -> None:
    import inspect

    original = _backend(linked)
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], original)
    assert (type(wrapped).__name__ == "FastOp") is native
    assert wrapped.__name__ == original.__name__ and wrapped.__qualname__ == original.__qualname__
    assert wrapped.__wrapped__ is original and wrapped.__hangwatch_original__ is original  # type: ignore[attr-defined]
    assert inspect.signature(wrapped) == inspect.signature(original)

    class Holder:
        reduce = wrapped

    holder = Holder()
    bound = holder.reduce
    assert bound.__self__ is holder and bound.__func__ is wrapped  # bound like a function
    assert Holder.reduce is wrapped  # not bound on the class


@needs_native
def test_an_instrumented_torch_function_pickles_by_name(native: bool) -> None:
    import pickle

    dist = pytest.importorskip("torch.distributed")
    capture.uninstrument()
    try:
        assert capture.instrument()
        hooked = dist.all_reduce
        assert pickle.loads(pickle.dumps(hooked)) is hooked  # pickled by name, as the function is
    finally:
        capture.uninstrument()
    assert not hasattr(dist.all_reduce, "__hangwatch_original__")


@needs_native
def test_a_call_nested_in_a_recorded_call_is_not_recorded_again(linked: Session) -> None:
    inner = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    for _ in range(3):
        inner(t)  # remembered, and served fast
    recorded(linked.recorder)

    def outer_backend(obj: Any, group: Any = None) -> None:
        for _ in range(2):
            inner(t)  # inside broadcast_object_list: torch's own calls, not the user's

    outer = capture._wrap_op(OPS_BY_NAME["broadcast_object_list"], outer_backend)
    outer([1])
    calls = [e.op for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]
    assert calls == ["broadcast_object_list"]


def _general_inside() -> int:
    return capture._native.general_inside() if capture._native is not None else 0


def test_a_nested_call_from_a_remembered_call_site_is_not_recorded_again(linked: Session, native: bool) -> None:
    """The call site inside the outer call has a memo (the user's helper, called alone first):
    the fast path must see it is nested, in whichever thread, and leave it unrecorded, also
    where the outer call raises."""
    import threading

    inner = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)

    def step() -> None:
        inner(t)  # one call site, remembered below

    for _ in range(3):
        step()
    served = getattr(inner, "served", 0)
    assert served == (2 if native else 0)  # the first call remembered it; the C path served the rest
    recorded(linked.recorder)
    inside, release = threading.Event(), threading.Event()

    def outer_backend(obj: Any, group: Any = None) -> None:
        step()
        inside.set()
        release.wait(10)
        step()
        if obj == ["fail"]:
            raise RuntimeError("the outer call failed")

    outer = capture._wrap_op(OPS_BY_NAME["broadcast_object_list"], outer_backend)
    thread = threading.Thread(target=outer, args=([1],))
    thread.start()
    assert inside.wait(10)
    assert _general_inside() == (1 if capture._native is not None else 0)
    for _ in range(3):
        step()  # another thread, not nested: recorded, and served fast meanwhile
    release.set()
    thread.join(10)
    with pytest.raises(RuntimeError, match="the outer call failed"):
        outer(["fail"])
    assert _general_inside() == 0  # left, the raising call too
    calls = [e.op for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]
    assert sorted(calls) == ["all_reduce"] * 3 + ["broadcast_object_list"] * 2
    assert getattr(inner, "served", 0) == (served + 3 if native else 0)


@needs_native
def test_calls_from_two_threads_each_get_their_own_slots(linked: Session) -> None:
    import threading

    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            for _ in range(500):
                wrapped(t)
        except BaseException as exc:  # pragma: no cover - the assertion below says what
            errors.append(exc)

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    events = recorded(linked.recorder)
    calls = [e for e in events if isinstance(e, r.CallRecord)]
    assert len(calls) == 1000 and len({c.call_id for c in calls}) == 1000
    exits = {c.call_id for c in calls if c.exit_time is not None} | {
        e.call_id for e in events if isinstance(e, r.CallExit)
    }
    assert exits == {c.call_id for c in calls}  # every call's exit, each in its own slot


@needs_native
def test_a_memo_of_another_code_object_is_never_used(linked: Session) -> None:
    """A memo key holds a code object's id; a code object freed and another made at its address
    would share it. The memo keeps its code object and both fast paths check it."""
    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], _backend(linked))
    t = ones(4)
    wrapped(t)
    ((key, memo),) = linked.recorder.memo.items()
    other = compile("pass", "elsewhere.py", "exec")
    linked.recorder.memo[key] = (*memo[:8], other, memo[9])
    recorded(linked.recorder)
    wrapped(ones(7))  # were the stale memo used, the call would be recorded with 4 elements
    (call,) = [e for e in recorded(linked.recorder) if isinstance(e, r.CallRecord)]
    assert call.inputs[0].shape == (7,)
    assert getattr(wrapped, "served", 0) == 0


@needs_native
def test_a_session_that_ends_is_let_go_by_the_c_wrappers(native: bool) -> None:
    import gc
    import weakref

    c10d = FakeC10d(0, world_size=2)
    session = make_session(c10d=c10d)
    session.recorder.covers = False
    capture.set_session(session)
    pg = c10d._get_default_group()

    def backend(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        pg.seq += 1  # holds the group, not the session

    wrapped = capture._wrap_op(OPS_BY_NAME["all_reduce"], backend)
    for _ in range(3):
        wrapped(ones(4))
    gone = weakref.ref(session)
    capture.set_session(None)
    del session
    gc.collect()
    assert gone() is None
    wrapped(ones(4))  # no session: the call runs, unrecorded
    assert pg.seq == 4
