"""A group's arrivals at the collectives its members' runs completed: who came last, and by how much."""

from __future__ import annotations

import collections
import itertools
import operator

from hangwatch import records as r
from hangwatch.diagnosis.state.base import (
    ARRIVALS_KEPT,
    ARRIVALS_SAMPLED_FROM,
    ARRIVALS_SPREAD_S,
    _Base,
    _run_at,
)
from hangwatch.diagnosis.state.ranks import Slot


class Arrivals(_Base):
    """A group's arrivals at the collectives its members' runs completed (``Runs._advance`` says
    which), counted when the straggler detector reads them."""

    @property
    def arrivals(self) -> dict[str, collections.deque[tuple[int, float, int, float]]]:
        """Per group, the last rank to arrive at each of its latest complete collectives (at most
        ``ARRIVALS_KEPT``, in seq order of those that runs completed): (rank, its lag behind the
        median arrival, seq, first arrival). The seqs runs completed are counted here, when
        read (the straggler detector, once a tick), not each time the slowest rank's run comes:
        at 1,024 ranks that was half the job state's work (``bench/ingest.py``)."""
        while self._arrivals_due:
            group, (low, new_low, members) = self._arrivals_due.popitem()
            self._runs_complete(group, low, new_low, members)
        return self._arrivals

    def _runs_complete(self, group: str, low: int, new_low: int, members: tuple[int, ...]) -> None:
        """Every member passed the seqs above ``low`` up to ``new_low``: the arrivals of those
        the runs hold (their newest ``ARRIVALS_KEPT``: the detectors read no more) are counted
        as a complete slot's are, and the newest ``ARRIVALS_KEPT`` by seq kept."""
        if len(members) < 2:
            return
        byrank = self.passed.get(group, {})
        slots: dict[int, Slot] = self.slots.get(group) or {}
        lasts = self._arrivals.get(group)
        counted = {seq for _, _, seq, _ in lasts} if lasts else set()
        want = [
            seq
            for seq in range(max(low + 1, new_low - ARRIVALS_KEPT + 1), new_low + 1)
            if seq not in slots and seq not in counted  # counted where its slot completed (it may be pruned since)
        ]
        if not want:
            return
        n = len(members)
        if n > ARRIVALS_SAMPLED_FROM:  # a sample: the newest seq, half a second after the last counted
            self._newest_complete(group, want[-1], members, byrank, lasts)
            return
        lo = want[0]
        # a row per member of its arrival times at lo..new_low (None where no run of its holds
        # the seq), made of its runs' slices, then read a column per seq: the work per call is
        # in C but for adding the rank's clock offset (1,024 ranks: every call is counted here)
        rows: list[list[float | None]] = []
        for m in members:
            runs = byrank.get(m)
            if not runs:
                return  # no seq is complete in runs alone
            pieces: list[list[float | None]] = []
            top = new_low  # each seq is taken from the newest run that holds it
            for run in reversed(runs):
                first = run.first_seq
                if first > top:
                    continue
                hi = min(top, first + len(run.enters) - 1)
                if hi < lo:
                    break
                start = max(lo, first)
                if hi < top:
                    pieces.append([None] * (top - hi))
                pieces.append(list(map(run.offset.__add__, run.enters[start - first : hi - first + 1])))
                top = start - 1
                if top < lo:
                    break
            if top >= lo:
                pieces.append([None] * (top - lo + 1))
            row = pieces[-1] if len(pieces) == 1 else list(itertools.chain.from_iterable(reversed(pieces)))
            rows.append(row)
        columns = list(zip(*rows, strict=True))  # every row spans lo..new_low
        counts: list[tuple[int, float, int, float]] = []
        for seq in want:
            arrived = columns[seq - lo]
            if None in arrived:
                continue
            ordered = sorted(arrived)  # no None left
            last, rank = max(zip(arrived, members, strict=True))  # of a tie, the highest rank (as a slot's sort)
            counts.append((rank, last - ordered[(n - 1) // 2], seq, ordered[0]))
        if counts:
            kept = sorted([*(lasts or ()), *counts], key=operator.itemgetter(2))[-ARRIVALS_KEPT:]
            self._arrivals[group] = collections.deque(kept, maxlen=ARRIVALS_KEPT)

    def _newest_complete(
        self,
        group: str,
        seq: int,
        members: tuple[int, ...],
        byrank: dict[int, collections.deque[r.CallRun]],
        lasts: collections.deque[tuple[int, float, int, float]] | None,
    ) -> None:
        """In a large group, the arrivals at ``seq`` alone, each member's from its run that holds
        it, counted where it came half a second after the last counted (``ARRIVALS_SPREAD_S``)."""
        if lasts:  # the first arrival is at most the first member's: too soon by it, too soon by all
            run = _run_at(byrank.get(members[0]) or (), seq)
            if run is None or run.offset + run.enters[seq - run.first_seq] - lasts[-1][3] < ARRIVALS_SPREAD_S:
                return  # (each tick, where runs completed a seq: 16,384 members looked up for nothing)
        arrived: list[float] = []
        for m in members:
            run = _run_at(byrank.get(m) or (), seq)
            if run is None:
                return
            arrived.append(run.offset + run.enters[seq - run.first_seq])
        ordered = sorted(arrived)
        if lasts and ordered[0] - lasts[-1][3] < ARRIVALS_SPREAD_S:
            return
        last, rank = max(zip(arrived, members, strict=True))  # of a tie, the highest rank (as a slot's sort)
        if lasts is None:
            lasts = self._arrivals[group] = collections.deque(maxlen=ARRIVALS_KEPT)
        lasts.append((rank, last - ordered[(len(ordered) - 1) // 2], seq, ordered[0]))
