"""A rank batch's header as the node agent sends it: who and when, the records lost, where the
rank's main thread is, and how far its Flight Recorder reads have shown what C++ issued."""

from __future__ import annotations

from hangwatch.agent.flightrecorder import RingFetcher
from hangwatch.agent.shipped import STACK_KEPT, ShippedRank
from hangwatch.protos import hangwatch_pb2 as pb


def header(state: ShippedRank, now: float, mono: float, fetcher: RingFetcher) -> pb.ReportBatch:
    """A batch's header: who, when, how many records lost, where the rank's main thread is."""
    batch = _who(state, now, mono)
    if state.flight is not None:
        note = fetcher.note(id(state.link))
        if state.flight.lost:  # a ring that turns over between reads: a larger one would not
            lost = (
                f"{state.flight.lost} CPU Flight Recorder entries overwritten before a read (a larger "
                "TORCH_FR_BUFFER_SIZE turns over less often)"
            )
            note = f"{note}; {lost}" if note else lost
        batch.budget_note = note
        batch.flight_read_time = flight_read_time(state, fetcher)
        state.flight_said = max(state.flight_said, batch.flight_read_time)
        if state.flight.unseen:
            batch.flight_unseen.extend(sorted(state.flight.unseen))
    _status(state, batch)
    return batch


def unread_header(state: ShippedRank, now: float, mono: float) -> pb.ReportBatch:
    """A batch sent without reading the rank's ring (``ReportBatch.unread``): who, when, where
    its main thread is; nothing of its calls or its Flight Recorder."""
    batch = _who(state, now, mono)
    batch.unread = True
    _status(state, batch)
    return batch


def _who(state: ShippedRank, now: float, mono: float) -> pb.ReportBatch:
    """Who sends, when, and the records its ring lost: the next of the rank's batches."""
    ident = state.identity
    state.batch_seq += 1
    return pb.ReportBatch(
        job_id=ident.job_id,
        rank=ident.rank,
        session=ident.session,
        batch_seq=state.batch_seq,
        sent_time=now,  # read now, on the coordinator's clock's host: no transit to net out
        mono_time=mono,  # a step of this host's wall clock shows in sent_time - mono_time
        dropped=state.link.reader.lost,
    )


def _status(state: ShippedRank, batch: pb.ReportBatch) -> None:
    """Where the rank's main thread is, as its sender thread last wrote it."""
    status = state.link.reader.status()
    if status is not None:
        state.status_time = batch.alive_time = status[0]
        where, where_user, *stack = (*status[1].split("\n"), "")[: 2 + STACK_KEPT]
        batch.where, batch.where_user = where, where_user
        batch.where_stack.extend(s for s in stack if s)


def flight_read_time(state: ShippedRank, fetcher: RingFetcher) -> float:
    """What the header says of the rank's Flight Recorder: when its latest read whose
    records have all gone was asked, or, later, the latest poll its Python calls accounted
    for, where the ring has been read past it (those calls have gone) and nothing waits."""
    told = state.flight_told
    vouched = fetcher.vouched(id(state.link))
    if vouched > told and state.flight_floor <= vouched <= state.read_to and not state.unsent and state.fetched is None:
        told = vouched
    return told
