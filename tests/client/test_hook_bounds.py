"""What the hook holds stays bounded whatever the program does (issue 36): async works when the
sender thread that polls them is gone, signatures when a call site's split sizes change at every
call, and room in the blob area for error texts and the rank's end once signatures filled it.

Seams faked as in ``test_recorder`` (torch's c10d, its tensors and works); the real recorder and
its ring, read back through ``recorded``. No torch.
"""

from __future__ import annotations

import random
from typing import Any

from hangwatch import records as r
from hangwatch import wire
from hangwatch.catalogue import INPUT_SPLITS, OUTPUT_SPLITS, SPLITS_VARY
from hangwatch.client.ops import OPS_BY_NAME
from hangwatch.client.recorder import MAX_PENDING, Recorder
from hangwatch.client.ringsink import RingSink
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Kind, RingReader
from hangwatch.ringwire import TAG_EVENT, TAG_TEXT
from tests.client.fakes import FakeC10d, FakeWork, ones, recorded


def _recorder(capacity: int = 1 << 15, blob_bytes: int = 4 << 20, world_size: int = 4) -> Recorder:
    c10d = FakeC10d(0, world_size=world_size)
    rec = Recorder(0, RingSink(capacity, blob_bytes=blob_bytes), c10d)
    rec.default_pg = c10d.default
    rec.group_info(c10d.default)
    recorded(rec)
    return rec


def _async_call(rec: Recorder, work: Any) -> int:
    raw, group, before = rec.enter(OPS_BY_NAME["all_reduce"], {"tensor": ones(4), "async_op": True})
    rec.default_pg.seq += 1
    rec.exit(raw, group, before, None, work)
    return int(raw[0])


def test_async_works_stay_bounded_when_no_sender_thread_polls_them() -> None:
    """Nobody polls (the sender thread died): the calling thread polls once too many wait, and
    every completed work's exit is written."""
    rec = _recorder()
    ids = []
    for _ in range(10_000):
        ids.append(_async_call(rec, FakeWork(done=True)))
        assert len(rec.pending) <= MAX_PENDING
    rec.poll_pending()
    exits = {e.call_id for e in recorded(rec) if isinstance(e, r.CallExit)}
    assert exits == set(ids) and not rec.pending and rec.pending_dropped == 0


def test_works_that_never_complete_are_let_go_past_the_bound_and_counted() -> None:
    rec = _recorder()
    for _ in range(10_000):
        _async_call(rec, FakeWork(done=False))
        assert len(rec.pending) <= 2 * MAX_PENDING
    assert rec.pending_dropped == 10_000 - 2 * MAX_PENDING
    assert not any(isinstance(e, r.CallExit) for e in recorded(rec))  # none said complete that was not


def _splits(rng: random.Random, total: int, n: int) -> list[int]:
    cuts = sorted(rng.randint(0, total) for _ in range(n - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def test_dynamic_split_sizes_do_not_make_every_call_a_signature() -> None:
    """An MoE layer's ``all_to_all_single``: one call site, fixed buffers, split sizes that change
    at every call. Its calls share one signature once the sizes are seen to change, which says
    they vary; every call stays named."""
    rec = _recorder(world_size=64)
    rng = random.Random(36)
    spec = OPS_BY_NAME["all_to_all_single"]
    for _ in range(5_000):
        params = {
            "output": ones(1024, 8),
            "input": ones(1024, 8),
            "output_split_sizes": _splits(rng, 1024, 64),
            "input_split_sizes": _splits(rng, 1024, 64),
        }
        raw, group, before = rec.enter(spec, params)
        rec.default_pg.seq += 1
        rec.exit(raw, group, before, None)
    calls = [e for e in recorded(rec) if isinstance(e, r.CallRecord)]
    assert len(calls) == 5_000  # every call named (a call whose signature was not stored is not)
    assert len(rec.sink.signatures) <= 2
    first, *rest = calls
    assert first.extra[INPUT_SPLITS].count(",") == 63  # the first call's sizes, as they were
    assert {(c.extra[INPUT_SPLITS], c.extra[OUTPUT_SPLITS]) for c in rest} == {(SPLITS_VARY, SPLITS_VARY)}


def test_error_texts_and_the_ranks_end_find_room_once_signatures_filled_the_blob_area() -> None:
    rec = _recorder(blob_bytes=64 << 10)
    for n in range(1, 5_000):  # a new shape at every call: a new signature each
        raw, group, before = rec.enter(OPS_BY_NAME["all_reduce"], {"tensor": ones(n)})
        rec.default_pg.seq += 1
        rec.exit(raw, group, before, None)
    assert rec.sink.writer.blobs_dropped > 0  # the signatures filled what they may
    raw, group, before = rec.enter(OPS_BY_NAME["all_reduce"], {"tensor": ones(1)})
    rec.exit(raw, group, before, RuntimeError("Connection closed by peer"))
    rec.sink.put(r.RankEnd(0, r.EndKind.EXCEPTION, 1.0, "RuntimeError: Connection closed by peer"))
    reader = RingReader(rec.sink.fd)
    batch = reader.poll()
    refs = {s.kind: s.ref for s in batch.slots[-2:]}  # the failed call's exit, then the end
    assert refs[Kind.EXIT] and refs[Kind.EVENT]  # both blobs stored: none dropped
    assert batch.blobs[refs[Kind.EXIT]] == TAG_TEXT + b"RuntimeError: Connection closed by peer"
    end = wire.event_from_pb(0, pb.Event.FromString(batch.blobs[refs[Kind.EVENT]][len(TAG_EVENT) :]))
    assert isinstance(end, r.RankEnd) and end.detail == "RuntimeError: Connection closed by peer"
    reader.close()
