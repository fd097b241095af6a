"""Process groups as the ranks announce them, and the numberings of a group made anew.

A group destroyed and created again in the same processes numbers its collectives
from 1 again: each making is a numbering of its own, told by the creation index the hook gives
every group it learns (``records.GroupInfo.index``).
"""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.state.base import (
    MAX_GROUPS,
    WORLD,
    _Base,
    _from_below,
)
from hangwatch.diagnosis.state.history import History
from hangwatch.diagnosis.state.ranks import (
    RankState,
)


class Groups(_Base):
    """Process groups as the ranks announce them, and the numberings of a group made anew."""

    def _group_event(self, state: RankState, event: r.GroupEvent) -> None:
        self.groups_changed = True
        info, name = event.group, event.group.name
        if event.kind is not r.GroupEventKind.CREATED:
            held = state.groups.pop(name, None)
            if held is not None and held is not self.groups.get(name):
                self._charge(state, -b.group_bytes(held))
            if name != "0" and not any(name in st.groups for st in self.ranks.values()):
                self._forget_group(name)  # every member destroyed it
            return
        canonical = self.groups.get(name)
        if canonical is None:
            if len(self.groups) >= MAX_GROUPS and name != WORLD:
                self.dropped_calls += 1
                return
            if not self._room(state, b.group_bytes(info) + b.JOB_GROUP_BYTES):
                return
            canonical = self.groups[name] = info
            # the job's, charged to the rank that made it (as its calls are: it may outlive it)
            self._charge(None, b.group_bytes(info) + b.JOB_GROUP_BYTES)
            state.calls += b.group_bytes(info) + b.JOB_GROUP_BYTES
            self.group_owner[name] = state.rank
        # (kept for groups the job holds: as many as ``state.groups``, and let go of with them)
        seen = self.created_index.setdefault(name, {})
        was = seen.get(state.rank)
        if was is None or info.index > was:
            # (a rank first heard of tells of one of the group's makings, not which: it may be
            # late, and of the one before the others' newest)
            seen[state.rank] = info.index
            if was is not None:  # made anew: its calls number from 1 again, from where they drop
                pending = self.anew.setdefault(name, {})
                pending[state.rank] = pending.get(state.rank, 0) + 1
        # one membership tuple per group, not one per rank (the world group is O(world) long)
        before = state.groups.get(name)
        if before is not None and before is not canonical:
            self._charge(state, -b.group_bytes(before))
        if canonical.ranks == info.ranks:
            state.groups[name] = canonical
        elif self._room(state, b.group_bytes(info)):
            state.groups[name] = info
            self._charge(state, b.group_bytes(info))
        else:
            state.groups.pop(name, None)

    def _forget_group(self, name: str) -> None:
        info = self.groups.pop(name, None)
        if info is not None:
            n = b.group_bytes(info) + b.JOB_GROUP_BYTES
            self._charge(None, -n)
            owner = self.ranks.get(self.group_owner.pop(name, -1))
            if owner is not None:
                owner.calls = owner.calls - n if owner.calls > n else 0
        for slot in (self.slots.pop(name, None) or {}).values():
            self._free_slot(slot)
        for runs in (self.passed.pop(name, None) or {}).values():
            for run in runs:
                self._drop_run(run)
        self.kept_order.pop(name, None)
        self.passed_to.pop(name, None)
        self.passed_low.pop(name, None)
        self.passed_counts.pop(name, None)
        self.run_refs.pop(name, None)
        self.numbering.pop(name, None)
        self.epoch.pop(name, None)
        self.created_index.pop(name, None)
        self.anew.pop(name, None)
        self._arrivals.pop(name, None)
        self._arrivals_due.pop(name, None)
        self._pruned_to.pop(name, None)
        self.changed_slots = {key for key in self.changed_slots if key[0] != name}
        for st in self.ranks.values():
            st.reached.pop(name, None)
            hist = st.history.pop(name, None)
            if hist is not None:
                self._evict(st, hist, len(hist))
                self._charge(st, -b.RANK_GROUP_BYTES)
            shifts = st.seq_shifts.pop(name, None)
            if shifts:
                self._charge(st, -b.SHIFT_BYTES * len(shifts))

    def _current(self, rank: int, group: str) -> bool:
        """Whether ``rank`` numbers ``group`` as its newest numbering does (``_renumbered``)."""
        numbers = self.numbering.get(group)
        return numbers is None or numbers.get(rank, 0) == self.epoch.get(group, 0)

    def _made_anew(self, state: RankState, group: str, hist: History, seq: int, call_id: int) -> bool:
        """A collective of ``state``'s rank on ``group`` (``seq``, ``call_id``): where the rank
        told of makings of the group whose calls have not come yet, the first numbered below its
        last of the same kind (``_from_below``) is the newest making's first. Whether it was."""
        pending = self.anew.get(group)
        makings = pending.get(state.rank) if pending else None
        if not makings or not _from_below(hist, seq, call_id):
            return False
        del pending[state.rank]  # type: ignore[union-attr]
        if not pending:
            del self.anew[group]
        self._renumbered(state, group, makings)
        return True

    def _renumbered(self, state: RankState, group: str, makings: int = 1) -> None:
        """``state``'s rank made ``group`` anew (it said it created it again, with a higher
        creation index): destroy then init again in the same process, an in-process restart.
        Its calls from here (``_made_anew``) number from 1 again. Its runs and what it passed are the
        numbering before's, as are those of every rank not yet heard making it anew: let go of
        (a slot its new calls made would take their calls at the same seqs, a mismatch where the
        shapes changed between the two: a false alarm). Until such a rank makes it anew too, its
        runs are not kept, its calls share no slot with the new numbering's and prune nothing."""
        rank = state.rank
        numbers = self.numbering.setdefault(group, {})
        mine = numbers[rank] = numbers.get(rank, 0) + makings  # (one it made without a call counts)
        epoch = self.epoch.get(group, 0)
        if mine > epoch:
            epoch = self.epoch[group] = mine
            self.run_refs.pop(group, None)  # all the numbering before's
            self._arrivals.pop(group, None)

        def behind(rk: int) -> bool:  # its runs and passed seqs are the numbering before's
            return rk == rank or numbers.get(rk, 0) != epoch

        byrank = self.passed.get(group) or {}
        for rk in [rk for rk in byrank if behind(rk)]:
            for run in byrank.pop(rk):
                self._drop_run(run)
        passed_to = self.passed_to.get(group) or {}
        for rk in [rk for rk in passed_to if behind(rk)]:
            del passed_to[rk]
        self.passed_low.pop(group, None)  # worked out again at the next rank's advance
        self.passed_counts.pop(group, None)
        self._arrivals_due.pop(group, None)
        self._pruned_to.pop(group, None)
        state.entry_seqs.pop(group, None)  # Flight Recorder's numbering starts again with it
        state.reached.pop(group, None)
        self._let_go_on_device(state, group)
        shifts = state.seq_shifts.pop(group, None)  # and gloo's uneven numbering of monitored barriers
        if shifts:
            self._charge(state, -b.SHIFT_BYTES * len(shifts))
