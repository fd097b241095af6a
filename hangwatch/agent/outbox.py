"""A remote agent's batches of one tick, for all its ranks, in one ``ReportMany``.

The shipper queues each open, registered rank's batches here as it reads them, and sends them
together at the end of its tick: the coordinator gets one call per node per tick, not one per
rank per read. Batches leave in the order they were queued, so each rank's stay in order.

A batch the coordinator refuses (it asks the rank to register again) is undone with every later
one of its rank: the ring reads they carried go back to be encoded again after the rank
registers (``ShippedRank.resend``), before anything read after them; their Flight Recorder
events and device progress go back to wait; what the encoder held back is as it was before
the first of them. A call that fails undoes every batch in it. Nothing is lost, nothing sent
twice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hangwatch import records as r
from hangwatch.agent.shipped import ShippedRank, has_records
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Batch, RingSlot

#: Batches in one call (the coordinator takes up to ``servicer.MAX_REPORTS_PER_RELAY``).
MAX_REPORTS = 1024
#: Bytes in one call (the coordinator receives messages of up to 16 MiB).
MAX_BYTES = 8 << 20

#: Sends batches in one call; one reply per batch, in order.
Send = Callable[[list[pb.ReportBatch]], list[pb.ReportReply]]


@dataclass
class Queued:
    """One batch, and what undoes it."""

    state: ShippedRank
    batch: pb.ReportBatch
    ring: Batch | None  # the ring read it carries
    events: list[r.RankEvent]  # the Flight Recorder events it carries
    held: list[RingSlot]  # what the encoder held back before it was encoded
    told: float  # the rank's ``flight_told`` and ``flight_said`` before it
    said: float
    rode: list[r.RankEvent]  # device progress that rode with it


class Outbox:
    """Batches queued for one call; ``flush`` sends them. One thread uses it (the shipper's)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.queued: list[Queued] = []
        self._bytes = 0
        self.calls = 0  # calls made
        self.refused = 0  # batches undone because the coordinator asked their rank to register

    def add(self, item: Queued) -> None:
        """Queue ``item``; a full call goes first (an error from it is ``flush``'s)."""
        size = item.batch.ByteSize()
        if self.queued and (len(self.queued) >= MAX_REPORTS or self._bytes + size > MAX_BYTES):
            self.flush()
        self.queued.append(item)
        self._bytes += size

    def flush(self) -> None:
        """Send what is queued. A refused batch is undone with its rank's later ones; an error
        undoes them all and is raised."""
        queued, self.queued, self._bytes = self.queued, [], 0
        if not queued:
            return
        self.calls += 1
        try:
            replies = self.send([q.batch for q in queued])
        except Exception:
            _undo(queued)
            raise
        refused: set[int] = set()
        undone: list[Queued] = []
        for i, q in enumerate(queued):
            # a reply missing is a refusal, as one batch's missing reply is (``_RemoteIntake``)
            if id(q.state) in refused or i >= len(replies) or replies[i].reregister:
                refused.add(id(q.state))
                undone.append(q)
        self.refused += len(undone)
        _undo(undone)


def _undo(items: list[Queued]) -> None:
    """Put back what ``items`` carried, rank by rank, as it was before the first of them: their
    reads before anything read after them, their events before any found since."""
    ranks: dict[int, list[Queued]] = {}
    for q in items:
        ranks.setdefault(id(q.state), []).append(q)
    for mine in ranks.values():
        state, first = mine[0].state, mine[0]
        state.encoder.held_restore(first.held)
        state.flight_told, state.flight_said = first.told, first.said
        rings = [q.ring for q in mine if q.ring is not None and has_records(q.ring)]
        if has_records(state.pending):
            assert state.pending is not None
            rings.append(state.pending)
        state.resend[:0] = rings
        state.pending = None
        state.unsent[:0] = [e for q in mine for e in q.events]
        state.riding[:0] = [e for q in mine for e in q.rode]
        state.registered = False  # registered again, then the same records go again
        state.steady_period = None  # tried again on the next tick
