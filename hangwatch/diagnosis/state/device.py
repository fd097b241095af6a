"""Where NCCL collectives stand on the device: progress reads, and runs held there (``OnDevice``).

On NCCL a collective's host call returns at its enqueue: it stays open until a progress
read shows it completed. A run's calls its device had not completed are noted and completed
by later reads; one is made an open call only where the device stops at it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.state.base import (
    DURATIONS_KEPT,
    MAX_GROUPS,
    MAX_OPEN_CALLS,
    _Base,
    _completed_in,
    _run_waits,
)
from hangwatch.diagnosis.state.ranks import (
    PROGRESS_FRESH_S,
    OnDevice,
    RankState,
)


class Device(_Base):
    """Where NCCL collectives stand on the device: progress reads, and runs held there (``OnDevice``)."""

    def awaits_completion(
        self, state: RankState, call: r.CallRecord, seq_count: int, returned: float, now: float
    ) -> bool:
        """Whether a collective ``call`` the host returned from is still under way on the device:
        its group's progress is watched (fresh) and has not completed its last seq. A progress
        read after the return that shows everything enqueued completed settles it whatever the
        numbering (so a seq that torch counts differently never holds a call open)."""
        progress = state.progress.get(call.group)
        if progress is None or call.kind is not r.OpKind.COLLECTIVE or call.source != "python" or call.async_op:
            # records made from Flight Recorder entries carry their own completion, and an async
            # call's exit is its work's completion (the hook polls it), not its return
            return False
        if now - state.progress_seen > PROGRESS_FRESH_S:
            return False
        if call.seq + max(1, seq_count) - 1 <= progress.completed:
            return False
        return not (progress.enqueued == progress.completed and progress.time >= returned)

    def _progress(self, state: RankState, event: r.GroupProgress, now: float) -> None:
        group = event.group
        if group not in state.progress:
            if len(state.progress) >= MAX_GROUPS:
                self.dropped_calls += 1
                return
            if not self._room(state, b.PROGRESS_BYTES + b.text_bytes(group)):
                return
            self._charge(state, b.PROGRESS_BYTES + b.text_bytes(group))
        local = r.GroupProgress(  # its times on the coordinator's clock
            event.rank,
            group,
            event.enqueued,
            event.started,
            event.completed,
            state.to_local(event.time),
            state.to_local(event.completed_time) if event.completed_time else 0.0,
            event.timeout_ms,
            state.to_local(event.started_time) if event.started_time else 0.0,
        )
        prior = state.progress.get(group)
        state.progress[group] = local
        state.progress_seen = now
        open_here = state.open_collectives.get(group)
        closed: set[int] = set()
        for call in list(open_here.values()) if open_here else ():
            returned = call.returned_time
            if returned is None:
                continue  # the host thread is still inside it
            last = call.seq + max(1, call.seq_count) - 1
            settled = local.enqueued == local.completed and local.time >= returned
            if last > local.completed and not settled:
                continue
            when = local.completed_time if local.completed_time and last == local.completed else local.time
            self._close(state, call, max(returned, min(when, local.time)), None)
            closed.add(call.call_id)
            state.last_progress = now
            self.changed_slots.add((group, call.seq))
        if state.on_device.get(group):
            self._settle_device(state, group, prior, local, closed)

    def before_detection(self, now: float, stuck_after: Callable[[], float]) -> None:
        """What the detectors need of the state before they read it (they never write it), done
        by the state once a tick: device progress that stopped coming let go
        (``lapse_progress``), and the calls a device holds below each group's first open slot,
        entered the stuck threshold ago, made open calls (``open_on_device_below``)."""
        self.lapse_progress(now)
        if not any(st.on_device for st in self.ranks.values()):
            return
        firsts: list[tuple[str, int]] = []
        for group, slots in self.slots.items():
            for seq, slot in slots.items():
                if slot.open and any(c.exit_time is None for c in slot.calls.values()):
                    firsts.append((group, seq))
                    break
        if firsts:
            self.open_on_device_below(firsts, lambda: now - stuck_after())

    def lapse_progress(self, now: float) -> None:
        """Ranks whose device progress stopped coming (their agent is gone, their worker server no
        longer answers): completion is no longer watched, so the calls it held open are taken
        as complete when their host thread returned (the engine calls this every tick)."""
        for state in self.ranks.values():
            if not state.progress or now - state.progress_seen <= PROGRESS_FRESH_S:
                continue
            self._charge(state, -sum(b.PROGRESS_BYTES + b.text_bytes(g) for g in state.progress))
            state.progress.clear()
            self._let_go_on_device(state)
            for call in list(state.open_calls.values()):
                if call.returned_time is not None:
                    self._close(state, call, call.returned_time, None)

    def _device_from(self, state: RankState, run: r.CallRun, now: float) -> int:
        """The first call of ``run`` that ``awaits_completion`` would hold open (its group's
        progress watched and fresh, its seq not completed, not settled by a read that found
        everything enqueued completed after it returned); ``len(run)`` for none. Those before
        it are a prefix: seqs and returns both grow along a run."""
        n = len(run.enters)
        t = run.template
        progress = state.progress.get(t.group)
        if progress is None or t.source != "python" or now - state.progress_seen > PROGRESS_FRESH_S:
            return n  # not watched: each call is complete when its host returned (records of
            # Flight Recorder's carry their own completion, and never come as runs)
        return max(0, _completed_in(run, progress, state.clock_offset))

    def _settle_device(
        self,
        state: RankState,
        group: str,
        prior: r.GroupProgress | None,
        progress: r.GroupProgress,
        closed: set[int],
    ) -> None:
        """A progress read of ``group`` (``prior``: the read before): the calls of runs on the
        device it completes are done, their waits kept as ``_close`` keeps an open call's (but
        those open calls it closed, ``closed``: a slot took them from the run). Where the device
        has not moved since ``prior``, which had the first call still on it enqueued and came
        after it returned, the device is stopped at that call: it is made an open call, with its
        slot, as it would have been without runs (``_open_on_device``), for the detectors. (A
        read that had not enqueued it is another numbering's: the group made anew, whose reads
        may come before the rank's first call of it.)"""
        pending = state.on_device[group]
        while pending:
            entry = pending[0]
            run = entry.run
            n = len(run.enters)
            k = _completed_in(run, progress, run.offset)
            if k > entry.start:
                self._device_waits(run, entry.start, k, progress, closed)
                entry.start = k
                state.last_progress = state.progress_seen  # (as a call closed by progress)
            if k < n:
                break
            pending.popleft()
            self._charge(state, -entry.cost)
        if pending and prior is not None and prior.completed == progress.completed:
            entry = pending[0]
            run = entry.run
            i = entry.start
            if run.first_seq + i <= prior.enqueued and run.exits[i] + run.offset <= prior.time:
                self._open_first(state, group, pending)
        if not pending:
            state.on_device.pop(group, None)

    def _open_first(self, state: RankState, group: str, pending: collections.deque[OnDevice]) -> bool:
        """The first call ``state``'s device holds on ``group`` (``pending[0]``), made an open
        call (``_open_on_device``); whether it is one now."""
        entry = pending[0]
        if not self._open_on_device(state, entry.run, entry.start):
            return False
        entry.start += 1
        if entry.start == len(entry.run.enters):
            pending.popleft()
            self._charge(state, -entry.cost)
            if not pending:
                del state.on_device[group]
        return True

    def open_on_device_below(self, firsts: Sequence[tuple[str, int]], due: Callable[[], float]) -> bool:
        """Make open calls of the first call each rank's device holds below each group's first
        open slot (``firsts``: (group, seq)), where it was entered by ``due()``; return whether
        any was made.

        Call by call, that call would be open already. Without this, the stuck detector judges
        the slot above it (a call sent alone: another shape, one past ``ON_DEVICE_RUNS``) and
        tells the hang at a later seq, or a false one where a host came late to that call.
        ``due`` is asked only where a held call exists: the adaptive threshold costs."""
        opened = False
        limit: float | None = None
        for group, seq in firsts:
            for st in self.ranks.values():
                pending = st.on_device.get(group) if st.on_device else None
                if not pending or pending[0].first_seq >= seq:
                    continue
                entry = pending[0]
                if limit is None:
                    limit = due()
                if entry.run.enters[entry.start] + entry.run.offset <= limit and self._open_first(st, group, pending):
                    opened = True
        return opened

    def _device_waits(self, run: r.CallRun, lo: int, hi: int, progress: r.GroupProgress, closed: set[int]) -> None:
        """The waits of ``run``'s calls ``lo`` to ``hi - 1`` that ``progress`` completed (but
        ``closed``'s, kept as they closed): from enter to completion (torch's watchdog's time for
        the last it completed, else the read's)."""
        lo = max(lo, hi - DURATIONS_KEPT)
        off, read = run.offset, progress.time
        # as ``_close`` takes each: done at the read, or at its return where that came later
        enters, exits = run.enters, run.exits
        waits = _run_waits(enters, exits, lo, hi, read - off)
        i = progress.completed - run.first_seq
        if progress.completed_time and lo <= i < hi:  # torch's watchdog's time for the last it completed
            waits[i - lo] = max(0.0, max(exits[i] + off, min(progress.completed_time, read)) - (enters[i] + off))
        if closed:
            first = run.first_call_id
            waits = [w for k, w in enumerate(waits, lo) if first + k not in closed]
        self.wait_durations.extend(waits)

    def _open_on_device(self, state: RankState, run: r.CallRun, i: int) -> bool:
        """``run``'s ``i``-th call as the open call it would be without runs: its host returned,
        its device has not completed it; in the rank's open calls and in its slot. Whether it
        is one now (not: the rank's open calls are full, or a memory budget; tried again at the
        next read)."""
        group = run.template.group
        call_id = run.first_call_id + i
        if call_id in state.open_calls:
            return True  # open already: a slot took it from the run
        if len(state.open_calls) >= MAX_OPEN_CALLS or not self._current(state.rank, group):
            return False
        call = run.call(i, run.offset)
        call.returned_time, call.exit_time = call.exit_time, None
        cost = call.cost = call.cost or b.call_bytes(call)
        if not self._room(state, cost + b.OPEN_BYTES + b.SLOT_ENTRY_BYTES + b.SLOT_BYTES):
            return False  # over a memory budget (counted)
        call.holds = 0
        state.calls += cost
        self.held += cost
        self.ledger.held += cost
        self.device_opened += 1
        self._track_open(state, call)
        slots = self.slots.get(group)
        if slots is None:
            slots = self.slots[group] = collections.OrderedDict()
        seq = call.seq
        slot = slots.get(seq)
        if slot is not None and slot.numbering != self.epoch.get(group, 0):
            del slots[seq]  # the numbering before's (this rank's is the newest): made again
            self._free_slot(slot)
            slot = None
        if slot is None:  # (below slots of its later calls, sent alone: in its place all the same)
            slot = self._new_slot(group, seq, slots, call.enter_time, state.rank, in_place=True)
        else:
            slot.first_enter = min(slot.first_enter, call.enter_time)
            slot.last_enter = max(slot.last_enter, call.enter_time)
        self._into_slot(state, slot, call)
        return True

    @staticmethod
    def _on_device_at(state: RankState, group: str, seq: int) -> bool:
        """Whether ``state``'s call at (``group``, ``seq``) is a run's its device has not been
        seen to complete."""
        return any(e.first_seq <= seq <= e.run.last_seq for e in state.on_device.get(group, ()))

    def _let_go_on_device(self, state: RankState, group: str | None = None) -> None:
        """Forget ``state``'s runs on the device (of ``group``; None: every group): its progress
        stopped coming, so they are complete as their host returned, or they are of a numbering
        its group was made anew after."""
        for g in [group] if group is not None else list(state.on_device):
            for entry in state.on_device.pop(g, ()):
                self._charge(state, -entry.cost)
