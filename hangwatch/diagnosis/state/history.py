"""A rank's latest calls on one group (``RankState.history``), with a run's calls kept as the run.

The history feeds the model's traces and a few detectors' look-backs, read when a finding is
being made; it is written with every batch. A run of alike calls (``records.CallRun``) is kept as
a :class:`RunSlice`: the run's last calls, the last one made whole (it is also the rank's
``last_call``, the most read). The rest are made only when something reads the history in order
(``__iter__``, indexing), once, and then replace the slice for good; ``view`` makes them for the
reader alone and leaves the slice as it is. Making every call of every run whole at each read
was most of the job state's intake of a steady rank.

Memory: the ``JobState`` charges a slice's calls one by one, each at its template's cost, so a
history costs the same whether it is read or not. A slice keeps a copy of its calls' times, not
the run's (``RunSlice.part``): a run of a million calls, once let go, leaves no more behind than
its last 64. A call that only stands in a slice has no record, so no hold; dropping it
(``drop_oldest``) hands back its bytes, and dropping a record hands back the record for the job
state to let go.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from hangwatch import records as r


class RunSlice:
    """Calls ``lo`` to the end of ``run``: the last one made whole (``last``), the rest not yet.
    ``costs``: the bytes of a call of each of the run's templates, as each would be charged whole."""

    __slots__ = ("costs", "last", "lo", "run")

    def __init__(self, run: r.CallRun, lo: int, last: r.CallRecord, costs: tuple[int, ...]) -> None:
        self.run = run
        self.lo = lo
        self.last = last
        self.costs = costs

    @classmethod
    def part(cls, run: r.CallRun, lo: int, hi: int, last: r.CallRecord, costs: tuple[int, ...]) -> RunSlice:
        """Calls ``lo`` to ``hi - 1`` of ``run``, kept apart from the run: a copy of their times
        (and the cycle turned to start at ``lo``), so that the slice holds no more than it is
        charged for once the run itself is let go (a run may stand for a million calls).
        ``last``: call ``hi - 1`` made whole."""
        if lo or hi != len(run.enters):
            p = len(costs)
            turn = lo % p
            templates = run.templates
            templates = templates[turn:] + templates[:turn]
            costs = costs[turn:] + costs[:turn]
            per = run.per_step
            kept = r.CallRun(run.rank, templates[0], run.first_call_id + lo, run.first_seq + lo, run.step_at(lo),
                             run.enters[lo:hi], run.exits[lo:hi], offset=run.offset, cycle=templates[1:],
                             per_step=per, lead=(run.lead + lo) % per if per else 0)  # fmt: skip
            run = kept
        return cls(run, 0, last, costs)

    def __len__(self) -> int:
        return len(self.run.enters) - self.lo

    def cost_of(self, i: int) -> int:
        """The bytes of the run's ``i``-th call."""
        return self.costs[i % len(self.costs)]

    def bytes(self, lo: int, hi: int) -> int:
        """The bytes of the run's calls ``lo`` to ``hi - 1``."""
        costs = self.costs
        p = len(costs)
        if p == 1:
            return costs[0] * (hi - lo)
        periods, left = divmod(hi - lo, p)
        start = lo % p
        return periods * sum(costs) + sum(costs[start : start + left]) + sum(costs[: max(0, start + left - p)])

    def calls(self) -> Iterator[r.CallRecord]:
        """Its calls, made for a reader that keeps none (the slice stays as it is)."""
        run = self.run
        for i in range(self.lo, len(run.enters) - 1):
            yield run.call(i, run.offset)
        yield self.last

    def whole(self) -> list[r.CallRecord]:
        """Its calls, as records with the run's clock offset, each held once (by the history)."""
        run = self.run
        made = []
        for i in range(self.lo, len(run.enters) - 1):
            call = run.call(i, run.offset)
            call.cost = self.cost_of(i)
            call.holds = 1
            made.append(call)
        made.append(self.last)
        return made


class History:
    """A rank's latest calls on one group, oldest first; the job state bounds it (``HISTORY_PER_GROUP``)."""

    __slots__ = ("_items", "_len", "_slices")

    def __init__(self) -> None:
        self._items: collections.deque[r.CallRecord | RunSlice] = collections.deque()
        self._len = 0
        self._slices = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[r.CallRecord]:
        if self._slices:
            self._whole()
        return iter(self._items)  # type: ignore[arg-type]  # records only once made whole

    def __getitem__(self, i: int) -> r.CallRecord:
        items = self._items
        if i == -1 and items:
            last = items[-1]
            return last.last if isinstance(last, RunSlice) else last
        if self._slices:
            self._whole()
        return items[i]  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"History({len(self)} calls, {self._slices} runs not made whole)"

    def view(self) -> Iterator[r.CallRecord]:
        """Its calls in order, a run's made for the reader only: read so, the history is left as
        it is (a detector reads the state and never writes it)."""
        for item in self._items:
            if isinstance(item, RunSlice):
                yield from item.calls()
            else:
                yield item

    def first_enter(self) -> float:
        """When its oldest call began (0: none)."""
        if not self._items:
            return 0.0
        first = self._items[0]
        if isinstance(first, RunSlice):
            return first.run.enters[first.lo] + first.run.offset
        return first.enter_time

    def last_run(self) -> r.CallRun | None:
        """The run its latest call came in (as kept: from the slice's first call), if it did."""
        items = self._items
        if items:
            last = items[-1]
            if type(last) is RunSlice:
                return last.run
        return None

    def alone(self) -> Iterator[r.CallRecord]:
        """The calls that came alone, not in a run, without making any run whole: every p2p
        call is one (runs are of collectives)."""
        return (c for c in self._items if not isinstance(c, RunSlice))

    def push(self, call: r.CallRecord, cap: int) -> r.CallRecord | None:
        """Append ``call``; where that takes the history past ``cap`` calls and its oldest is a
        record, drop that and hand it back (the hot path of every call a rank sends alone);
        the caller lets go of what is dropped, and of anything older with ``drop_oldest``."""
        items = self._items
        items.append(call)
        n = self._len = self._len + 1
        if n > cap:
            first = items[0]
            if type(first) is not RunSlice:
                items.popleft()
                self._len = n - 1
                return first  # type: ignore[return-value]
        return None

    def append_run(self, piece: RunSlice) -> None:
        self._items.append(piece)
        self._len += len(piece)
        self._slices += 1

    def drop_oldest(self, k: int) -> tuple[list[r.CallRecord], int]:
        """Let go of the ``k`` oldest calls (at most all): the records among them, and the bytes
        of those that were only in a run (no record to let go)."""
        items = self._items
        records: list[r.CallRecord] = []
        loose = 0
        while k > 0 and items:
            first = items[0]
            if not isinstance(first, RunSlice):
                items.popleft()
                records.append(first)
                self._len -= 1
                k -= 1
                continue
            unmade = len(first) - 1  # the calls before its last, which have no record
            take = min(k, unmade)
            loose += first.bytes(first.lo, first.lo + take)
            first.lo += take
            self._len -= take
            k -= take
            if k and len(first) == 1:
                items.popleft()
                self._slices -= 1
                records.append(first.last)
                self._len -= 1
                k -= 1
        return records, loose

    def _whole(self) -> None:
        made: collections.deque[r.CallRecord | RunSlice] = collections.deque()
        for item in self._items:
            if isinstance(item, RunSlice):
                made.extend(item.whole())
            else:
                made.append(item)
        self._items = made
        self._slices = 0
