"""Runs of alike calls (``records.CallRun``), taken whole: a call made only where a table needs one.

A rank in its steady state sends stretches of alike calls as one record. The other
seqs stay the run's (``passed``); a slot made at one later takes the call from it; each run
is compared with the first run through the same seqs, and slots are made where they differ.
"""

from __future__ import annotations

import collections
import itertools

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.state.base import (
    ARRIVALS_KEPT,
    DURATIONS_KEPT,
    HISTORY_PER_GROUP,
    MAX_SLOTS_PER_GROUP,
    ON_DEVICE_RUNS,
    PRUNE_MEMBERS_PER_SEQ,
    PRUNE_RUNS_EVERY,
    _any_in,
    _Base,
    _run_at,
    _run_key,
    _run_waits,
    _RunRef,
)
from hangwatch.diagnosis.state.facts import facts_of
from hangwatch.diagnosis.state.history import History, RunSlice
from hangwatch.diagnosis.state.ranks import (
    OnDevice,
    RankState,
    Slot,
)
from hangwatch.flight_entries import ENTRY_CALL_IDS

#: Runs' places kept in the order they were kept (``JobState.kept_order``), a few per member.
KEPT_ORDER_PER_MEMBER = 4
KEPT_ORDER_MIN = 1024


def _waiting_in(slots: collections.OrderedDict[int, Slot] | None, first: int, n: int) -> list[int]:
    """Where ``slots`` wait among the ``n`` seqs from ``first``, as offsets from it, in order;
    found by whichever is fewer: the slots or the seqs."""
    if not slots or not _any_in(slots, first, first + n - 1):
        return []
    if len(slots) <= n:
        return sorted(seq - first for seq in slots if first <= seq < first + n)
    return [i for i in range(n) if first + i in slots]


class Runs(_Base):
    """Runs of alike calls (``records.CallRun``), taken whole: a call made only where a table needs one."""

    def _continues_run(self, state: RankState, call: r.CallRecord) -> r.CallRun | None:
        """Where a completed call sent alone is the next call of the run its rank's previous call
        on its group came in (the seq after it, alike to the call the run, or its cycle, would
        have made there, call site included), that call as a run of one on the run's template;
        else None (it is entered as a call, with its slot). A read's edge that falls one call
        from the end of a run or a step cuts such a call off; at 1,024 ranks some rank does so
        at nearly every step, and a slot made there would have every other rank's run enter its
        call there whole (``_run_by_slots``). Made on the run's template, as the run's calls
        are, ``_faulty`` knows it. Calls that come alone as a rule (no two alike in a row) go on
        as calls."""
        done = call.exit_time
        hist = state.history.get(call.group) if done is not None else None
        run = hist.last_run() if hist is not None else None
        if run is None or done is None:
            return None
        n = len(run.enters)
        t = run.template_at(n)
        if (
            call.seq == run.first_seq + n
            and run.first_call_id + n <= call.call_id < ENTRY_CALL_IDS  # (calls on other groups between)
            and call.error is None
            and call.seq_count == 1
            and call.returned_time is None
            and _run_key(call) == _run_key(t)
            and (call.call_site, call.peer, call.source) == (t.call_site, t.peer, t.source)
        ):
            return r.CallRun(state.rank, t, call.call_id, call.seq, call.step, [call.enter_time], [done])
        return None

    def _run(self, state: RankState, run: r.CallRun, now: float) -> None:
        """Apply a run of calls alike (``records.CallRun``) with what each of them would have
        done, except that a call is made only where a table needs one: a slot that exists at
        its seq (made by a rank that sent that call alone), and the rank's history (its last
        ``HISTORY_PER_GROUP`` calls). The other seqs stay the run's (``passed``): a slot made at
        one later takes the call from it (``_pull_passed``); the run is compared with the first
        run through the same seqs (``_compare_run``), and where they differ slots are made
        for the detectors; once every member has passed a seq, its arrivals are counted
        (``_runs_complete``) and the runs below it let go (``_prune_runs``). A run that its
        rank's state would treat call by call (device progress watched, seqs renumbered, a
        first call on the group, a call sent again) is applied call by call."""
        group = run.template.group
        n = len(run.enters)
        size = len(self.members(group)) or None
        costs, odd, mine = facts_of(run, size)
        # from which call the device (NCCL) has not been seen to complete them: those are the
        # run's as the others are, and on the device until a progress read completes them
        if n > 2 and len(run.exits) == n and group not in state.history and not odd:
            # a rank's first call on the group (its first batch may be a whole cycle, folded):
            # that call alone, as it would have come, then the rest as the run
            self._enter(state, run.call(0), now)
            if group in state.history:
                self._run(state, run.tail(1), now)
                return
            for i in range(1, n):
                self._enter(state, run.call(i), now)
            return
        device = self._device_from(state, run, now) if state.progress and n == len(run.exits) else n
        slots = self.slots.get(group)
        # each call a slot waits for is entered whole: its tables, and its open call, are charged too
        whole = len(_waiting_in(slots, run.first_seq, n)) * (b.CALL_TABLES_BYTES + b.OPEN_BYTES)
        if (
            not n
            or len(run.exits) != n
            or odd
            or group not in state.history
            or (device < n and len(state.on_device.get(group) or ()) >= ON_DEVICE_RUNS)
            or state.seq_shifts.get(group)
            or run.first_call_id <= state.last_call_id
            or not self._room(
                state, b.run_bytes(n) * (2 if device < n else 1) + min(n, HISTORY_PER_GROUP) * max(costs) + whole
            )
        ):
            for i in range(n):
                self._enter(state, run.call(i), now)
            return
        hist = state.history[group]
        first = run.first_seq
        if self.anew:
            self._made_anew(state, group, hist, first, run.first_call_id)
        offset = run.offset = state.clock_offset
        open_here = state.open_collectives.get(group)
        if open_here:  # collectives on one group complete in order (as ``_enter`` closes them)
            for other in [c for c in open_here.values() if c.seq < first and c.returned_time is None]:
                self._close(state, other, run.enters[0] + offset, None)
        if not slots or not _any_in(slots, first, first + n - 1):
            # no slot waits for any of its calls (the steady state): taken whole, the history
            # keeping the run's last calls as the run (``state.history``)
            passed, last = True, self._pass(state, run, hist, 0, n, costs, device)
        else:
            passed, last = self._run_by_slots(state, run, hist, costs, now, device)
        if run.last_seq > state.reached.get(group, 0):
            state.reached[group] = run.last_seq
        if last is not None:
            before = state.last_call
            if before is None or last.enter_time >= before.enter_time:
                state.last_call = last
                if state.last_kept:
                    self._release_kept(state)
                if last.enter_time > state.last_sent:
                    state.last_sent = last.enter_time
            state.last_progress = now
            if run.last_step > state.step:
                state.step = run.last_step
        self.runs_taken += 1
        self.run_calls += n
        if run.cycle:
            self.cycle_calls += n
        current = self._current(state.rank, group)
        if device < n and current:
            entry = OnDevice(run, device, b.run_bytes(n))
            self.device_calls += n - device
            self._charge(state, entry.cost)
            state.on_device.setdefault(group, collections.deque()).append(entry)
        if not current:
            pass  # a numbering a restart left behind: not kept, compared, counted, or pruning
        elif passed:
            self._keep_run(state, run, mine)  # compared with the others', then the rank's passed seq moves
        elif group in self.passed_to:
            self._advance(group, state.rank, run.last_seq, self.members(group))
        if slots and current:
            self._prune(group, run.last_seq)

    def _pass(
        self,
        state: RankState,
        run: r.CallRun,
        hist: History,
        lo: int,
        hi: int,
        costs: tuple[int, ...],
        device: int,
    ) -> r.CallRecord | None:
        """Take calls ``lo`` to ``hi - 1`` of ``run`` as passed (no slot waits for them): counted,
        their waits kept (those of the run's last ``DURATIONS_KEPT`` before ``device``, the first
        still on the device: theirs are kept as progress completes them), and those among the
        run's last ``HISTORY_PER_GROUP`` kept in the rank's history as a slice of the run (no
        record each: ``history.RunSlice``). The last call made whole for the history, if any."""
        n = len(run.enters)
        state.last_call_id = run.first_call_id + hi - 1
        self.records_received += hi - lo
        enters, exits = run.enters, run.exits
        d = max(lo, n - DURATIONS_KEPT)
        w = min(hi, device)
        if d < w:
            self.wait_durations.extend(_run_waits(enters, exits, d, w))
        lo = max(lo, n - HISTORY_PER_GROUP)
        k = hi - lo
        if k <= 0:
            return None
        if len(hist) + k > HISTORY_PER_GROUP:
            self._evict(state, hist, len(hist) + k - HISTORY_PER_GROUP)
        last = run.call(hi - 1, run.offset)
        piece = RunSlice.part(run, lo, hi, last, costs)  # its own copy: not the whole run's times
        last.cost = piece.cost_of(k - 1)
        last.holds = 1
        charged = piece.bytes(0, k)
        state.calls += charged
        self.held += charged
        self.ledger.held += charged
        hist.append_run(piece)
        return last

    def _run_by_slots(
        self, state: RankState, run: r.CallRun, hist: History, costs: tuple[int, ...], now: float, device: int
    ) -> tuple[bool, r.CallRecord | None]:
        """``_run``'s calls where slots wait for some of them: those are made whole and entered;
        the stretches between them are taken as passed (``_pass``), so a run through a few
        slots costs a few calls, not one per call. (A rank that sent a call alone at a seq,
        at the edge of a batch, makes a slot there that every other rank's run goes through.)
        Whether any call stayed the run's, and the last call made for the history."""
        group, first = run.template.group, run.first_seq
        n = len(run.enters)
        slots = self.slots[group]
        waiting = _waiting_in(slots, first, n)
        passed = False
        last: r.CallRecord | None = None
        start = 0  # the first call of the stretch not yet taken
        self._in_run = True
        try:
            for i in waiting:
                if first + i not in slots:  # let go of since, by a call entered before it
                    continue
                if i > start:
                    passed = True
                    last = self._pass(state, run, hist, start, i, costs, device) or last
                self._enter(state, run.call(i), now)  # a slot waits for it: the call, whole
                start = i + 1
            if start < n:
                passed = True
                last = self._pass(state, run, hist, start, n, costs, device) or last
        finally:
            self._in_run = False
        return passed, last

    def _keep_run(self, state: RankState, run: r.CallRun, mine: _RunRef) -> None:
        group = run.template.group
        run.cost = b.run_bytes(len(run.enters))
        run.holder = state
        self._charge(state, run.cost)
        byrank = self.passed.get(group)
        if byrank is None:
            byrank = self.passed[group] = {}
        runs = byrank.get(state.rank)
        if runs is None:
            runs = byrank[state.rank] = collections.deque()
        elif runs and runs[-1].last_seq >= run.first_seq:
            # numbered from below again (the group was made anew): the older runs are another
            # numbering's, and so is what the others' runs were compared with
            while runs:
                self._drop_run(runs.popleft())
            self.run_refs.pop(group, None)
            self._arrivals_due.pop(group, None)
        runs.append(run)
        members = self.members(group)
        order = self.kept_order.get(group)
        if order is None:
            order = self.kept_order[group] = collections.deque()
        order.append((run.last_seq, state.rank))
        if len(order) > KEPT_ORDER_PER_MEMBER * len(members) + KEPT_ORDER_MIN:
            order.popleft()  # (a member that never comes: the bound below lets its runs go)
        while len(runs) > 1 and runs[-1].last_seq - runs[0].first_seq >= MAX_SLOTS_PER_GROUP:
            self._drop_run(runs.popleft())  # a member that never comes: bounded as slots are
        self._compare_run(group, mine)
        self._advance(group, state.rank, run.last_seq, members)

    def _drop_run(self, run: r.CallRun) -> None:
        holder = run.holder
        state = holder if isinstance(holder, RankState) and self.ranks.get(holder.rank) is holder else None
        self._charge(state, -run.cost)
        run.cost = 0
        run.holder = None

    def _compare_run(self, group: str, mine: _RunRef) -> None:
        """Compare ``run`` with the first run through its seqs; where they differ, make the slots
        of the seqs they share, for the detectors to judge as they judge any slot (each one
        a mismatch's repeat, or a difference no rule minds: split sizes of ``all_to_all``).
        A call site is no difference: rules judge it only where a slot is made anyway. A
        cycle's calls are compared seq by seq, each with its own template's."""
        refs = self.run_refs.get(group)
        if refs is None:
            refs = self.run_refs[group] = collections.deque()
        lo, hi = mine.lo, mine.hi
        covered = refs[-1].hi if refs else lo - 1
        for ref in reversed(refs):
            if ref.hi < lo:
                break
            if ref.lo > hi or ref.alike(mine):
                continue
            for seq in range(max(lo, ref.lo), min(hi, ref.hi) + 1):
                if ref.key_at(seq) != mine.key_at(seq):
                    self._materialize(group, seq)
        if hi > covered:
            start = max(lo, covered + 1)
            last = refs[-1] if refs else None
            if last is not None and last.hi == start - 1 and last.alike(mine):
                last.hi = hi
            else:
                mine.lo = start
                refs.append(mine)
                if len(refs) > MAX_SLOTS_PER_GROUP:
                    refs.popleft()

    def _pull_passed(self, group: str, seq: int, slot: Slot, skip: int) -> None:
        """Put into ``slot`` the calls that ranks' runs hold at its seq (each charged as the
        call it is), but ``skip``'s and those it has."""
        byrank = self.passed.get(group)
        if not byrank or slot.numbering != self.epoch.get(group, 0):
            return  # (runs kept are the newest numbering's: ``_renumbered``)
        ledger = self.ledger
        for rank, runs in byrank.items():
            if rank == skip or rank in slot.calls:
                continue
            run = _run_at(runs, seq)
            if run is None:
                continue
            st = self.ranks.get(rank)
            i = seq - run.first_seq
            # its device holds calls (not a run of an earlier session of the rank: ids start again)
            watched = st if st is not None and st.on_device and run.holder is st else None
            opened = watched.open_calls.get(run.first_call_id + i) if watched is not None else None
            device = False
            if opened is not None:  # made an open call already (its device stopped at it): charged
                call, cost = opened, 0
                call.holds += 1
            else:
                call = run.call(i, run.offset)
                cost = call.cost = call.cost or b.call_bytes(call)
                call.holds = 1
                device = watched is not None and self._on_device_at(watched, group, seq)
                if device:  # on its device still: open, as it would be without runs
                    call.returned_time, call.exit_time = call.exit_time, None
            empty = not slot.calls and not slot.last_enter  # made by ``_materialize``: no time yet
            slot.add(call)
            if not slot.pinned and (slot.differs or self._wrong_when_full(slot)):
                self._pin(slot)
            enter = call.enter_time
            if empty or enter < slot.first_enter:
                slot.first_enter = enter
            if empty or enter > slot.last_enter:
                slot.last_enter = enter
            if st is not None:
                st.calls += cost
                if device:
                    self._track_open(st, call)
            self.held += cost + b.SLOT_ENTRY_BYTES
            ledger.held += cost + b.SLOT_ENTRY_BYTES

    def _materialize(self, group: str, seq: int) -> None:
        """Make (or fill) the slot at (group, seq) from the runs that hold it, for the detectors."""
        slots = self.slots.get(group)
        if slots is None:
            slots = self.slots[group] = collections.OrderedDict()
        slot = slots.get(seq)
        if slot is None:
            slot = self._new_slot(group, seq, slots, 0.0, -1)
        else:
            self._pull_passed(group, seq, slot, -1)
        if not slot.pinned:
            self._pin(slot)
        self.changed_slots.add((group, seq))

    def _advance(self, group: str, rank: int, seq: int, members: tuple[int, ...]) -> None:
        """``rank`` passed every seq of ``group`` up to ``seq``. When the lowest member moves up,
        what every member has now passed is counted and the runs below let go. The members are
        counted per seq they stand at (a few seqs): the lowest is found without walking them."""
        passed_to = self.passed_to.get(group)
        if passed_to is None:
            passed_to = self.passed_to[group] = {}
        before = passed_to.get(rank, 0)
        if seq <= before:
            return
        passed_to[rank] = seq
        if not members:
            return
        held = self.passed_counts.get(group)
        if held is None or held[0] is not members:  # first, or the members learned anew
            counts: dict[int, int] = collections.Counter(map(passed_to.get, members, itertools.repeat(0)))
            self.passed_counts[group] = (members, frozenset(members), counts)
        elif rank in held[1]:
            counts = held[2]
            left = counts[before] - 1
            if left:
                counts[before] = left
            else:
                del counts[before]
            counts[seq] = counts.get(seq, 0) + 1
        else:
            return  # not a member: where the members stand is unchanged
        low = self.passed_low.get(group, 0)
        if low in counts:  # (seqs passed only grow: the lowest is still where it was)
            self.passed_low[group] = low
            return
        new_low = min(counts)
        if new_low > low:
            due = self._arrivals_due.get(group)
            self._arrivals_due[group] = (due[0] if due else low, new_low, members)
            # (a prune may walk every member: at most one walk each ``PRUNE_MEMBERS_PER_SEQ`` seqs)
            every = max(PRUNE_RUNS_EVERY, len(members) // PRUNE_MEMBERS_PER_SEQ)
            if new_low >= self._pruned_to.get(group, 0) + every:
                self._prune_runs(group, new_low)
        self.passed_low[group] = new_low

    def _prune_runs(self, group: str, low: int) -> None:
        """Let go of runs every member has passed, but for the last ``ARRIVALS_KEPT`` seqs (whose
        arrivals may not be counted yet; slots are kept so too). Done every ``PRUNE_RUNS_EVERY``
        seqs, not at each. The runs go in the order they were kept, up to the first that stays:
        a rank's runs are kept in their order, and one kept late waits for those before it."""
        self._pruned_to[group] = low
        tail = low - ARRIVALS_KEPT
        if self.device_calls:  # a slot made where a device stopped takes its calls from them
            for st in self.ranks.values():
                held = st.on_device.get(group) if st.on_device else None
                if held and held[0].first_seq < tail:
                    tail = held[0].first_seq
        order = self.kept_order.get(group)
        byrank = self.passed.get(group, {})
        while order and order[0][0] < tail:
            runs = byrank.get(order.popleft()[1])
            while runs and runs[0].last_seq < tail:
                self._drop_run(runs.popleft())
        refs = self.run_refs.get(group)
        while refs and refs[0].hi < tail:
            refs.popleft()
