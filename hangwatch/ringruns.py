"""Calls alike, gathered from a batch's slots: runs of one signature, and cycles of a few (A B A
B...: a layer's two collectives from two lines). A training loop's steady state is mostly such
stretches; each travels as one ``CallColumns`` run. ``hangwatch.ringwire`` encodes them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hangwatch.columns import MAX_CYCLE
from hangwatch.ring import Kind, RingSlot

_MASK32 = (1 << 32) - 1

#: The fewest calls that travel as a run (``RingEncoder.decode``); fewer travel one by one.
RUN_MIN = 2
#: The fewest periods a cycle of signatures repeats to travel as a run (``RingEncoder._cycled``).
CYCLE_MIN = 2


class Run:
    """Calls alike, gathered from a batch's slots (``RingEncoder._gather``): each an ENTER slot
    and its EXIT right after it, of one signature blob, call ids and seqs one apart, one step,
    returned without error having issued one collective. Values as the slots hold them (modulo
    2**32); the times of each call."""

    __slots__ = ("call_id", "enters", "exits", "ref", "refs", "seq", "step")

    def __init__(self, enter: RingSlot, exit_: RingSlot) -> None:
        self.ref, self.call_id, self.seq, self.step = enter.ref, enter.call_id, enter.seq, enter.step
        self.enters = [enter.time]
        self.exits = [exit_.time]
        #: a cycle's signature blobs, one per call of a period (``_cycled``); empty: ``ref``'s alone
        self.refs: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, enter: RingSlot, exit_: RingSlot, enters: list[float], exits: list[float], refs: tuple[int, ...] = ()
    ) -> Run:
        """The run the C gatherer found (or a cycle, ``refs``, that the C ``cycles`` did): its
        first call's slots and every call's times."""
        run = cls.__new__(cls)
        run.ref, run.call_id, run.seq, run.step = enter.ref, enter.call_id, enter.seq, enter.step
        run.enters, run.exits = enters, exits
        run.refs = refs
        return run

    @classmethod
    def cycle(cls, pairs: Sequence[RingSlot], refs: tuple[int, ...]) -> Run:
        """The calls of ``pairs`` (an ENTER and its EXIT, call after call), a cycle of ``refs``."""
        run = cls(pairs[0], pairs[1])
        run.enters = [s.time for s in pairs[0::2]]
        run.exits = [s.time for s in pairs[1::2]]
        run.refs = refs
        return run

    def ref_at(self, i: int) -> int:
        """The signature blob of the ``i``-th call."""
        return self.refs[i % len(self.refs)] if self.refs else self.ref

    def follows(self, enter: RingSlot) -> bool:
        """Whether ``enter`` is the next call of this run."""
        k = len(self.enters)
        return (
            enter.ref == self.ref
            and enter.call_id == (self.call_id + k) & _MASK32
            and enter.seq == (self.seq + k) & _MASK32
            and enter.step == self.step
        )

    def slots(self) -> list[RingSlot]:
        """The slots it was gathered from (their stamps aside): where it travels call by call."""
        out = []
        for i, (enter, exit_) in enumerate(zip(self.enters, self.exits, strict=True)):
            cid = (self.call_id + i) & _MASK32
            ref = self.ref_at(i)
            out.append(RingSlot(0, Kind.ENTER, 0, 0, ref, cid, (self.seq + i) & _MASK32, self.step, 0, enter, 0))
            out.append(RingSlot(0, Kind.EXIT, 0, 1, 0, cid, 0, 0, 0, exit_, 0))
        return out


def settled(s: RingSlot, after: RingSlot | None) -> bool:
    """Whether slot ``s`` (and ``after``, the slot that follows it) tells a detector nothing it
    waits for: a synchronous call that returned without error right after, an exit without an
    error, a step."""
    if s.kind == Kind.ENTER:
        return (
            not s.flags & 1
            and after is not None
            and after.kind == Kind.EXIT
            and after.call_id == s.call_id
            and not after.ref
        )
    if s.kind == Kind.EXIT:
        return not s.ref
    return s.kind == Kind.STEP


def cycled(
    items: Sequence[RingSlot | Run], shown: set[int], ok: dict[int, bool], lanes: dict[int, Any]
) -> list[RingSlot | Run]:
    """``items`` with each stretch of calls that repeat a cycle of two to ``MAX_CYCLE``
    signatures of one group at least ``CYCLE_MIN`` times over (A B A B...: a layer's two
    collectives from two lines) in place of their slots, as one ``Run`` whose ``refs`` are
    the cycle's. Each call is one the gatherer could have put in a run (an ENTER and its
    EXIT right after it, of a signature that may travel as runs and was shown alone, not
    async, returned without error having issued one collective), ids and seqs one apart,
    one step; the gatherer left them as slots, no two alike calls being next to each other.
    As for a run, a signature's first call travels alone: ``shown`` holds those shown
    before this batch, and those shown alone earlier in it join them here."""
    out: list[RingSlot | Run] = []
    n = len(items)
    i = 0
    while i < n:
        # the stretch of calls fit for a cycle from ``i``: their slots, two by two
        j = i
        while j + 1 < n:
            s, x = items[j], items[j + 1]
            if (
                isinstance(s, Run)
                or isinstance(x, Run)
                or s.kind != Kind.ENTER
                or s.flags & 1
                or s.ref not in shown
                or not ok.get(s.ref)
                or x.kind != Kind.EXIT
                or x.call_id != s.call_id
                or x.ref
                or x.aux > 1
            ):
                break
            if j > i:
                before = items[j - 2]
                assert not isinstance(before, Run)
                if (
                    s.call_id != (before.call_id + 1) & _MASK32
                    or s.seq != (before.seq + 1) & _MASK32
                    or s.step != before.step
                    or lanes.get(s.ref) != lanes.get(before.ref)
                ):
                    break
            j += 2
        if j - i < 4 * CYCLE_MIN:  # not two calls a period, twice over
            item = items[i]
            if not isinstance(item, Run) and item.kind == Kind.ENTER:
                shown.add(item.ref)  # (whether or not it may join runs: only those do)
            out.append(item)
            i += 1
            continue
        out.extend(cycles_in(items[i:j]))
        i = j
    return out


def cycles_in(pairs: Sequence[RingSlot | Run]) -> list[RingSlot | Run]:
    """``pairs`` (calls fit for a cycle, two slots each) with their cycles gathered."""
    refs = [s.ref for s in pairs[0::2]]
    m = len(refs)
    out: list[RingSlot | Run] = []
    i = 0
    while i < m:
        best_p = best_len = 0
        for p in range(2, MAX_CYCLE + 1):
            if i + CYCLE_MIN * p > m:
                break
            length = p
            while i + length < m and refs[i + length] == refs[i + length - p]:
                length += 1
            if length >= CYCLE_MIN * p and length > best_len and len(set(refs[i : i + p])) > 1:
                best_p, best_len = p, length
        if not best_p:
            out.extend(pairs[2 * i : 2 * i + 2])
            i += 1
            continue
        out.append(Run.cycle(pairs[2 * i : 2 * (i + best_len)], tuple(refs[i : i + best_p])))  # type: ignore[arg-type]
        i += best_len
    return out


def gather(
    slots: list[RingSlot], ok: dict[int, bool], whole: set[int], known: Callable[[int], None]
) -> tuple[list[RingSlot | Run], bool]:
    """``RingEncoder._gather`` in Python (the reference, and where the C build is not installed),
    and whether the batch was steady: every slot a settled call or a step, no signature new.
    ``known(ref)`` reads a signature's blob and says in ``ok`` whether its calls may join runs;
    ``whole`` holds the signatures shown alone already."""
    out: list[RingSlot | Run] = []
    run: Run | None = None
    i, n = 0, len(slots)
    steady = n > 0
    while i < n:
        s = slots[i]
        if s.kind == Kind.ENTER and i + 1 < n and not s.flags & 1 and s.ref not in whole:
            steady = False  # a signature not shown before
            known(s.ref)  # its signature read now: may its calls travel as runs?
            if ok.get(s.ref):
                whole.add(s.ref)  # this call travels alone, and the next may join a run
            if run is not None:
                out.extend((run,) if len(run.enters) >= RUN_MIN else run.slots())
                run = None
            out.append(s)
            i += 1
            continue
        if s.kind == Kind.ENTER and i + 1 < n and not s.flags & 1 and ok.get(s.ref):
            x = slots[i + 1]
            if x.kind == Kind.EXIT and x.call_id == s.call_id and not x.ref and x.aux <= 1:
                if run is not None and run.follows(s):
                    run.enters.append(s.time)
                    run.exits.append(x.time)
                else:
                    if run is not None:
                        out.extend((run,) if len(run.enters) >= RUN_MIN else run.slots())
                    run = Run(s, x)
                i += 2
                continue
        if run is not None:
            out.extend((run,) if len(run.enters) >= RUN_MIN else run.slots())
            run = None
        if steady and not settled(s, slots[i + 1] if i + 1 < n else None):
            steady = False
        out.append(s)
        i += 1
    if run is not None:
        out.extend((run,) if len(run.enters) >= RUN_MIN else run.slots())
    return out, steady
