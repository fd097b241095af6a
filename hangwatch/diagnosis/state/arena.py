"""The memory a job holds, charged to its budgets: the only reference counting.

Each call is charged once, however many tables hold it (``CallRecord.holds``); a table
entry, slot, group or marker at its estimated size (``budget``). A charge that would take the
rank, its job or the coordinator over its budget is refused before anything is stored; the
rank's oldest history goes first.
"""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.state.base import (
    _Base,
)
from hangwatch.diagnosis.state.history import History
from hangwatch.diagnosis.state.ranks import (
    RankState,
    Slot,
)


class Arena(_Base):
    """The memory a job holds, charged to its budgets: the only reference counting."""

    def _charge(self, state: RankState | None, n: int) -> None:
        """Account ``n`` bytes (negative: released) to ``state``, the job and the coordinator."""
        if state is not None:
            state.held += n
        self.held += n
        self.ledger.held += n

    def _unhold(self, state: RankState | None, call: r.CallRecord) -> None:
        """A table let go of ``call``: released when it was the last."""
        held = call.holds - 1
        call.holds = held
        if not held:
            self._unhold_last(state, call)

    def _unhold_last(self, state: RankState | None, call: r.CallRecord) -> None:
        """No table holds ``call`` any more: released, unless it is still its rank's latest call
        (``RankState.last_call``), which keeps it alive: then charged to the rank until a later
        call takes its place."""
        if state is None:
            state = self.ranks.get(call.rank)
        if state is not None and state.last_call is call:
            state.last_kept = call.cost
            return
        n = call.cost
        if state is not None:
            state.calls = state.calls - n if state.calls > n else 0
        self.held -= n
        self.ledger.held -= n

    def _release_kept(self, state: RankState) -> None:
        n = state.last_kept
        state.last_kept = 0
        state.calls = state.calls - n if state.calls > n else 0
        self.held -= n
        self.ledger.held -= n

    def _room(self, state: RankState | None, n: int) -> bool:
        """Whether ``n`` more bytes for ``state`` (None: a rank not yet made) fit its, the job's
        and the coordinator's budgets, its oldest history let go first if that makes room;
        counted when not."""
        ledger = self.ledger
        budget = ledger.budget
        mine = 0 if state is None else state.held + state.calls
        job = budget.job_for(self.world_size)
        if mine + n <= budget.rank and self.held + n <= job and ledger.held + n <= budget.total:
            return True
        if state is not None:
            self._trim(state, max(mine + n - budget.rank, self.held + n - job, ledger.held + n - budget.total))
            mine = state.held + state.calls
        for which, excess in (
            ("rank", mine + n - budget.rank),
            ("job", self.held + n - job),
            ("total", ledger.held + n - budget.total),
        ):
            if excess > 0:
                self.refused += 1
                if which != "rank":
                    self.refused_wide += 1
                ledger.refuse(which)
                return False
        return True

    def _trim(self, state: RankState, need: int) -> None:
        """Let go of ``state``'s oldest history records (the longest history first) until
        ``need`` bytes are freed or none is left: history only feeds the rules' explanations."""
        before = self.held
        while before - self.held < need:
            hist = max(state.history.values(), key=len, default=None)
            if not hist:
                break
            self._evict(state, hist, 1)
            self.ledger.trimmed += 1

    def _evict(self, state: RankState, hist: History, k: int) -> None:
        """Let go of the ``k`` oldest calls of ``hist``, one of ``state``'s histories."""
        records, loose = hist.drop_oldest(k)
        for call in records:  # inlined ``_unhold``
            call.holds -= 1
            if not call.holds:
                self._unhold_last(state, call)
        if loose:  # calls of a run never made whole: charged alike, and no other table holds them
            state.calls = state.calls - loose if state.calls > loose else 0
            self.held -= loose
            self.ledger.held -= loose

    def _free_slot(self, slot: Slot) -> None:
        # inlined ``_unhold``: every call passes here once its slot is pruned
        freed = b.SLOT_BYTES + b.SLOT_ENTRY_BYTES * len(slot.calls)
        ranks = self.ranks
        for call in slot.calls.values():
            held = call.holds - 1
            call.holds = held
            if not held:
                st = ranks.get(call.rank)
                if st is not None and st.last_call is call:
                    st.last_kept = call.cost  # still its rank's latest call: kept, and charged
                    continue
                n = call.cost
                freed += n
                if st is not None:
                    st.calls = st.calls - n if st.calls > n else 0
        self.held -= freed
        self.ledger.held -= freed
