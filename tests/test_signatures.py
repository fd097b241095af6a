"""Interned calls on the wire (``hangwatch.signatures``): what the coordinator rebuilds is what the
rank recorded, in an order that keeps the job state right, and bad or stale input is refused."""

from __future__ import annotations

import dataclasses
import math

from hangwatch import records as r
from hangwatch import signatures, wire
from hangwatch.columns import CallEncoder
from hangwatch.diagnosis import budget
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.signatures import CallDecoder
from tests import factories

F32 = r.TensorMeta((4, 8), "float32", "cuda")


def call(
    call_id: int, seq: int, *, op: str = "all_reduce", site: str = "train.py:10 in step", **kw: object
) -> r.CallRecord:
    """Rank 3's call (``factories.call``) with this file's defaults; ``kw`` overrides any field."""
    fields: dict[str, object] = {
        "inputs": (F32,),
        "reduce_op": "sum",
        "step": seq // 4,
        "call_site": site,
        "enter_time": 100.0 + seq,
    }
    fields.update(kw)
    rank = int(fields.pop("rank", 3))  # type: ignore[call-overload]
    return factories.call(rank, seq, op, call_id=call_id, **fields)  # type: ignore[arg-type]


def roundtrip(enc: CallEncoder, dec: CallDecoder, events: list[r.RankEvent]) -> tuple[list[r.RankEvent], int, int, int]:
    batch = pb.ReportBatch(rank=3)
    enc.encode(events, batch)
    wire_bytes = batch.SerializeToString()
    got, rejected, folded = dec.decode(3, pb.ReportBatch.FromString(wire_bytes))
    return got, rejected, folded, len(wire_bytes)


def test_calls_come_back_equal_with_exits_folded_in() -> None:
    enc, dec = CallEncoder(), CallDecoder()
    group = r.GroupInfo("1", (0, 3), "gloo", 1, "tp")
    events: list[r.RankEvent] = [
        r.GroupEvent(3, r.GroupEventKind.CREATED, group, 99.0, "train.py:5"),
        r.StepEvent(3, 1, 100.5),
    ]
    expected: list[r.CallRecord] = []
    for i in range(1, 9):
        c = call(i, i, extra={"group_ranks": "0,3"} if i % 2 else {})
        events.append(c)
        events.append(r.CallExit(3, i, 100.0 + i + 0.25, None, 2 if i == 5 else 1))
        expected.append(call(i, i, extra=c.extra, exit_time=100.0 + i + 0.25, seq_count=2 if i == 5 else 1))
    p2p = call(9, 1, op="send", peer=0, reduce_op=None, group="1")
    events.append(p2p)  # still open at send time
    got, rejected, folded, _ = roundtrip(enc, dec, events)
    assert rejected == 0
    assert folded == 8  # the eight exits travelled inside their calls' entries
    assert got[0] == events[0]  # group creation first
    calls = [e for e in got if isinstance(e, r.CallRecord)]
    assert calls == [*expected, p2p]
    assert calls[-1].exit_time is None
    assert r.StepEvent(3, 1, 100.5) in got


def test_steady_loop_sends_a_few_numbers_per_call() -> None:
    enc, dec = CallEncoder(), CallDecoder()
    roundtrip(enc, dec, [call(i, i) for i in range(1, 101)])
    later, rejected, _, size_later = roundtrip(enc, dec, [call(i, i) for i in range(101, 201)])
    assert rejected == 0 and len(later) == 100
    assert later[0].call_site == "train.py:10 in step" and later[0].inputs == (F32,)
    full = pb.ReportBatch(rank=3)
    for i in range(101, 201):
        wire.event_to_pb(call(i, i), full.events.add())
    assert size_later * 4 < len(full.SerializeToString())  # vs every call spelled out
    again = pb.ReportBatch(rank=3)
    enc.encode([call(201, 201)], again)
    assert len(again.signatures) == 0  # the definition went once, with the first batch


def test_error_exits_stay_events_after_their_call_and_earlier_exits_come_first() -> None:
    enc, dec = CallEncoder(), CallDecoder()
    old = call(1, 1, async_op=True)
    roundtrip(enc, dec, [old])
    # batch 2: the async call from batch 1 ends, a new call enters and fails
    new = call(2, 2)
    events: list[r.RankEvent] = [new, r.CallExit(3, 1, 102.5, None, 3), r.CallExit(3, 2, 102.6, "RuntimeError: x")]
    got, rejected, folded, _ = roundtrip(enc, dec, events)
    assert rejected == 0 and folded == 0
    assert got[0] == r.CallExit(3, 1, 102.5, None, 3)  # before the call that would close it implicitly
    assert isinstance(got[1], r.CallRecord) and got[1].call_id == 2 and got[1].exit_time is None
    assert got[2] == r.CallExit(3, 2, 102.6, "RuntimeError: x")


def test_bounded_table_evicts_least_recently_used_and_redefines_its_id() -> None:
    enc, dec = CallEncoder(capacity=4), CallDecoder(capacity=4)
    sites = [f"train.py:{n} in step" for n in range(6)]
    for n, site in enumerate(sites[:4]):
        roundtrip(enc, dec, [call(n + 1, n + 1, site=site)])
    roundtrip(enc, dec, [call(10, 10, site=sites[0])])  # site 0 is now the most recent
    got, rejected, _, _ = roundtrip(enc, dec, [call(11, 11, site=sites[4]), call(12, 12, site=sites[0])])
    assert rejected == 0
    assert [c.call_site for c in got if isinstance(c, r.CallRecord)] == [sites[4], sites[0]]
    assert len(enc) == 4 and len(dec.table) == 4
    # site 1 was evicted: using it again defines it again, correctly
    got, rejected, _, _ = roundtrip(enc, dec, [call(13, 13, site=sites[1])])
    assert rejected == 0 and got[0].call_site == sites[1]  # type: ignore[union-attr]


def test_a_batch_never_redefines_an_id_it_already_used() -> None:
    enc, dec = CallEncoder(capacity=2), CallDecoder(capacity=2)
    events: list[r.RankEvent] = [call(n, n, site=f"train.py:{n}") for n in range(1, 5)]
    got, rejected, _, _ = roundtrip(enc, dec, events)
    assert rejected == 0
    assert [c.call_site for c in got if isinstance(c, r.CallRecord)] == [f"train.py:{n}" for n in range(1, 5)]


def test_unknown_ids_misaligned_columns_and_overflowing_tables_are_refused() -> None:
    dec = CallDecoder(capacity=2)
    batch = pb.ReportBatch(rank=0)
    batch.calls.signature.extend([7])
    batch.calls.call_id.extend([1])
    batch.calls.seq.extend([1])
    batch.calls.step.extend([0])
    batch.calls.enter_time.extend([1.0])
    batch.calls.exit_time.extend([math.nan])
    got, rejected, _ = dec.decode(0, batch)
    assert (got, rejected) == ([], 1)  # a signature this session never defined
    batch.signatures.add(id=7).call.op = "all_reduce"
    batch.calls.enter_time[0] = math.inf
    got, rejected, _ = dec.decode(0, batch)
    assert (got, rejected) == ([], 1)  # times that are not finite
    del batch.signatures[:]
    dec.table.clear()
    batch.calls.seq.append(2)  # columns of different lengths
    got, rejected, _ = dec.decode(0, batch)
    assert (got, rejected) == ([], 1)
    for sid in (1, 2, 3):
        batch.signatures.add(id=sid).call.op = "all_reduce"
    batch.signatures.add(id=4)  # no op: malformed
    _, rejected, _ = dec.decode(0, batch)
    assert len(dec.table) == 2 and rejected >= 2  # the third is over capacity, the fourth malformed


def test_reset_starts_both_tables_afresh() -> None:
    enc, dec = CallEncoder(), CallDecoder()
    roundtrip(enc, dec, [call(1, 1)])
    enc.reset()
    fresh = CallDecoder()  # what a restarted coordinator (or a new registration) holds
    got, rejected, _, _ = roundtrip(enc, fresh, [call(2, 2)])
    assert rejected == 0 and isinstance(got[0], r.CallRecord) and got[0].op == "all_reduce"


def test_calls_alike_travel_as_runs_where_the_coordinator_takes_them() -> None:
    """``CallEncoder.send_runs`` (``Columns.compact``): a stretch of calls alike is one column
    entry, and comes back as the calls it stands for; anything that breaks the stretch (another
    step, an open call, a coalesced call) travels as before."""
    events: list[r.RankEvent] = []
    for i in range(1, 41):
        done = i != 40  # the last is still under way
        events.append(call(i, i, step=0 if i <= 20 else 1, exit_time=100.0 + i + 0.5 if done else None,
                           seq_count=3 if i == 10 else 1))  # fmt: skip
    plain_enc, runs_enc = CallEncoder(), CallEncoder()
    runs_enc.send_runs = True
    plain, _, _, plain_size = roundtrip(plain_enc, CallDecoder(), events)
    got, rejected, folded, size = roundtrip(runs_enc, CallDecoder(), events)
    assert rejected == 0 and folded == 39
    runs = [e for e in got if isinstance(e, r.CallRun)]
    assert [(run.first_seq, len(run)) for run in runs] == [(1, 9), (11, 10), (21, 19)]
    flat = [c for e in got for c in (e.calls() if isinstance(e, r.CallRun) else [e])]
    assert flat == plain
    assert size < plain_size


def test_a_signature_many_ranks_define_is_decoded_once_and_each_template_is_its_rank_s() -> None:
    """A job's ranks define the same calls in their first steps (262,144 definitions at 16,384
    ranks): decoded once, each rank's template is its own, with its rank and its charge."""
    signatures._DECODED.clear()
    charged: list[int] = []
    batch = pb.ReportBatch(rank=0)
    sig = batch.signatures.add(id=1)
    wire.call_to_pb(call(1, 1, site="train.py:77 in once"), sig.call)
    calls = 0
    real = signatures.wire.call_from_pb

    def counted(rank: int, msg: pb.Call) -> r.CallRecord:
        nonlocal calls
        calls += 1
        return real(rank, msg)

    signatures.wire.call_from_pb = counted  # type: ignore[assignment]
    try:
        tables = []
        for rank in range(8):
            dec = CallDecoder(cost=budget.call_bytes, charge=lambda n: charged.append(n) is None)
            dec.decode(rank, batch)
            tables.append(dec.table[1])
    finally:
        signatures.wire.call_from_pb = real  # type: ignore[assignment]
    assert calls == 1
    assert [t.rank for t in tables] == list(range(8))
    assert len({id(t) for t in tables}) == 8  # one each: what the job state keeps on it is the rank's
    assert charged == [budget.call_bytes(tables[0])] * 8
    assert tables[5] == dataclasses.replace(real(5, sig.call), cost=tables[5].cost)
    bad = pb.ReportBatch(rank=0)
    bad.signatures.add(id=2)  # no op: refused each time, never kept
    for rank in range(2):
        assert CallDecoder().decode(rank, bad)[1] == 1
