"""Runs of alike calls (issue 16): the embedded agent hands a rank's steady state to the job state
as ``records.CallRun``s, and the job state makes a call of a run only where a table needs one.
Nothing a detector says may change: the same rings, read in the same batches, ingested call by
call (``RingEncoder.decode(runs=False)``, as before) and as runs, must give the same incidents
and leave each rank in the same place.

Real rings (``RingWriter``) written as the hook writes them, real decoders, real ``JobState``s
and the real engine (``tests.factories.SimJob``); the programs are generated (hypothesis): a
training loop of collectives on the world group and a subgroup, healthy or with a fault on one
rank (another shape or op, a skipped call, a rank that stops, a hang), cut into batches of
random lengths per rank.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatch import records as r
from hangwatch.diagnosis import budget
from hangwatch.diagnosis.incidents import Incident
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Kind, RingReader, RingWriter
from hangwatch.ringwire import RingEncoder, call_blob, event_blob
from hangwatch.signatures import CallDecoder
from tests.factories import T0, SimJob, call

SITE_A = "train.py:10 in step"
SITE_B = "train.py:12 in step"


@dataclasses.dataclass(frozen=True)
class Sig:
    op: str = "all_reduce"
    shape: tuple[int, ...] = (4,)
    site: str = SITE_A


@dataclasses.dataclass
class Program:
    world: int
    seqs: list[Sig]  # what every rank calls on the world group, seq by seq (from 1)
    fault: str  # "none", "shape", "diverge", "op", "skip", "stop", "hang"
    rank: int  # the rank the fault is on
    at: int  # the seq it is at
    batches: list[list[int]]  # per rank: slots per batch, cycled
    sub_every: int  # a subgroup {0, 1} collective after every this many world seqs (0: none)
    cycles: bool = True  # where runs are sent, runs of a cycle of signatures too (``run_cycle``)
    anew: tuple[Sig, ...] = ()  # then the world group made anew, and these called at seqs 1.. of it
    #: NCCL: every host returns from its calls (the hang's too), and each round a progress read
    #: of the world group shows what the rank enqueued and, completed, what it had enqueued this
    #: many rounds before (0: gloo, no progress); nothing past a hang's seq completes
    device: int = 0


def _calls(p: Program, rank: int) -> list[tuple[str, int, Sig, bool]]:
    """What ``rank`` calls: (group, seq, signature, returns), in order."""
    out: list[tuple[str, int, Sig, bool]] = []
    sub = 0
    seqs = list(p.seqs)
    for i, sig in enumerate(seqs, start=1):
        done = True
        if p.fault in ("stop", "hang") and i >= p.at:
            if p.fault == "stop" and rank == p.rank:
                break  # it left: the others wait at ``at``
            if p.fault == "hang":
                if rank == p.rank:
                    break  # busy elsewhere, never calls
                done = False
            elif rank != p.rank:
                done = False
        if p.fault == "skip" and rank == p.rank and i >= p.at:
            # skipped one call: its seq i is the program's i + 1, and it stops one short
            if i == len(seqs):
                break
            sig = seqs[i]
        elif p.fault == "shape" and rank == p.rank and i == p.at:
            sig = dataclasses.replace(sig, shape=(*sig.shape, 2))
        elif p.fault == "diverge" and rank == p.rank and i >= p.at:
            sig = dataclasses.replace(sig, shape=(*sig.shape, 3))  # from here on (gloo's broadcast returns)
        elif p.fault == "op" and rank == p.rank and i == p.at:
            sig = dataclasses.replace(sig, op="broadcast")
        out.append(("0", i, sig, done))
        if not done:
            break
        if p.sub_every and rank in (0, 1) and i % p.sub_every == 0:
            sub += 1
            out.append(("sub", sub, Sig(shape=(2,), site=SITE_B), True))
    return out


def _ring(p: Program, rank: int) -> tuple[RingWriter, float]:
    """``rank``'s ring, as the hook fills it; and the time of its last record."""
    w = RingWriter(capacity=1 << 15, blob_bytes=1 << 20, rank=rank)
    w.write(Kind.EVENT, 0, 0, w.blob(event_blob(r.GroupEvent(rank, r.GroupEventKind.CREATED, _group("0", p), T0))),
            0, 0, 0, 0, T0)  # fmt: skip
    if p.sub_every and rank in (0, 1):
        info = _group("sub", p)
        w.write(Kind.EVENT, 0, 0, w.blob(event_blob(r.GroupEvent(rank, r.GroupEventKind.CREATED, info, T0))),
                0, 0, 0, 0, T0)  # fmt: skip
    refs: dict[tuple[str, Sig], int] = {}
    t = T0 + 1.0
    for call_id, (group, seq, sig, done) in enumerate(_calls(p, rank), start=1):
        key = (group, sig)
        if key not in refs:
            meta = (r.TensorMeta(sig.shape, "float32"),)
            record = r.CallRecord(rank, 0, sig.op, group, 0, meta, meta, "sum" if sig.op == "all_reduce" else None,
                                  0 if sig.op == "broadcast" else None, call_site=sig.site)  # fmt: skip
            refs[key] = w.blob(call_blob(record))
        t = T0 + 1.0 + call_id * 0.01 + rank * 0.001
        w.write(Kind.ENTER, 0, 0, refs[key], call_id, seq, 0, 0, t)
        if done or p.device:  # (NCCL: the host returns from a call its device never completes)
            w.write(Kind.EXIT, 0, 1, 0, call_id, 0, 0, 0, t + 0.002)
    if p.anew:  # destroyed, then made anew (the hook's next creation index): seqs from 1 again
        info = _group("0", p)
        w.write(Kind.EVENT, 0, 0, w.blob(event_blob(r.GroupEvent(rank, r.GroupEventKind.DESTROYED, info, t))),
                0, 0, 0, 0, t)  # fmt: skip
        info = _group("0", p, index=2)
        w.write(Kind.EVENT, 0, 0, w.blob(event_blob(r.GroupEvent(rank, r.GroupEventKind.CREATED, info, t))),
                0, 0, 0, 0, t)  # fmt: skip
        for seq, sig in enumerate(p.anew, start=1):
            call_id += 1
            key = ("0", sig)
            if key not in refs:
                meta = (r.TensorMeta(sig.shape, "float32"),)
                record = r.CallRecord(rank, 0, sig.op, "0", 0, meta, meta, "sum" if sig.op == "all_reduce" else None,
                                      0 if sig.op == "broadcast" else None, call_site=sig.site)  # fmt: skip
                refs[key] = w.blob(call_blob(record))
            t = T0 + 1.0 + call_id * 0.01 + rank * 0.001
            w.write(Kind.ENTER, 0, 0, refs[key], call_id, seq, 0, 0, t)
            w.write(Kind.EXIT, 0, 1, 0, call_id, 0, 0, 0, t + 0.002)
    return w, t


def _group(name: str, p: Program, index: int | None = None) -> r.GroupInfo:
    ranks = tuple(range(p.world)) if name == "0" else (0, 1)
    return r.GroupInfo(
        name=name, ranks=ranks, backend="gloo", index=(0 if name == "0" else 1) if index is None else index
    )


@dataclasses.dataclass
class Outcome:
    incidents: list[tuple[object, ...]]
    ranks: dict[int, tuple[object, ...]]
    received: int
    runs: int
    on_device: int = 0  # calls of runs on the device as they came (``JobState.device_calls``)
    opened: int = 0  # of those, made open calls where the device stopped at them


def _play(p: Program, runs: bool, wire: bool = False, hold: bool = False, fold: bool = False) -> Outcome:
    """Read every rank's ring in its batches, round after round, into a real job state, with a
    tick of the real engine after each round; then long enough after for a hang to be told.
    ``wire``: through the wire, as a remote agent or relay ships them (``RingEncoder.encode``,
    protobuf bytes, ``CallDecoder``), runs in column entries where ``runs``. ``hold``: as a node
    agent reads, a read that reached the ring's end holds its trailing call under way back for the
    next read, which sends it, empty or not (``Shipper._ship``): what that costs is one read of
    delay, the same with runs or without, so runs are compared with calls held alike. ``fold``:
    the coordinator folds what came call by call (``hangwatch.folds``)."""
    job = SimJob(p.world, registered=T0)
    readers = []
    decoders = [CallDecoder(cost=budget.call_bytes, charge=lambda n: True, fold=fold) for _ in range(p.world)]
    end = T0
    for rank in range(p.world):
        ring, last = _ring(p, rank)
        encoder = RingEncoder()
        encoder.send_runs = runs
        encoder.send_cycles = runs and p.cycles
        readers.append((ring, RingReader(ring.fd), encoder))
        end = max(end, last)
    cursors = [0] * p.world
    now = T0 + 1.0
    enqueued = [[0] for _ in range(p.world)]  # per rank, per round: its highest world seq delivered
    stop = p.at - 1 if p.fault in ("stop", "hang") else None

    def progress(rank: int, t: float) -> None:
        if not p.device:
            return
        seen = enqueued[rank]
        done = seen[max(0, len(seen) - 1 - p.device)]
        done = done if stop is None else min(done, stop)
        job.deliver(rank, [r.GroupProgress(rank, "0", seen[-1], -1, done, t)], t, sent_time=t)

    for rank in range(p.world):  # the agent's first read, before the rank's first batch
        progress(rank, now)
    busy = True
    while busy:
        busy = False
        now += 0.05
        for rank, (_, reader, encoder) in enumerate(readers):
            sizes = p.batches[rank]
            size = sizes[cursors[rank] % len(sizes)]
            batch = reader.poll(size)
            cursors[rank] += 1
            # as a node agent reads: a read that reached the ring's end holds its trailing call
            # under way back for the next read, which sends it, empty or not (``Shipper._ship``)
            encoder.hold = hold and len(batch.slots) < size
            if not batch.slots and not batch.blobs and not encoder.holding:
                continue
            busy = True
            if wire:
                msg = pb.ReportBatch(rank=rank)
                encoder.encode(batch, msg)
                events, rejected, _ = decoders[rank].decode(rank, pb.ReportBatch.FromString(msg.SerializeToString()))
                assert rejected == 0
            else:
                events = encoder.decode(batch, rank, budget.call_bytes, runs=runs)
            job.deliver(rank, events, now, sent_time=now)
            for ev in events:
                if type(ev) is r.CallRecord and ev.group == "0":
                    enqueued[rank][-1] = max(enqueued[rank][-1], ev.seq)
                elif type(ev) is r.CallRun and ev.template.group == "0":
                    enqueued[rank][-1] = max(enqueued[rank][-1], ev.last_seq)
        for rank in range(p.world):
            progress(rank, now)
            enqueued[rank].append(enqueued[rank][-1])
        job.tick(now)
    for dt in (1.0, 12.0, 25.0, 40.0):
        for rank in range(p.world):  # its agent reads on: progress stays fresh
            for _ in range(p.device + 1):
                enqueued[rank].append(enqueued[rank][-1])
            progress(rank, end + dt)
        job.beat(end + dt)
        job.tick(end + dt)
    incidents = sorted(_incident(inc) for inc in job.tick_engine.incidents.values())
    ranks = {}
    for rank, state in job.states.items():
        last = state.last_call
        ranks[rank] = (
            None if last is None else (last.group, last.seq, last.call_id, last.op, last.exit_time is None),
            state.step,
            state.last_call_id,
            sorted((c.group, c.seq) for c in state.open_calls.values()),
            {g: [(c.seq, c.call_id, c.call_site) for c in hist] for g, hist in state.history.items()},
        )
    for ring, reader, _ in readers:
        reader.close()
        ring.close()
    return Outcome(
        incidents, ranks, job.job.records_received, job.job.runs_taken, job.job.device_calls, job.job.device_opened
    )


def _incident(inc: Incident) -> tuple[object, ...]:
    return (
        str(inc.kind),
        inc.status,
        inc.summary,
        tuple(inc.culprit_ranks),
        tuple(inc.waiting_ranks),
        inc.group,
        inc.seq,
        inc.onset_time,
        inc.detected_time,
    )


@st.composite
def programs(draw: st.DrawFn) -> Program:
    world = draw(st.integers(2, 4))
    n = draw(st.integers(4, 160))
    # a training loop: a repeated pattern of one to three signatures
    pattern = draw(
        st.lists(
            st.sampled_from([Sig(), Sig(shape=(8,)), Sig(op="broadcast"), Sig(site=SITE_B), Sig(op="all_gather")]),
            min_size=1,
            max_size=3,
        )
    )
    seqs = [pattern[i % len(pattern)] for i in range(n)]
    fault = draw(st.sampled_from(["none", "none", "shape", "diverge", "op", "skip", "stop", "hang"]))
    rank = draw(st.integers(0, world - 1))
    at = draw(st.integers(2, n))
    batches = [draw(st.lists(st.integers(1, 300), min_size=1, max_size=4)) for _ in range(world)]
    sub_every = draw(st.sampled_from([0, 0, 3, 7]))
    return Program(world, seqs, fault, rank, at, batches, sub_every, draw(st.booleans()))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_runs_change_no_diagnosis_and_no_rank_state(p: Program) -> None:
    _same_both_ways(p)


def _same_both_ways(p: Program) -> None:
    """``p`` read call by call, and as runs (on the wire too), held or not: the same incidents,
    each rank left in the same place, the same calls received."""
    for hold in (False, True):
        alone = _play(p, runs=False, hold=hold)
        assert alone.runs == 0
        for runs in (
            _play(p, runs=True, hold=hold),
            _play(p, runs=True, wire=True, hold=hold),
            _play(p, runs=False, wire=True, hold=hold, fold=True),  # folded by the coordinator
        ):
            assert runs.incidents == alone.incidents
            assert runs.ranks == alone.ranks
            assert runs.received == alone.received


@st.composite
def on_device(draw: st.DrawFn) -> Program:
    """``programs``, on NCCL: progress read every round, the device a few rounds behind."""
    return dataclasses.replace(draw(programs()), device=draw(st.sampled_from([1, 2, 4])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(on_device())
def test_runs_on_the_device_change_no_diagnosis_and_no_rank_state(p: Program) -> None:
    """NCCL: calls alone are open until progress completes them; runs are taken whole, their
    calls on the device noted, and made open calls only where the device stops at one. The
    same incidents (kind, ranks, seq, onset, detection time) and each rank left in the same
    place, open calls included."""
    _same_both_ways(p)


@st.composite
def made_anew(draw: st.DrawFn) -> Program:
    """A healthy loop, then its process group made anew and another loop (other shapes, other
    ops) numbered from 1 again; batches cut at random."""
    world = draw(st.integers(2, 4))
    # (not this file's ``all_gather``: one output tensor for the whole group is wrong in itself)
    pool = [Sig(), Sig(shape=(8,)), Sig(op="broadcast"), Sig(site=SITE_B), Sig(shape=(16,)), Sig(shape=(2, 2))]
    loops = []
    for _ in range(2):
        pattern = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        n = draw(st.integers(2, 120))
        loops.append([pattern[i % len(pattern)] for i in range(n)])
    # (reads of 20 slots or more: ten calls a read keep up with the rings' 0.01 s a call; fewer
    # fall behind the calls' times, and their exits look 5 s late: a stalled transport)
    batches = [draw(st.lists(st.integers(20, 300), min_size=1, max_size=4)) for _ in range(world)]
    return Program(world, loops[0], "none", 0, 2, batches, 0, draw(st.booleans()), tuple(loops[1]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(made_anew())
def test_a_healthy_loop_made_anew_raises_nothing_however_it_is_read(p: Program) -> None:
    """Runs or calls one by one, on the wire or not, held or not: nothing raised, and each rank
    left in the same place (before: a false mismatch where the second loop met runs kept from
    the first at the same seqs)."""
    for hold in (False, True):
        alone = _play(p, runs=False, hold=hold)
        assert alone.incidents == []
        for runs in (
            _play(p, runs=True, hold=hold),
            _play(p, runs=True, wire=True, hold=hold),
            _play(p, runs=False, wire=True, hold=hold, fold=True),  # folded by the coordinator
        ):
            assert runs.incidents == []
            assert runs.ranks == alone.ranks


def test_runs_travel_on_the_wire_where_the_coordinator_takes_them() -> None:
    p = _steady(n=400, batch=200)
    assert _play(p, runs=True, wire=True).runs >= 3 * 3
    assert _play(p, runs=False, wire=True).runs == 0  # an older coordinator: calls one by one


def _steady(world: int = 3, n: int = 400, batch: int = 200, **kw: object) -> Program:
    return Program(world, [Sig()] * n, "none", 0, 1, [[batch]] * world, 0, **kw)  # type: ignore[arg-type]


def test_a_steady_loop_travels_as_runs_and_raises_nothing() -> None:
    p = _steady()
    out = _play(p, runs=True)
    assert out.incidents == []
    assert out.runs >= 3 * 3  # each rank's batches past its first call
    assert out.received == 3 * 400


def _layer(n: int = 400, batch: int = 200, world: int = 3, **kw: object) -> Program:
    """A hand-written tensor-parallel layer's loop: two collectives from two lines, over and over."""
    seqs = [Sig() if i % 2 else Sig(shape=(8,), site=SITE_B) for i in range(n)]
    return Program(world, seqs, "none", 0, 1, [[batch]] * world, 0, **kw)  # type: ignore[arg-type]


def test_a_loop_of_two_alternating_collectives_travels_as_cycles_and_raises_nothing() -> None:
    p = _layer()
    for wire in (False, True):
        out = _play(p, runs=True, wire=wire)
        assert out.incidents == []
        assert out.runs >= 3 * 3, out.runs  # each rank's batches past its first calls
        assert out.received == 3 * 400
    assert _play(dataclasses.replace(p, cycles=False), runs=True).runs == 0  # no runs of one signature


@pytest.mark.parametrize("fault", ["shape", "op", "skip", "hang"])
def test_a_fault_inside_a_loop_of_cycles_is_told_as_before(fault: str) -> None:
    p = dataclasses.replace(_layer(n=300), fault=fault, rank=1, at=151)
    alone, cycles = _play(p, runs=False), _play(p, runs=True)
    assert cycles.runs > 0
    assert cycles.incidents == alone.incidents
    assert cycles.incidents and all(1 in inc[3] for inc in cycles.incidents), cycles.incidents
    assert cycles.ranks == alone.ranks


@pytest.mark.parametrize("fault", ["shape", "op"])
def test_a_mismatch_inside_a_steady_loop_is_told_as_before(fault: str) -> None:
    p = dataclasses.replace(_steady(n=300), fault=fault, rank=2, at=150)
    alone, runs = _play(p, runs=False), _play(p, runs=True)
    assert runs.runs > 0
    assert runs.incidents == alone.incidents
    kinds = {inc[0] for inc in runs.incidents}
    assert kinds & {"shape_mismatch", "op_mismatch"}, runs.incidents
    assert any(inc[6] == 150 for inc in runs.incidents), runs.incidents


def test_a_rank_that_stops_inside_a_steady_loop_is_told_as_before() -> None:
    p = dataclasses.replace(_steady(n=300), fault="stop", rank=1, at=200)
    alone, runs = _play(p, runs=False), _play(p, runs=True)
    assert runs.runs > 0 and runs.incidents == alone.incidents
    assert runs.incidents and all(1 in inc[3] for inc in runs.incidents), runs.incidents


def test_a_call_cut_off_its_run_by_a_batchs_edge_goes_on_the_run() -> None:
    """A completed call that comes alone after its rank's run (the edge of a read one call from
    the end of a run) is taken as a run of one, not a call that makes a slot, which every other
    rank's run through its seq would then enter whole: at 1,024 ranks some rank sends such a
    call at nearly every step (``bench/ingest.py ceiling``). Rank 0 sends call 1 alone (its
    group's first call, made whole), calls 2-9, call 10 alone, calls 11-20; rank 1 call 1, then
    2-20: every call after the first travels in runs, and nothing changes but that."""
    p = Program(2, [Sig()] * 20, "none", 0, 2, [[3, 16, 2, 20], [3, 38]], 0)  # (a group event first)
    runs = _play(p, runs=True)
    assert runs.runs == 4  # rank 0: 2-9, 10, 11-20; rank 1: 2-20
    alone = _play(p, runs=False)
    assert runs.incidents == alone.incidents == []
    assert runs.ranks == alone.ranks and runs.received == alone.received == 40
    assert [seq for seq, _, _ in runs.ranks[0][4]["0"]] == list(range(1, 21))


def test_a_run_through_slots_enters_their_calls_whole_and_keeps_the_rest_as_the_run() -> None:
    """Rank 0 sends calls 1-10 alone, each making a slot; rank 1 then sends call 1, and 2-20 in a
    run. The run's calls at 2-10 are entered whole into those slots; 11-20 stay the run's in
    rank 1's history (before, every call of a run through any slot was made whole)."""
    p = Program(2, [Sig()] * 20, "none", 0, 2, [[3] + [2] * 9, [3, 38]], 0)
    job = SimJob(2, registered=T0)
    now = T0 + 1.0
    for rank in (0, 1):
        ring, _ = _ring(p, rank)
        reader, encoder = RingReader(ring.fd), RingEncoder()
        for size in p.batches[rank]:
            now += 0.01
            job.deliver(rank, encoder.decode(reader.poll(size), rank, budget.call_bytes), now, sent_time=now)
        reader.close()
        ring.close()
    hist = job.states[1].history["0"]
    assert len(hist) == 20 and [c.seq for c in hist.alone()] == list(range(1, 11))
    assert job.job.runs_taken == 1 and job.job.records_received == 30
    assert [c.seq for c in hist] == list(range(1, 21))  # made whole when read in order
    job.tick(now + 1)
    assert job.tick_engine.incidents == {}


def test_lone_calls_go_on_a_run_only_where_they_continue_it() -> None:
    """After a run of two, a rank sends one completed call a batch (a slow rank's pace). Each call
    that is the run's next, alike, goes on as a run of one on the run's own template (so the
    fault check's cache knows it, and no record is kept per call); a call alike to none does
    not, and makes its slot as before."""
    job = SimJob(2, registered=T0)
    t = T0
    for rank in (0, 1):
        job.apply(call(rank, 1, call_id=1, enter_time=t, exit_time=t + 0.001), t)
        template = dataclasses.replace(call(rank, 0, call_id=0), exit_time=None)
        job.apply(r.CallRun(rank, template, 2, 2, 0, [t + 0.01, t + 0.02], [t + 0.011, t + 0.021]), t)
    for seq in range(4, 400):
        t += 0.01
        for rank in (0, 1):
            job.apply(call(rank, seq, call_id=seq, enter_time=t, exit_time=t + 0.001), t)
    assert job.job.runs_taken == 2 + 2 * 396
    last = job.states[0].history["0"].last_run()
    assert last is not None and last.template.judged is not None  # judged once, on the run's own
    assert job.job.slots.get("0", {}) == {} or all(s <= 1 for s in job.job.slots["0"])
    t += 0.01
    other = call(0, 400, call_id=400, enter_time=t, exit_time=t + 0.001, inputs=(r.TensorMeta((8,), "float32"),))
    job.apply(other, t)  # not alike: a call, with its slot
    assert job.job.runs_taken == 2 + 2 * 396 and 400 in job.job.slots["0"]
    job.apply(call(1, 400, call_id=400, enter_time=t, exit_time=t + 0.001), t)  # the run's next, but a slot waits
    assert job.job.slots["0"][400].differs
    job.tick(t + 1)
    assert [str(i.kind) for i in job.tick_engine.incidents.values()] == ["shape_mismatch"]


def test_arrivals_name_the_highest_rank_of_a_tie_as_slots_do() -> None:
    """Ranks 2 and 3 always arrive together, last: from runs as from slots, rank 3 is named."""
    named = []
    for runs in (False, True):
        job = SimJob(4, registered=T0)
        for rank in range(4):
            lag = 1.0 if rank >= 2 else 0.0
            first = call(rank, 1, call_id=1, enter_time=T0 + lag, exit_time=T0 + lag + 0.01)
            job.apply(first, T0 + 1)
            enters = [T0 + 2 + i + lag for i in range(40)]
            template = dataclasses.replace(first, call_id=0, seq=0, enter_time=0.0, exit_time=None)
            run = r.CallRun(rank, template, 2, 2, 0, enters, [e + 0.01 for e in enters])
            for event in [run] if runs else run.calls():
                job.apply(event, T0 + 50)
        named.append(sorted({a[0] for a in job.job.arrivals["0"]}))
    assert named == [[3], [3]]


def test_a_large_group_s_arrivals_are_sampled_half_a_second_apart_and_name_its_last_rank() -> None:
    """Past ``ARRIVALS_SAMPLED_FROM`` members, the arrivals at the newest seq runs completed are
    counted alone, where its first arrival came ``ARRIVALS_SPREAD_S`` after the last counted
    one's; read every round, most rounds count nothing. Rank 7 always arrives 0.3 s late."""
    from hangwatch.diagnosis.state.base import ARRIVALS_SAMPLED_FROM, ARRIVALS_SPREAD_S

    world, per_round, rounds = ARRIVALS_SAMPLED_FROM + 8, 4, 12
    job = SimJob(world, registered=T0)
    template = dataclasses.replace(call(0, 1), call_id=0, seq=0, enter_time=0.0, exit_time=None)

    def at(rank: int, i: int) -> float:  # the i-th call's enter: 0.1 s apart
        return T0 + 2 + 0.1 * i + (0.3 if rank == 7 else 0.0)

    for rank in range(world):
        job.apply(call(rank, 1, call_id=1, enter_time=at(rank, 0), exit_time=at(rank, 0) + 0.01), T0 + 1)
    sampled: dict[int, tuple[int, float, float]] = {}
    for k in range(rounds):
        lo = 1 + k * per_round  # calls lo .. lo + per_round - 1, at seqs one above
        for rank in range(world):
            enters = [at(rank, i) for i in range(lo, lo + per_round)]
            job.apply(r.CallRun(rank, template, lo + 1, lo + 1, 0, enters, [e + 0.01 for e in enters]), T0 + 50)
        for last, lag, seq, first in job.job.arrivals.get("0", ()):
            sampled[seq] = (last, round(lag, 6), first)
    firsts = sorted(first for _, _, first in sampled.values())
    assert {(last, lag) for last, lag, _ in sampled.values()} == {(7, 0.3)}
    assert all(b - a >= ARRIVALS_SPREAD_S for a, b in itertools.pairwise(firsts)), firsts
    # 4.4 s of calls: one sample every half second at least once the first is counted
    assert len(sampled) >= (0.1 * per_round * rounds - 0.4) / (ARRIVALS_SPREAD_S + 0.1 * per_round), sampled


def test_runs_are_let_go_once_every_member_passed_them() -> None:
    """Memory: the runs a job state holds stay near the members' slack, not the job's length."""
    p = _steady(world=3, n=3000, batch=100)
    job = SimJob(3, registered=T0)
    readers = [(_ring(p, rank)[0], RingEncoder()) for rank in range(3)]
    reading = [RingReader(ring.fd) for ring, _ in readers]
    now = T0 + 1
    for _ in range(40):
        now += 0.05
        for rank, (_, encoder) in enumerate(readers):
            batch = reading[rank].poll(200)
            job.deliver(rank, encoder.decode(batch, rank, budget.call_bytes), now, sent_time=now)
    held = sum(len(run.enters) for runs in job.job.passed.get("0", {}).values() for run in runs)
    assert job.job.runs_taken > 60
    assert held <= 3 * 2 * 100, held  # two batches' worth per rank, not 3,000 calls each
    assert len(job.job.arrivals["0"]) == 32  # arrivals counted from runs, as from slots


def test_arrivals_from_runs_name_the_same_last_rank_as_slots() -> None:
    p = _steady(world=4, n=600, batch=50)
    outcomes = []
    for runs in (False, True):
        job = SimJob(4, registered=T0)
        readers = []
        for rank in range(4):
            ring, _ = _ring(p, rank)
            readers.append((ring, RingReader(ring.fd), RingEncoder()))
        now = T0 + 1
        for _ in range(20):
            now += 0.05
            for rank, (_, reader, encoder) in enumerate(readers):
                job.deliver(rank, encoder.decode(reader.poll(100), rank, budget.call_bytes, runs=runs), now,
                            sent_time=now)  # fmt: skip
        outcomes.append([(last, round(lag, 6), seq) for last, lag, seq, _ in job.job.arrivals["0"]])
    assert outcomes[1] == outcomes[0]
    assert {last for last, _, _ in outcomes[1]} == {3}  # the ring builder makes rank 3 the latest


def test_arrivals_read_every_tick_are_the_same_from_runs_as_from_slots() -> None:
    """The seqs runs complete are counted when ``arrivals`` is read (the straggler detector, once
    a tick), not as each slowest rank's run comes: a reader every third round of batches sees
    what it sees where every call makes a slot, counted as each completes. Ranks read 10 to 40
    calls a round: the slowest one's runs through the seqs counted are a few rounds old."""
    p = _steady(world=4, n=600, batch=50)
    seen: list[list[list[tuple[int, float, int]]]] = []
    for runs in (False, True):
        job = SimJob(4, registered=T0)
        readers = [(RingReader(ring.fd), RingEncoder()) for ring in (_ring(p, rank)[0] for rank in range(4))]
        reads: list[list[tuple[int, float, int]]] = []
        now = T0 + 1
        for round_ in range(30):
            now += 0.05
            for rank, (reader, encoder) in enumerate(readers):
                job.deliver(rank, encoder.decode(reader.poll(10 * (rank + 1)), rank, budget.call_bytes, runs=runs),
                            now, sent_time=now)  # fmt: skip
            if round_ % 3 != 2:
                continue
            reads.append(sorted((last, round(lag, 6), seq) for last, lag, seq, _ in job.job.arrivals.get("0", ())))
        seen.append(reads)
        if runs:
            assert job.job.runs_taken > 20
    assert seen[1] == seen[0]
    assert len(seen[1][-1]) == 32 and {last for last, _, _ in seen[1][-1]} == {3}


def test_runs_stay_within_a_ranks_memory_budget() -> None:
    job = SimJob(2, registered=T0)
    job.job.ledger.budget = budget.Budget(rank=200_000, job=1 << 40, total=1 << 40)
    p = _steady(world=2, n=3000, batch=500)
    rings = [_ring(p, rank)[0] for rank in range(2)]
    readers = [(RingReader(ring.fd), RingEncoder()) for ring in rings]
    now = T0 + 1
    for _ in range(8):
        now += 0.05
        for rank, (reader, encoder) in enumerate(readers):
            job.deliver(rank, encoder.decode(reader.poll(1000), rank, budget.call_bytes), now, sent_time=now)
    assert job.job.runs_taken > 0 and job.job.ledger.trimmed > 0  # runs taken, and the budget reached
    for st_ in job.states.values():
        assert st_.held + st_.calls <= 200_000


def test_a_healthy_uneven_all_to_all_every_rank_returned_from_raises_nothing() -> None:
    """The look-alike of a mismatch every rank returned from (such a slot is now kept until the
    engine's next tick, to be told): an ``all_to_all_single`` whose split sizes differ from rank to
    rank, as they do in a mixture-of-experts layer, and agree pairwise. Its slot's calls differ,
    so it is kept for the tick; the tick finds nothing, and then it goes."""
    from tests.diagnosis.rules._calls import UNEVEN, a2a_single

    job = SimJob(3, registered=T0)
    for seq in (1, 2, 3):
        for rank, c in a2a_single(UNEVEN).items():
            job.apply(dataclasses.replace(c, call_id=seq * 10 + rank, seq=seq, enter_time=T0 + seq,
                                          exit_time=T0 + seq + 0.1), T0 + seq)  # fmt: skip
    assert {1, 2, 3} <= set(job.job.slots["0"])  # kept for the tick: their calls differ
    assert all(slot.pinned for slot in job.job.slots["0"].values())
    assert job.tick(T0 + 4) == []
    job.beat(T0 + 5)
    assert job.tick(T0 + 30) == []
    assert not any(slot.pinned for slot in job.job.slots["0"].values())


def test_a_healthy_mixture_of_experts_layer_in_cycles_raises_nothing() -> None:
    """The look-alike of a mismatch inside cycles: a mixture-of-experts layer's loop, an uneven
    ``all_to_all_single`` (split sizes differ from rank to rank, agreeing pairwise) then an
    ``all_reduce``, over and over, sent as cycles. The ranks' cycles differ at every
    all_to_all seq, so those are made slots for the detectors; they find nothing."""
    from tests.diagnosis.rules._calls import UNEVEN, a2a_single

    job = SimJob(3, registered=T0)
    a2a = a2a_single(UNEVEN)
    n = 40
    for rank in range(3):
        meta = (r.TensorMeta((4,), "float32"),)
        reduce = dataclasses.replace(
            a2a[rank], op="all_reduce", inputs=meta, outputs=meta, extra={}, reduce_op="sum", call_site=SITE_B
        )
        for seq, tpl in ((1, a2a[rank]), (2, reduce)):  # each signature's first call, alone
            job.apply(dataclasses.replace(tpl, call_id=seq, seq=seq, enter_time=T0 + seq,
                                          exit_time=T0 + seq + 0.01), T0 + seq)  # fmt: skip
        enters = [T0 + 3 + i * 0.01 for i in range(n)]
        run = r.CallRun(rank, a2a[rank], 3, 3, 0, enters, [e + 0.005 for e in enters], cycle=(reduce,))
        job.apply(run, T0 + 4)
    assert job.job.cycle_calls == 3 * n
    made = set(job.job.slots.get("0", {}))
    assert {s for s in range(3, 3 + n, 2)} <= made, sorted(made)  # every all_to_all seq, for the detectors
    assert not {s for s in range(4, 3 + n, 2)} & made  # the all_reduces agree: left in the runs
    assert job.tick(T0 + 5) == []
    job.beat(T0 + 6)
    assert job.tick(T0 + 30) == []


def test_a_budget_note_reaches_status_with_the_rank_and_goes_when_its_batches_stop_saying_it() -> None:
    from hangwatch.diagnosis import views

    job = SimJob(2, registered=T0)
    note = "records shipped every 0.8 s, not every 0.2 s: shipping took 3.1% of a core (kept under 2%)"
    job.deliver(1, [], T0 + 1, sent_time=T0 + 1, budget_note=note)
    assert views.rank_json(job.states[1], T0 + 1, 5.0)["budget"] == note
    assert views.rank_json(job.states[0], T0 + 1, 5.0)["budget"] is None
    job.deliver(1, [], T0 + 2, sent_time=T0 + 2)
    assert views.rank_json(job.states[1], T0 + 2, 5.0)["budget"] is None


def _phase(
    job: SimJob, rank: int, first_id: int, t: float, shapes: list[tuple[int, ...]], runs: bool, now: float
) -> None:
    """``rank``'s calls at seqs 1.. of ``shapes``, as an agent sends them: the first alone (a new
    signature), then runs of the alike, but the 2nd and 5th alone (a read's edge)."""

    def template(shape: tuple[int, ...]) -> r.CallRecord:
        meta = (r.TensorMeta(shape, "float32"),)
        return dataclasses.replace(call(rank, 0, call_id=0, inputs=meta, outputs=meta), exit_time=None, enter_time=0.0)

    calls = [
        dataclasses.replace(template(shape), call_id=first_id + i, seq=i + 1, enter_time=t + i * 0.01,
                            exit_time=t + i * 0.01 + 0.001)
        for i, shape in enumerate(shapes)
    ]  # fmt: skip
    events: list[r.RankEvent] = []
    i = 0
    while i < len(calls):
        j = i + 1
        while runs and i not in (0, 1, 4) and j < len(calls) and j not in (1, 4) and shapes[j] == shapes[i]:
            j += 1
        if j - i == 1:
            events.append(calls[i])
        else:
            part = calls[i:j]
            enters, exits = [c.enter_time for c in part], [c.exit_time or 0.0 for c in part]
            events.append(r.CallRun(rank, template(shapes[i]), part[0].call_id, part[0].seq, 0, enters, exits))
        i = j
    for event in events:
        job.apply(event, now)


@pytest.mark.parametrize("runs", [True, False], ids=["runs", "calls"])
@pytest.mark.parametrize("bad", [False, True], ids=["healthy", "mismatch"])
def test_a_process_group_made_anew_is_a_numbering_of_its_own(runs: bool, bad: bool) -> None:
    """Two ranks call 20 all_reduces of [4], destroy their process group, make it anew (its seqs
    start from 1 again) and call 12 of [8]. In every order the two ranks' batches may come in
    (each rank's own in order: first loop, destroy and init, second loop), with a tick after
    each, a healthy job raises nothing: before, the runs kept from the first loop met the second
    loop's calls at the same seqs, a false shape mismatch ([8] against [4]) in every order with
    runs. With rank 1's 4th call of the second loop of another shape, that mismatch is told, on
    rank 1 at seq 4, in every order."""
    first, anew = (r.GroupInfo(name="0", ranks=(0, 1), backend="gloo", index=i) for i in (0, 1))
    told = set()
    for order in sorted(set(itertools.permutations([0, 0, 0, 1, 1, 1]))):
        job = SimJob(2, registered=T0)
        done = {0: 0, 1: 0}
        now = T0 + 1.0
        for rank in order:
            now += 0.3
            stage = done[rank]
            done[rank] += 1
            if stage == 0:
                job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, first, T0), now)
                _phase(job, rank, 1, T0 + 1, [(4,)] * 20, runs, now)
            elif stage == 1:  # (the hook numbers each group it learns: the new one is the 2nd)
                job.apply(r.GroupEvent(rank, r.GroupEventKind.DESTROYED, first, T0 + 2), now)
                job.apply(r.RankEnd(rank, r.EndKind.DESTROYED, T0 + 2), now)
                job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, anew, T0 + 2.1), now)
            else:
                shapes = [(8,)] * 12
                if bad and rank == 1:
                    shapes[3] = (9,)
                _phase(job, rank, 100, T0 + 3, shapes, runs, now)
            job.tick(now + 0.1)
        job.tick(now + 30)
        incidents = [(str(i.kind), tuple(i.culprit_ranks), i.seq) for i in job.tick_engine.incidents.values()]
        told.add(tuple(incidents))
    assert told == ({(("shape_mismatch", (1,), 4),)} if bad else {()}), told


def test_calls_that_share_a_seq_or_come_late_from_flight_recorder_start_no_numbering() -> None:
    """The look-alikes of a group made anew: two Python calls of one seq (collectives coalesced
    into one), a record made from a Flight Recorder entry below the last Python call's seq, the
    group told again (a link made anew, an agent taking the ring over: the same creation
    index). None starts a numbering (which would set the other ranks' runs aside): nothing is
    raised on the healthy calls, and a mismatch after them is told on its rank."""
    job = SimJob(2, registered=T0)
    now = T0 + 1.0
    group = r.GroupInfo("0", (0, 1), "gloo", 0)
    for rank in (0, 1):
        job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, group, T0), now)
        _phase(job, rank, 1, T0 + 1, [(4,)] * 20, True, now)
    t = T0 + 2
    for rank in (0, 1):
        job.apply(call(rank, 21, call_id=30, enter_time=t, exit_time=t + 0.001), now)
        job.apply(call(rank, 21, call_id=31, enter_time=t + 0.01, exit_time=t + 0.011), now)  # coalesced
        job.apply(call(rank, 5, call_id=2**62 + 5, enter_time=T0 + 1.04, exit_time=T0 + 1.05,
                       source="flight_recorder"), now)  # fmt: skip
        job.apply(call(rank, 22, call_id=32, enter_time=t + 0.02, exit_time=t + 0.021), now)
    job.tick(now + 1)
    assert job.job.numbering == {} and job.job.passed["0"]
    assert job.tick_engine.incidents == {}
    # the group told again (a link made anew tells the rank's groups again), the seqs rising on:
    # no numbering either, and a mismatch after it is told
    job.apply(r.GroupEvent(0, r.GroupEventKind.CREATED, group, t), now)
    for rank in (0, 1):
        mine = call(rank, 23, call_id=33, enter_time=t + 0.03, exit_time=t + 0.031)
        if rank:
            mine.inputs = mine.outputs = (r.TensorMeta((5,), "float32"),)
        job.apply(mine, now + 1)
        job.job.ranks[rank].flight_to = t + 1  # a Flight Recorder read past the mismatch: traces whole
    job.tick(now + 2)
    assert job.job.numbering == {}
    assert [(str(i.kind), i.culprit_ranks) for i in job.tick_engine.incidents.values()] == [("shape_mismatch", [1])]


def test_a_late_batch_of_the_numbering_before_prunes_nothing_of_the_new_one() -> None:
    """What a real job did (``tests/e2e/test_runs.py``'s loop, its all_reduce mismatch making gloo
    abort rank 0): rank 1's whole story came first, its first loop of 400 calls, the group made
    anew, 100 calls, then its call 101 of [9] that raised; rank 0's came after, its first loop
    too. Rank 0's calls at seqs 300-400 of the numbering before pruned the new one's slots as
    left 256 seqs behind, rank 1's call 101 with them: rank 0's death was told, not the
    mismatch that caused it (1 run in 5)."""
    first, anew = (r.GroupInfo(name="0", ranks=(0, 1), backend="gloo", index=i) for i in (0, 1))
    job = SimJob(2, registered=T0)
    now = T0 + 1.0
    meta = (r.TensorMeta((8,), "float32"),)
    for rank in (1, 0):
        job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, first, T0), now)
        _phase(job, rank, 1, T0 + 1, [(4,)] * 400, True, now)
        job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, anew, T0 + 6), now)
        _phase(job, rank, 401, T0 + 7, [(8,)] * 100, True, now)
        last = call(
            rank, 101, call_id=501, enter_time=T0 + 9, inputs=(r.TensorMeta((9,), "float32"),) if rank else meta
        )
        job.apply(last, now)
        if rank:
            job.apply(r.CallExit(rank, 501, T0 + 9.1, error="Connection reset by peer"), now)
        job.tick(now + 0.1)
    job.tick(now + 1)
    told = [(str(i.kind), tuple(i.culprit_ranks), i.seq) for i in job.tick_engine.incidents.values()]
    assert told == [("shape_mismatch", (1,), 101)], told


@pytest.mark.parametrize("bad", [False, True], ids=["healthy", "mismatch"])
def test_a_group_made_anew_twice_with_a_rank_silent_in_between_is_told_right(bad: bool) -> None:
    """Made anew twice: in between, rank 0 makes 3 calls and rank 1 none (it failed before its
    first, and the job went on to make the group again). Both then make 12 calls; with rank 1's
    6th of another shape, that mismatch is told, and only it (a numbering inferred from seqs
    left rank 1 a making behind for good: no incident at all)."""
    job = SimJob(2, registered=T0)
    now = T0 + 1.0
    makings = [r.GroupInfo(name="0", ranks=(0, 1), backend="gloo", index=i) for i in range(3)]
    for rank in (0, 1):
        job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, makings[0], T0), now)
        _phase(job, rank, 1, T0 + 1, [(4,)] * 20, True, now)
    for rank in (0, 1):
        job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, makings[1], T0 + 2), now)
    _phase(job, 0, 50, T0 + 2.5, [(6,)] * 3, True, now)
    job.tick(now)
    for rank in (0, 1):
        job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, makings[2], T0 + 3), now + 1)
        shapes = [(8,)] * 12
        if bad and rank == 1:
            shapes[5] = (9,)
        _phase(job, rank, 100, T0 + 4, shapes, True, now + 1)
    for k in range(2, 30):
        job.beat(now + k)
        job.tick(now + k)
    told = [(str(i.kind), tuple(i.culprit_ranks), i.seq) for i in job.tick_engine.incidents.values()]
    assert job.job.numbering == {"0": {0: 2, 1: 2}}
    assert told == ([("shape_mismatch", (1,), 6)] if bad else []), told


def test_a_rank_seen_only_through_flight_recorder_makes_its_group_anew_too() -> None:
    """Rank 2's collectives are all C++'s (DDP), read from Flight Recorder, in both makings: its
    records of the new one number from 1 again, below seqs already taken from its entries. The
    first of them starts its numbering (it was dropped as a record made again from the same
    entry, leaving rank 2 behind for good); a mismatch on it after is told on it."""
    job = SimJob(3, registered=T0)
    now = T0 + 1.0
    makings = [r.GroupInfo(name="0", ranks=(0, 1, 2), backend="nccl", index=i) for i in range(2)]

    def one(rank: int, seq: int, call_id: int, t: float, shape: tuple[int, ...] = (8,), done: bool = True) -> None:
        meta = (r.TensorMeta(shape, "float32"),)
        fr = rank == 2
        record = call(rank, seq, call_id=2**62 + call_id if fr else call_id, inputs=meta, outputs=meta,
                      source="flight_recorder" if fr else "python", enter_time=t,
                      exit_time=t + 0.001 if done else None)  # fmt: skip
        job.apply(record, now)

    for making, (shape, first_id) in enumerate((((4,), 0), ((8,), 100))):
        for rank in range(3):
            job.apply(r.GroupEvent(rank, r.GroupEventKind.CREATED, makings[making], T0 + making), now)
        for seq in range(1, 31):
            for rank in range(3):
                one(rank, seq, first_id + seq, T0 + 1 + making + seq * 0.01, shape)
        job.tick(now)
        now += 0.5
    for rank in range(3):
        one(rank, 31, 131, T0 + 3, (9,) if rank == 2 else (8,), done=False)
    for k in range(1, 20):
        job.beat(now + k)
        job.tick(now + k)
    told = [(str(i.kind), tuple(i.culprit_ranks), i.seq) for i in job.tick_engine.incidents.values()]
    assert job.job.numbering == {"0": {0: 1, 1: 1, 2: 1}}
    assert told == [("shape_mismatch", (2,), 31)], told


def test_a_ranks_first_calls_on_a_group_in_one_run_go_alone_only_for_the_first() -> None:
    """A rank's first batch folded whole by the coordinator (``hangwatch.folds``) is its first
    call on the group: that call goes alone, as it would have come, and the rest as the run;
    every call is in the history, and only the first seq has a slot."""
    job = SimJob(2, registered=T0)
    for rank in (0, 1):
        template = dataclasses.replace(call(rank, 0, call_id=0), exit_time=None)
        times = [T0 + 0.01 * i for i in range(40)]
        job.apply(r.CallRun(rank, template, 1, 1, 0, times, [t + 0.001 for t in times]), T0 + 1)
    assert job.job.runs_taken == 2
    assert [c.seq for c in job.states[1].history["0"]] == list(range(1, 41))
    assert set(job.job.slots.get("0", {})) <= {1}
    assert job.tick(T0 + 2) == []
