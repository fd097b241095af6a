"""Calls as they come: open calls, their slots by (group, seq), and what leaves them.

A collective enters the rank's history and its slot, where the ranks' calls at one
(group, seq) are compared; it stays open until it exits (on NCCL, until its device completes
it: ``device``). Slots are pruned once every member has left them, keeping a short tail.
"""

from __future__ import annotations

import collections

from hangwatch import catalogue
from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.rules.collective import compare_collective
from hangwatch.diagnosis.state.base import (
    ARRIVALS_KEPT,
    ARRIVALS_SAMPLED_FROM,
    ARRIVALS_SPREAD_S,
    HISTORY_PER_GROUP,
    MAX_GROUPS,
    MAX_OPEN_CALLS,
    MAX_REORDER,
    MAX_SLOTS_PER_GROUP,
    WORLD,
    _Base,
)
from hangwatch.diagnosis.state.history import History
from hangwatch.diagnosis.state.ranks import (
    SEQ_SHIFTS_KEPT,
    UNEVEN_SEQS_ELSEWHERE,
    RankState,
    Slot,
    _shift_at,
)
from hangwatch.flight_entries import ENTRY_CALL_IDS


class Calls(_Base):
    """Calls as they come: open calls, their slots by (group, seq), and what leaves them."""

    def _enter(self, state: RankState, call: r.CallRecord, now: float) -> None:
        # the hot path of ingest (every call of every rank): locals, one kind lookup, no scans
        group, seq = call.group, call.seq
        slots = self.slots.get(group)
        hist = state.history.get(group)
        if hist is None and slots is None and len(state.history) >= MAX_GROUPS and group != WORLD:
            self.dropped_calls += 1
            return
        call_id = call.call_id
        resent = False
        if call_id < ENTRY_CALL_IDS:
            if call_id > state.last_call_id:
                state.last_call_id = call_id
                self.records_received += 1
            else:  # a batch sent again (its reply was lost): applied again, the same, counted once
                self.duplicates += 1
                resent = True
        elif seq <= state.entry_seqs.get(group, 0) and not (
            self.anew and hist is not None and self._made_anew(state, group, hist, seq, call_id)
        ):  # (a Flight Recorder record of a group made anew numbers from 1 again)
            self.duplicates += 1  # made again from the same entry (an agent took over the ring)
            return
        cost = call.cost = call.cost or b.call_bytes(call)  # decoded calls carry their signature's
        need = cost + (b.CALL_TABLES_BYTES if hist is not None else b.CALL_TABLES_BYTES + b.RANK_GROUP_BYTES)
        ledger = self.ledger
        limits = ledger.budget
        mine = state.held + state.calls + need
        over = mine > limits.rank or self.held + need > limits.job or ledger.held + need > limits.total
        if over and not self._room(state, need):
            return  # over a memory budget: dropped, and counted (``budget``)
        if call_id >= ENTRY_CALL_IDS:
            state.entry_seqs[group] = seq  # (one per group with a history: charged with it)
            self.records_received += 1
        # charged once, held while it is applied; each table that keeps it adds a hold
        call.holds = 1
        state.calls += cost
        self.held += cost
        ledger.held += cost
        try:
            shifts = state.seq_shifts.get(group) if state.seq_shifts else None
            if shifts and call.kind is not r.OpKind.P2P:
                seq = call.seq = seq - _shift_at(shifts, seq)  # torch's numbering, lined up again
            offset = state.clock_offset
            enter = call.enter_time = call.enter_time + offset
            done = call.exit_time is not None
            if done:
                call.exit_time += offset  # type: ignore[operator]
                if (
                    state.progress
                    and call.error is None
                    and self.awaits_completion(state, call, call.seq_count, call.exit_time, now)
                ):
                    call.returned_time, call.exit_time, done = call.exit_time, None, False
            last = state.last_call
            if last is None or enter >= last.enter_time:
                state.last_call = call  # Flight Recorder records may arrive after later Python calls
                if state.last_kept:  # the one before was kept alive by this reference alone
                    self._release_kept(state)
                if enter > state.last_sent:
                    state.last_sent = enter  # its batch left after it began
            state.last_progress = now
            if call.step > state.step:
                state.step = call.step
            if hist is None:
                if slots is None and len(self.slots) >= MAX_GROUPS and group != WORLD:
                    self.dropped_calls += 1
                    return
                hist = state.history[group] = History()
                self._charge(state, b.RANK_GROUP_BYTES)
            elif self.anew and call.kind is r.OpKind.COLLECTIVE:
                self._made_anew(state, group, hist, seq, call_id)
            oldest = hist.push(call, HISTORY_PER_GROUP)  # the oldest leaves (inlined ``_unhold``)
            if oldest is not None:
                oldest.holds -= 1
                if not oldest.holds:
                    self._unhold_last(state, oldest)
            elif len(hist) > HISTORY_PER_GROUP:  # its oldest stood in a run
                self._evict(state, hist, len(hist) - HISTORY_PER_GROUP)
            call.holds += 1
            open_calls = state.open_calls
            kind = call.kind
            if not done:
                before = open_calls.get(call_id)
                if before is not None and before is not call:  # its id again: the old call is replaced
                    del open_calls[call_id]
                    self._drop_open(state, before)
                    self._unslot(before)
                    self._charge(state, -b.OPEN_BYTES)
                    self._unhold(state, before)
            if kind is r.OpKind.COLLECTIVE:
                open_here = state.open_collectives.get(group)
                if open_here:
                    # Collectives on one group complete in order on a rank: older open ones are done
                    # (those the host returned from and the device has not completed are not).
                    for other in [c for c in open_here.values() if c.seq < seq and c.returned_time is None]:
                        self._close(state, other, enter, None)
                if not done:
                    if open_here is None:
                        open_here = state.open_collectives[group] = {}
                    open_here[call.call_id] = call
            if not done:
                open_calls[call_id] = call
                call.holds += 1
                self._charge(state, b.OPEN_BYTES)
                if len(open_calls) > MAX_OPEN_CALLS:  # exits that never come: keep the newest
                    # by time, not id: ids made from Flight Recorder entries (bit 62) are not newer
                    oldest = open_calls.pop(min(open_calls, key=lambda k: open_calls[k].enter_time))
                    self._unslot(oldest)
                    self._drop_open(state, oldest)
                    self._charge(state, -b.OPEN_BYTES)
                    self._unhold(state, oldest)
            if kind is r.OpKind.P2P:
                self.p2p_changed = True
                if not done:
                    self.p2p_open[(state.rank, call.call_id)] = call
                return
            if kind is not r.OpKind.COLLECTIVE:
                return
            if seq > state.reached.get(group, 0):
                state.reached[group] = seq
            if slots is None:
                slots = self.slots[group] = collections.OrderedDict()
            slot = slots.get(seq)
            numbers = self.numbering.get(group)
            if numbers is not None and slot is not None:
                mine = numbers.get(state.rank, 0)
                if slot.numbering > mine:
                    return  # a numbering before the slot's (a rank behind a restart): no call of it
                if slot.numbering < mine:
                    del slots[seq]  # the numbering before's: this rank's is newer, and so is its slot
                    self._free_slot(slot)
                    slot = None
            if slot is None:  # (a call sent again goes below the slots of the rank's later calls)
                slot = self._new_slot(group, seq, slots, enter, state.rank, in_place=resent)
            elif enter > slot.last_enter:
                slot.last_enter = enter
            elif enter < slot.first_enter:
                slot.first_enter = enter
            self._into_slot(state, slot, call)
            members = self.members(group)
            if len(slot.calls) == len(members) > 1:
                here = slot.calls
                times = [c.enter_time for c in here.values()]
                arrived = max(times)
                times.sort()  # floats: a third of the cost of sorting (time, rank) pairs
                median = times[(len(times) - 1) // 2]  # of the others: the last rank's lag behind it
                lasts = self._arrivals.get(group)
                if lasts is None:
                    lasts = self._arrivals[group] = collections.deque(maxlen=ARRIVALS_KEPT)
                latest = max(rk for rk, c in here.items() if c.enter_time == arrived)  # a tie: the highest
                if not (
                    len(members) > ARRIVALS_SAMPLED_FROM
                    and lasts
                    and slot.first_enter - lasts[-1][3] < ARRIVALS_SPREAD_S
                ):
                    lasts.append((latest, arrived - median, seq, slot.first_enter))
            if done and call.error is None:  # reported already complete
                waited = call.exit_time - enter  # type: ignore[operator]
                self.wait_durations.append(waited if waited > 0.0 else 0.0)
                if numbers is None or self._current(state.rank, group):  # (another numbering's prune nothing)
                    self._prune(group, seq, members)
                    if group in self.passed_to and not self._in_run:
                        self._advance(group, state.rank, seq, members)
            if done and call.seq_count > UNEVEN_SEQS_ELSEWHERE and catalogue.uneven_seqs(call.op):
                self._shift_after(state, call)
        finally:  # the hold it had while it was applied (inlined ``_unhold``: every call)
            held = call.holds - 1
            call.holds = held
            if not held:
                self._unhold_last(state, call)

    def _exit(self, state: RankState, done: r.CallExit, now: float) -> None:
        call = state.open_calls.get(done.call_id)
        state.last_progress = now
        if call is None:
            return
        call.seq_count = done.seq_count
        if done.seq_count > UNEVEN_SEQS_ELSEWHERE and catalogue.uneven_seqs(call.op):
            self._shift_after(state, call)
        when = state.to_local(done.exit_time)
        if state.progress and done.error is None and self.awaits_completion(state, call, done.seq_count, when, now):
            call.returned_time = when  # enqueued: open until the device completes it
            return
        self._close(state, call, when, done.error)

    def _shift_after(self, state: RankState, call: r.CallRecord) -> None:
        """``call`` (gloo's monitored_barrier, the group's rank 0) took ``seq_count`` of torch's
        seqs where the other ranks took 2: from its end on, this rank's seqs (Python's and
        Flight Recorder's alike: both follow torch's counter) are numbered back by the excess."""
        shifts = state.seq_shifts.setdefault(call.group, [])
        before = shifts[-1][1] if shifts else 0
        raw_last = call.seq + before + call.seq_count - 1
        shifts.append((raw_last, before + call.seq_count - UNEVEN_SEQS_ELSEWHERE))
        self._charge(state, b.SHIFT_BYTES)
        if len(shifts) > SEQ_SHIFTS_KEPT:
            self._charge(state, -b.SHIFT_BYTES * (len(shifts) - SEQ_SHIFTS_KEPT))
            del shifts[:-SEQ_SHIFTS_KEPT]
        call.seq_count = UNEVEN_SEQS_ELSEWHERE

    def _into_slot(self, state: RankState, slot: Slot, call: r.CallRecord) -> None:
        """``call`` in ``slot`` as its rank's, held there (the rank's call there before, if any,
        let go of)."""
        before_here = slot.calls.get(state.rank)
        slot.add(call)
        if not slot.pinned and (slot.differs or self._wrong_when_full(slot)):
            self._pin(slot)
        call.holds += 1
        if before_here is None:
            self.held += b.SLOT_ENTRY_BYTES
            self.ledger.held += b.SLOT_ENTRY_BYTES
        else:
            self._unhold(state, before_here)
        self.changed_slots.add((slot.group, slot.seq))

    def _track_open(self, state: RankState, call: r.CallRecord) -> None:
        """``call`` (on the device, a run's) in its rank's open calls, held and charged there; its
        rank's latest call where it is that one."""
        state.open_calls[call.call_id] = call
        call.holds += 1
        self._charge(state, b.OPEN_BYTES)
        here = state.open_collectives.get(call.group)
        if here is None:
            here = state.open_collectives[call.group] = {}
        here[call.call_id] = call
        last = state.last_call
        if last is not None and last.call_id == call.call_id:  # its latest call is this one, open
            state.last_call = call
            if state.last_kept:
                self._release_kept(state)

    def _close(self, state: RankState, call: r.CallRecord, when: float, error: str | None) -> None:
        if call.exit_time is None and call.kind is r.OpKind.COLLECTIVE:
            slots = self.slots.get(call.group)
            slot = None if slots is None else slots.get(call.seq)
            if slot is not None and slot.calls.get(call.rank) is call:
                slot.open -= 1
        call.exit_time = when
        if state.open_calls.get(call.call_id) is call:
            del state.open_calls[call.call_id]
            self._charge(state, -b.OPEN_BYTES)
            self._unhold(state, call)
        if error is not None and call.error is None and call.holds:
            extra = b.text_bytes(error)  # the error's text, held with the call
            state.calls += extra
            self.held += extra
            self.ledger.held += extra
            call.cost += extra
        call.error = error
        self._drop_open(state, call)
        if call.kind is r.OpKind.COLLECTIVE and error is None:
            self.wait_durations.append(max(0.0, when - call.enter_time))
            if self._current(state.rank, call.group):
                self._prune(call.group, call.seq)
                if call.group in self.passed_to:
                    self._advance(call.group, state.rank, call.seq, self.members(call.group))

    def _drop_open(self, state: RankState, call: r.CallRecord) -> None:
        self.p2p_open.pop((state.rank, call.call_id), None)
        open_here = state.open_collectives.get(call.group)
        if open_here is not None:
            open_here.pop(call.call_id, None)
            if not open_here:
                del state.open_collectives[call.group]

    def _unslot(self, call: r.CallRecord) -> None:
        slots = self.slots.get(call.group)
        slot = None if slots is None else slots.get(call.seq)
        held = None if slot is None else slot.calls.get(call.rank)
        if slot is not None and held is not None:
            slot.remove(call.rank)
            self._charge(None, -b.SLOT_ENTRY_BYTES)
            self._unhold(None, held)

    def _prune(self, group: str, seq: int, members: tuple[int, ...] | None = None) -> None:
        """Drop slots older than ``seq`` whose calls have all completed, keeping a short tail."""
        slots = self.slots.get(group)
        if not slots or seq - 8 <= next(iter(slots)) <= seq + 8:
            return
        if members is None:
            members = self.members(group)
        while slots:
            first_seq, first = next(iter(slots.items()))
            if first_seq > seq + 8 and not first.open:
                if not self._left_behind(group, first):
                    break  # ahead of this rank: others passed the seqs between in runs
                # older than every slot after it, yet numbered ahead, and every rank in it has
                # called below it since: left by a numbering that started again (the group
                # made anew; torchelastic restarts every worker, and seqs start from 1)
                self._free_slot(slots.popitem(last=False)[1])
                continue
            if first_seq >= seq - 8:
                break
            if first.open or first.pinned:
                break
            if members and len(first.calls) < len(members) and first_seq >= seq - 256:
                break  # someone has not arrived yet: keep it for the detectors
            self._free_slot(slots.popitem(last=False)[1])

    def _new_slot(
        self,
        group: str,
        seq: int,
        slots: collections.OrderedDict[int, Slot],
        enter: float,
        rank: int,
        in_place: bool = False,
    ) -> Slot:
        """A slot at (group, seq), with the calls other ranks' runs hold at that seq. ``in_place``:
        put in seq order even where ``rank`` has calls in the slots above (a call of its own
        run made a call late, where its device stopped: not a numbering started again)."""
        slot = slots[seq] = Slot(group, seq, first_enter=enter, last_enter=enter)
        numbers = self.numbering.get(group)
        if numbers is not None:
            slot.numbering = numbers.get(rank, 0) if rank >= 0 else self.epoch.get(group, 0)
        self.held += b.SLOT_BYTES
        self.ledger.held += b.SLOT_BYTES
        # Slots stand in seq order (``_prune`` reads them oldest first). One made below slots
        # already there is a slow rank's (others passed its seq in runs, making no slot): put in
        # its place. Unless ``rank`` has calls in those slots: then its numbering started again
        # (its group made anew), and the old slots are left to ``_prune`` as such.
        higher: list[int] = []
        most = MAX_SLOTS_PER_GROUP if in_place else MAX_REORDER  # (in place: rare, where a device stopped)
        for k in reversed(slots):
            if k < seq or len(higher) > most:
                break
            if k != seq:
                higher.append(k)
        if higher and len(higher) <= most and (in_place or not any(rank in slots[k].calls for k in higher)):
            for k in reversed(higher):
                slots.move_to_end(k)
        while len(slots) > MAX_SLOTS_PER_GROUP:
            self._free_slot(slots.popitem(last=False)[1])
        if self.passed.get(group):
            self._pull_passed(group, seq, slot, rank)
        return slot

    def _wrong_when_full(self, slot: Slot) -> bool:
        """Whether ``slot`` just got its last member's call and its calls, alike, are wrong in
        themselves (against the group's size): kept for the detectors, which may be waiting for
        the others' batches before they tell it, rather than pruned as complete before they see it."""
        members = self.members(slot.group)
        if not members or len(slot.calls) != len(members):
            return False
        first = next(iter(slot.calls.values()))
        return compare_collective({first.rank: first}, len(members)) is not None  # once a slot

    def _pin(self, slot: Slot) -> None:
        """Keep ``slot`` until the engine's next tick has looked at it (``take_changes``)."""
        slot.pinned = True
        self.pinned.append(slot)
        if len(self.pinned) > MAX_SLOTS_PER_GROUP:  # no engine ticks (a replay, a bench): bounded
            for old in self.pinned[: MAX_SLOTS_PER_GROUP // 2]:
                old.pinned = False
            del self.pinned[: MAX_SLOTS_PER_GROUP // 2]

    def _left_behind(self, group: str, slot: Slot) -> bool:
        """Whether every rank with a call in ``slot`` has since made a call on ``group`` numbered
        below it (its numbering started again), or is gone from the job's state."""
        for rank in slot.calls:
            st = self.ranks.get(rank)
            hist = st.history.get(group) if st is not None else None
            if hist and hist[-1].seq >= slot.seq:
                return False
        return True
