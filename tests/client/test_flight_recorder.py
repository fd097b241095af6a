"""``FlightRecorderPoller`` fed real Flight Recorder dumps.

Seam faked: the dump function (``FlightRecorderPoller(recorder, dump=...)``), which returns a dump
saved from real gloo process groups by ``tests/fixtures/flight_recorder/generate.py`` (torch 2.13,
``TORCH_FR_BUFFER_SIZE=2000``; never hand-edited). The Recorder is real, over a fake c10d
(:mod:`tests.client.fakes`): the Python calls the generating script made are replayed through
``Recorder.enter``/``exit`` with the sequence numbers the real group reported (``calls.json``), so
the poller sees exactly the coverage a hooked rank would have. Entries that gloo never writes
(NCCL's p2p entries and spellings) are derived from a real entry inside the test.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from hangwatch import records as r
from hangwatch.client.flight_recorder import FlightRecorderPoller
from hangwatch.client.ops import OPS_BY_NAME
from hangwatch.client.recorder import Recorder
from hangwatch.client.ringsink import RingSink
from hangwatch.flight_entries import FR_DTYPES
from tests.client.fakes import FakeC10d, recorded

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "flight_recorder"
CALLS: dict[str, list[dict[str, Any]]] = json.loads((FIXTURES / "calls.json").read_text())


def _dump(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def _recorder() -> Recorder:
    c10d = FakeC10d(rank=0, world_size=2)
    rec = Recorder(0, RingSink(1000), c10d)
    rec.default_pg = c10d.default
    rec.group_info(c10d.default)
    _drain(rec)
    return rec


_drain = recorded


def _replay(rec: Recorder, fixture: str, *, skip: int | None = None, open_last: bool = False) -> list[int]:
    """The script's Python calls, through the recorder, with the real group's sequence numbers.
    ``skip``: leave that call out (as if issued from C++); ``open_last``: the last call has entered
    and not returned. Returns the call ids."""
    pg = rec.default_pg
    ids = []
    calls = CALLS[fixture]
    for i, call in enumerate(calls):
        if i == skip:
            pg.seq = call["after"]  # issued all the same, from C++: the group's count moves on
            continue
        params: dict[str, Any] = {"tensor": None}
        if call["op"] in ("send", "recv"):
            params["dst" if call["op"] == "send" else "src"] = 1
        pg.seq = call["before"]
        raw, group, before = rec.enter(OPS_BY_NAME[call["op"]], params)
        ids.append(raw[0])
        if open_last and i == len(calls) - 1:
            break
        pg.seq = call["after"]
        rec.exit(raw, group, before, None)
    _drain(rec)  # the Python calls' own records: not what these tests look at
    return ids


def _poll(rec: Recorder, dump: bytes | str) -> list[r.RankEvent]:
    return _poll_with(FlightRecorderPoller(rec, dump=lambda *_: dump), rec)


def _poll_with(poller: FlightRecorderPoller, rec: Recorder) -> list[r.RankEvent]:
    poller.poll()
    return _drain(rec)


def _records(events: list[r.RankEvent]) -> list[r.CallRecord]:
    return [e for e in events if isinstance(e, r.CallRecord)]


def test_the_fixture_is_a_real_torch_dump() -> None:
    dump = json.loads(_dump("one_rank.json"))
    assert dump["version"] == "2.10"
    entry = dump["entries"][0]
    for key in ("collective_seq_id", "p2p_seq_id", "is_p2p", "process_group", "profiling_name", "input_sizes"):
        assert key in entry
    assert entry["process_group"] == ["0", "default_pg"]


def test_ddp_issued_collectives_become_records_aligned_by_collective_seq_id() -> None:
    rec = _recorder()
    python_ids = _replay(rec, "one_rank.json")
    events = _poll(rec, _dump("one_rank.json"))
    records = _records(events)
    # seqs 1, 2, 7 were Python calls; 3-6 came from DDP's constructor and its gradient bucket
    assert [(c.seq, c.op) for c in records] == [
        (3, "all_gather"),
        (4, "broadcast"),
        (5, "broadcast"),
        (6, "all_reduce"),
    ]
    bucket = records[-1]
    assert bucket.group == "0" and bucket.inputs == (r.TensorMeta((27,), "float32", "cpu"),)
    assert bucket.outputs == ()  # flattened by Flight Recorder: not comparable, not sent
    assert bucket.source == "flight_recorder" and bucket.call_site == "issued from C++ (gloo:all_reduce)"
    entry = json.loads(_dump("one_rank.json"))["entries"][5]
    assert bucket.enter_time == entry["time_created_ns"] / 1e9
    assert records[1].inputs == (r.TensorMeta((6,), "int64", "cpu"),)
    # ids continue the recorder's own numbering; every retired entry is closed right away
    assert [c.call_id for c in records] == list(range(python_ids[-1] + 1, python_ids[-1] + 5))
    exits = [e for e in events if isinstance(e, r.CallExit)]
    assert [e.call_id for e in exits] == [c.call_id for c in records]
    assert all(e.error is None and e.seq_count == 1 for e in exits)


def test_python_issued_entries_are_not_reported_twice() -> None:
    rec = _recorder()
    _replay(rec, "one_rank.json")
    poller = FlightRecorderPoller(rec, dump=lambda *_: _dump("one_rank.json"))
    assert len(_records(_poll_with(poller, rec))) == 4
    assert _poll_with(poller, rec) == []  # the same ring again: nothing new


def test_without_the_hook_every_entry_is_reported() -> None:
    rec = _recorder()
    records = _records(_poll(rec, _dump("one_rank.json")))
    assert [c.seq for c in records] == [1, 2, 3, 4, 5, 6, 7]
    assert records[1].inputs == (r.TensorMeta((2, 3), "float64", "cpu"),)


def test_p2p_calls_are_absent_from_gloos_ring_and_do_not_shift_collective_seqs() -> None:
    entries = json.loads(_dump("two_ranks.json"))["entries"]
    assert [e["collective_seq_id"] for e in entries] == [1, 2, 3]
    assert [e["op_id"] for e in entries] == [1, 3, 4]  # op 2, the send, is not in the ring
    rec = _recorder()
    _replay(rec, "two_ranks.json")  # the recorder numbers the all_reduce after the send 2, too
    assert _poll(rec, _dump("two_ranks.json")) == []


def test_nccl_style_p2p_entries_are_ignored() -> None:
    dump = json.loads(_dump("two_ranks.json"))
    p2p = copy.deepcopy(dump["entries"][0])
    p2p.update(is_p2p=True, collective_seq_id=0, p2p_seq_id=1, profiling_name="nccl:send 0->1")
    dump["entries"].insert(1, p2p)
    rec = _recorder()
    records = _records(_poll(rec, json.dumps(dump)))
    assert [(c.seq, c.op) for c in records] == [(1, "all_reduce"), (2, "all_reduce"), (3, "barrier")]


def test_an_in_flight_entry_stays_open_until_flight_recorder_retires_it() -> None:
    rec = _recorder()
    _replay(rec, "two_ranks_in_flight.json", skip=2)  # the async all_reduce: as if from C++
    poller = FlightRecorderPoller(rec, dump=lambda *_: _dump("two_ranks_in_flight.json"))
    events = _poll_with(poller, rec)
    (record,) = _records(events)
    assert (record.seq, record.op, record.inputs) == (2, "all_reduce", (r.TensorMeta((2,), "bfloat16", "cpu"),))
    assert [e for e in events if isinstance(e, r.CallExit)] == []  # not retired: still running
    assert _poll_with(poller, rec) == []  # still not retired: nothing new
    poller._dump = lambda *_: _dump("two_ranks.json")
    events = _poll_with(poller, rec)
    closed = [e.call_id for e in events if isinstance(e, r.CallExit)]
    assert record.call_id in closed
    assert [c.seq for c in _records(events)] == [3]  # the barrier, not replayed either


def test_an_open_entry_closes_once_a_later_python_call_exists_on_its_group() -> None:
    rec = _recorder()
    _replay(rec, "two_ranks_in_flight.json", skip=2)
    poller = FlightRecorderPoller(rec, dump=lambda *_: _dump("two_ranks_in_flight.json"))
    (record,) = _records(_poll_with(poller, rec))
    pg = rec.default_pg
    raw, group, before = rec.enter(OPS_BY_NAME["barrier"], {})  # collective seq 3 on the group
    pg.seq += 1
    rec.exit(raw, group, before, None)
    _drain(rec)
    events = _poll_with(poller, rec)  # the ring still says not retired
    assert [e.call_id for e in events if isinstance(e, r.CallExit)] == [record.call_id]


def test_a_python_call_under_way_covers_its_entry() -> None:
    rec = _recorder()
    _replay(rec, "two_ranks_in_flight.json", open_last=True)  # the async all_reduce has not returned
    assert _poll(rec, _dump("two_ranks_in_flight.json")) == []


def test_dtype_and_op_names_map_to_torchs_spellings() -> None:
    dump = json.loads(_dump("two_ranks.json"))
    spelled = []
    for i, (name, dtype) in enumerate(
        [("nccl:allreduce", "Half"), ("nccl:_allgather_base", "Bool"), ("nccl:alltoall_base", "Int")]
    ):
        entry = copy.deepcopy(dump["entries"][0])
        entry.update(collective_seq_id=10 + i, profiling_name=name, input_dtypes=[dtype])
        spelled.append(entry)
    unknown = copy.deepcopy(dump["entries"][0])
    unknown.update(collective_seq_id=13, profiling_name="gloo:new_thing", input_dtypes=["Float8_e4m3fn"])
    dump["entries"] = [*spelled, unknown]
    records = _records(_poll(_recorder(), json.dumps(dump)))
    assert [(c.op, c.inputs[0].dtype) for c in records] == [
        ("all_reduce", "float16"),
        ("all_gather_into_tensor", "bool"),
        ("all_to_all_single", "int32"),
        ("new_thing", "float8_e4m3fn"),
    ]
    real = {
        d
        for name in ("one_rank.json", "two_ranks.json")
        for e in json.loads(_dump(name))["entries"]
        for d in e["input_dtypes"]
    }
    assert real <= set(FR_DTYPES)  # every dtype real dumps used has a mapping


def test_a_malformed_dump_is_ignored_and_turns_the_poller_off() -> None:
    for bad in (b"not json", b"[1, 2]", b""):
        rec = _recorder()
        poller = FlightRecorderPoller(rec, dump=lambda *_, bad=bad: bad)
        assert poller.enabled
        poller.poll()  # never raises
        assert not poller.enabled and _drain(rec) == [] and not poller.due(1e12)


def test_a_dump_function_that_raises_is_contained() -> None:
    def broken(*_: Any) -> bytes:
        raise RuntimeError("Flight Recorder is not enabled")

    rec = _recorder()
    poller = FlightRecorderPoller(rec, dump=broken)
    poller.poll()
    assert not poller.enabled and _drain(rec) == []


def test_entries_without_a_collective_seq_are_skipped() -> None:
    dump = json.loads(_dump("two_ranks.json"))
    dump["entries"][0].pop("collective_seq_id")
    dump["entries"][1]["process_group"] = None  # a missing group name reads as ""
    records = _records(_poll(_recorder(), json.dumps(dump)))
    assert [(c.group, c.seq) for c in records] == [("", 2), ("0", 3)]


def test_due_follows_the_interval_from_the_last_poll() -> None:
    rec = _recorder()
    poller = FlightRecorderPoller(rec, interval_s=5.0, dump=lambda *_: _dump("two_ranks.json"))
    assert poller.due(1e12)
    poller.poll()
    last = poller._last_poll
    assert not poller.due(last + 4.9) and poller.due(last + 5.0)


@pytest.mark.parametrize(
    "bad",
    [["not a dict"], [{"collective_seq_id": "x"}], [{"collective_seq_id": 1, "input_sizes": [["a"]]}], None],
)
def test_a_malformed_entry_is_skipped_and_the_rest_still_read(bad: Any) -> None:
    rec = _recorder()
    good = {"collective_seq_id": 2, "process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce",
            "input_sizes": [[4]], "input_dtypes": ["Float"], "retired": True}  # fmt: skip
    entries = None if bad is None else [*bad, good]
    poller = FlightRecorderPoller(rec, dump=lambda *_: json.dumps({"entries": entries}))
    poller.poll()
    assert poller.enabled
    recorded = [e for e in _drain(rec) if isinstance(e, r.CallRecord)]
    assert [(c.op, c.seq) for c in recorded] == ([] if bad is None else [("all_reduce", 2)])
    assert poller.skipped == (0 if bad is None else 1)


def test_a_call_under_way_when_coverage_turns_off_leaves_nothing_behind() -> None:
    """The sender thread turns coverage off (a rank linked to an agent again) while the main
    thread may be inside a call: its exit must still clear it, or on the next fallback the
    in-rank reader would take every later seq of the group for Python's (found by review)."""
    rec = _recorder()
    pg = rec.default_pg
    entry = json.loads(_dump("one_rank.json"))["entries"][0]

    def dump(*seqs: int) -> bytes:
        return json.dumps({"entries": [dict(copy.deepcopy(entry), collective_seq_id=s) for s in seqs]}).encode()

    rec.covers = True
    pg.seq = 0
    raw, group, before = rec.enter(OPS_BY_NAME["all_reduce"], {"tensor": None})
    rec.covers = False  # linked again, on the sender thread, while the call runs
    pg.seq = 1
    rec.exit(raw, group, before, None)
    _drain(rec)
    rec.covers = True  # the agent went away again
    current = dump(1)
    poller = FlightRecorderPoller(rec, dump=lambda *_: current)
    poller.skip_existing()
    current = dump(1, 2, 3)  # DDP's buckets, from C++
    poller.poll()
    assert [e.seq for e in _drain(rec) if isinstance(e, r.CallRecord)] == [2, 3]
