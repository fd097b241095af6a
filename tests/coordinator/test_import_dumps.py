"""``ImportDumps``: Flight Recorder dumps joined to a followed job's history, on a real coordinator
(gRPC on port 0) fed by real transports. The dumps here are built from entries in torch's format
(the dumps themselves are tested real in ``tests/e2e/test_postmortem.py``); what is tested is what
the coordinator does with them and what it refuses."""

from __future__ import annotations

import json
import time
import tracemalloc
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from hangwatch import records as r
from hangwatch.cli.client import CoordinatorUnreachable, import_dumps
from hangwatch.client.transport import Transport
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.diagnosis.incidents import incarnation_of
from hangwatch.postmortem import dumps, packed
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from tests import factories
from tests.conftest import wait_for
from tests.postmortem.factories import fr_entry

T = 1_795_000_000.0


def _entry(seq: int, retired: bool = True, t: float = T) -> dict[str, Any]:
    return fr_entry(seq, int((t + seq) * 1e9), retired=retired, state="scheduled", line=40 + seq)


def _skipped(t: float = T) -> dumps.Folder:
    """Ranks 0 and 2 in seq 4 for 30 s; rank 1 stopped after seq 3."""
    folder = dumps.Folder()
    for rank in range(3):
        entries = [_entry(s, t=t) for s in (1, 2, 3)] + ([] if rank == 1 else [_entry(4, retired=False, t=t)])
        folder.dumps[rank] = dumps.RankDump(
            rank, f"/tmp/nccl_trace_rank_{rank}", "pickle", "2.10", entries, {}, {}, t + 34, True, "cpu"
        )
    return folder


def _ident(rank: int) -> r.RankIdentity:
    return r.RankIdentity("job", rank, 3, "host-a", 20_000 + rank, session=uuid.uuid4().hex)


def _import(c: Coordinator, folder: dumps.Folder, job: str = "") -> Any:
    return import_dumps(f"127.0.0.1:{c.port}", packed.pack(folder)[0], job=job)


def test_a_hang_the_dumps_show_and_the_job_did_not_is_added_found_post_mortem(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    c = coordinator_factory(embedded_agent=False)
    t = Transport(f"127.0.0.1:{c.port}", None)
    for rank in range(3):
        t.register(_ident(rank))
    result = _import(c, _skipped())
    assert result["attached"] == [] and len(result["added"]) == 1 and result["ranks"] == "0-2"
    (inc,) = c.incidents_json()
    assert inc["id"] == result["added"][0] and inc["run"] == c.job.incarnation and inc["job"] == "job"
    assert (inc["kind"], inc["culprit_ranks"], inc["waiting_ranks"]) == ("stuck_collective", [1], [0, 2])
    assert inc["status"] == "resolved" and "post-mortem" in inc["resolution"]  # history: no alert, no abort
    assert incarnation_of(c.engine.incidents[inc["id"]].key) == c.job.incarnation
    assert inc["details"]["postmortem"]["dumps"]["1"] == "/tmp/nccl_trace_rank_1"
    c.engine.tick(time.time())  # the detectors run on: the imported incident stays as it was
    assert [i["status"] for i in c.incidents_json()] == ["resolved"]


def test_dumps_of_a_hang_the_job_diagnosed_are_attached_to_its_incident(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    c = coordinator_factory(embedded_agent=False, stuck_after=1.0)
    t = Transport(f"127.0.0.1:{c.port}", None)
    ids = [_ident(rank) for rank in range(3)]
    for ident in ids:
        t.register(ident)
    now = time.time()
    for rank, ident in enumerate(ids):
        calls: list[r.RankEvent] = [_live(rank, s, now - 5 + s, done=True) for s in (1, 2, 3)]
        if rank != 1:
            calls.append(_live(rank, 4, now - 1.5, done=False))
        t.report(ident, 1, calls, 0, 0)

    def live() -> list[dict[str, Any]] | None:
        for ident in ids:
            t.report(ident, 2, [], 0, 0)  # heartbeats: every rank alive
        return [i for i in c.incidents_json() if i["kind"] == "stuck_collective"] or None

    (inc,) = wait_for(live, 10, 0.2, "the live stuck incident")
    assert inc["culprit_ranks"] == [1] and inc["seq"] == 4
    result = _import(c, _skipped(now - 5))
    assert result["attached"] == [inc["id"]] and result["added"] == []  # one root cause, one incident
    fr = c.incident_json(inc["id"])["details"]["flight_recorder"]  # type: ignore[index]
    assert fr["agrees"] is True and "rank 1" in fr["diagnosis"]
    assert {rk: e["reached"] for rk, e in fr["ranks"].items()} == {"0": True, "1": False, "2": True}
    assert fr["ranks"]["1"]["seq"] == 3 and fr["ranks"]["0"]["call_site"] == "train.py:44 in step"
    assert len(c.incidents_json()) == 1


def _live(rank: int, seq: int, at: float, done: bool) -> r.CallRecord:
    site = f"train.py:{40 + seq} in step"
    return factories.call(rank, seq, "all_reduce", call_id=seq, shape=(4,), reduce_op="sum", call_site=site,
                          enter_time=at, exit_time=at + 0.01 if done else None)  # fmt: skip


def _raw(c: Coordinator, payload: bytes, token: str = "") -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{c.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as err:
            stub.ImportDumps(pb.ImportRequest(token=token, dumps=payload), timeout=30)
    return err.value


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"not zlib at all", "not an import of dumps"),
        (zlib.compress(b"\0" * (300 << 20)), "bigger than 64 MiB"),  # a zip bomb: 300 MiB from 300 KiB
        (zlib.compress(b"[1, 2]"), "no ranks"),
        (zlib.compress(json.dumps({"ranks": {"x": {}}}).encode()), "rank 'x'"),
        (zlib.compress(json.dumps({"ranks": {"0": {"written": "NaN"}}}).encode()), "rank '0'"),
        (zlib.compress(json.dumps({"ranks": {"0": {"entries": [_entry(1)] * 40}}}).encode()), "more than 32 a group"),
    ],
)
def test_what_is_not_an_import_is_refused_and_changes_nothing(
    coordinator_factory: Callable[..., Coordinator], payload: bytes, why: str
) -> None:
    c = coordinator_factory(embedded_agent=False)
    Transport(f"127.0.0.1:{c.port}", None).register(_ident(0))
    err = _raw(c, payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and why in str(err.details()), err.details()
    assert c.incidents_json() == []


def test_an_import_names_a_job_the_coordinator_follows(coordinator_factory: Callable[..., Coordinator]) -> None:
    c = coordinator_factory(embedded_agent=False)
    with pytest.raises(CoordinatorUnreachable, match="no job 'nope'"):
        _import(c, _skipped(), job="nope")
    assert c.incidents_json() == []


def test_the_same_dumps_imported_twice_add_their_incident_once(coordinator_factory: Callable[..., Coordinator]) -> None:
    c = coordinator_factory(embedded_agent=False)
    Transport(f"127.0.0.1:{c.port}", None).register(_ident(0))
    first, again = _import(c, _skipped()), _import(c, _skipped())
    assert len(first["added"]) == 1 and again["added"] == [] and again["attached"] == first["added"]
    assert len(c.incidents_json()) == 1


def test_an_import_into_no_job_or_of_too_many_groups_is_refused(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    c = coordinator_factory(embedded_agent=False)
    with pytest.raises(CoordinatorUnreachable, match="no job '' to import"):
        _import(c, _skipped())  # nothing registered: no run to join
    Transport(f"127.0.0.1:{c.port}", None).register(_ident(0))
    many = {
        "ranks": {"0": {"written": T, "entries": [{**_entry(1), "process_group": [str(g), ""]} for g in range(1100)]}}
    }
    err = _raw(c, zlib.compress(json.dumps(many).encode()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than 1024 process groups" in str(err.details())
    assert c.incidents_json() == []


def test_an_import_bomb_is_refused_before_it_is_parsed(coordinator_factory: Callable[..., Coordinator]) -> None:
    """64 KiB of zlib that inflate to tens of MiB of ``{},``: parsed, it made a dict every three
    bytes and took the coordinator to 1.84 GB, never given back. It is refused on its size and
    object count before any parse, and the coordinator goes on."""
    c = coordinator_factory(embedded_agent=False)
    Transport(f"127.0.0.1:{c.port}", None).register(_ident(0))
    bomb = zlib.compress(b'{"ranks": {"0": {"entries": [' + b"{}," * (20 << 20) + b"{}]}}}", 9)
    assert len(bomb) < 128 << 10
    tracemalloc.start()
    try:
        err = _raw(c, bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "objects in" in str(err.details()), err.details()
    assert peak < 256 << 20, peak  # the inflated bytes, and no parse of them
    assert _import(c, _skipped())["added"]  # and a real import is still taken


def test_imports_are_taken_one_at_a_time_and_within_the_memory_budget(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    c = coordinator_factory(embedded_agent=False, memory_budget_mb=1)
    Transport(f"127.0.0.1:{c.port}", None).register(_ident(0))
    big = _skipped()
    for dump in big.dumps.values():  # a folder whose parse takes more than the 1 MiB budget holds
        dump.entries = [
            {**e, "process_group": (str(g), ""), "call_site": "x" * 500} for e in dump.entries for g in range(64)
        ]
    payload, size = packed.pack(big)
    assert size * packed.IMPORT_PARSE_FACTOR > 1 << 20
    err = _raw(c, payload)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory budget" in str(err.details())
    assert c.jobs.ledger.held < 1 << 20  # nothing of it stays charged
    c2 = coordinator_factory(embedded_agent=False)
    Transport(f"127.0.0.1:{c2.port}", None).register(_ident(0))
    with c2.importing:  # another import under way
        err = _raw(c2, packed.pack(_skipped())[0])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "another import" in str(err.details())
    assert _import(c2, _skipped())["added"]  # taken once that one is done
