"""The shift explanation: one rank made one extra collective and everything after it is
shifted, so every later slot of that group disagrees. :func:`explain_extra_call` says so
instead of leaving a person with a mismatch at each seq.

Calls are compared by a fingerprint built from their catalogue row's ``Agree`` (the values
the rules compare; an unrecorded value matches anything).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from hangwatch.catalogue import canonical_op, norm_reduce
from hangwatch.coordinator.rules.slot import spec
from hangwatch.records import CallRecord, TensorMeta
from hangwatch.wording import in_step


def _fingerprint(c: CallRecord) -> tuple[Hashable, ...]:
    """What must agree between ranks' calls at the same slot (None: unknown, matches anything)."""
    canon = canonical_op(c.op)
    sp = spec(canon)
    parts: list[Hashable] = [canon]
    parts.append(c.root if sp.root else None)
    parts.append(norm_reduce(c.reduce_op) if sp.reduce and c.reduce_op else None)
    for field in sp.full:
        metas: tuple[TensorMeta, ...] = getattr(c, field)
        parts.append(tuple((m.shape, m.dtype) for m in metas) or None)
    for field in sp.dtypes:
        metas = getattr(c, field)
        parts.append(tuple(dict.fromkeys(m.dtype for m in metas)) or None)
    for field in sp.lengths:
        metas = getattr(c, field)
        parts.append(len(metas) or None)
    return tuple(parts)


def _alike(a: CallRecord, b: CallRecord) -> bool:
    fa, fb = _fingerprint(a), _fingerprint(b)
    return len(fa) == len(fb) and all(x is None or y is None or x == y for x, y in zip(fa, fb, strict=True))


def _extra_at(mine: Sequence[CallRecord], others: Mapping[int, list[CallRecord]], seq: int) -> int | None:
    """The seq of ``mine``'s extra call, if inserting one call at (or shortly before) ``seq``
    explains how ``mine`` differs from ``others`` (which must agree among themselves)."""
    by_seq = {c.seq: c for c in mine}
    for slot in others.values():
        if not all(_alike(slot[0], o) for o in slot[1:]):
            return None
    ref_seqs = sorted(others)
    for i in sorted((s for s in by_seq if s <= seq), reverse=True):
        if i not in others:
            continue
        before = all(_alike(by_seq[s], others[s][0]) for s in by_seq if s < i and s in others)
        if not before:
            continue
        after_mine = [c for c in mine if c.seq > i]
        after_ref = [others[s][0] for s in ref_seqs if s >= i]
        compared = list(zip(after_mine, after_ref, strict=False))
        if not compared or not all(_alike(x, r) for x, r in compared):
            continue
        if all(_alike(by_seq[s], others[s][0]) for s in by_seq if s >= i and s in others):
            continue  # nothing the shift needs to explain
        return i
    return None


MAX_BEHAVIOURS = 16  # distinct rank histories explain_extra_call compares
EXTRA_CALL_WINDOW = (16, 4)  # the calls it looks at: this many seqs before and after the slot


def explain_extra_call(history: Mapping[int, Sequence[CallRecord]], seq: int) -> str | None:
    """``"rank 1 made an extra all_reduce at train.py:30 (seq 12); every later call on rank 1 is
    shifted by one"`` when one rank's calls in a group (``history``: rank -> its recent calls,
    ordered by seq) equal the others' with one call inserted at ``seq`` (or, where the calls
    look alike, shortly before it). Needs at least one later call on that rank to confirm the
    shift; None when no single rank is explained that way."""
    window = range(seq - EXTRA_CALL_WINDOW[0], seq + EXTRA_CALL_WINDOW[1] + 1)
    ordered = {r: sorted((c for c in calls if c.seq in window), key=lambda c: c.seq) for r, calls in history.items()}
    ordered = {r: calls for r, calls in ordered.items() if calls}
    if len(ordered) < 2:
        return None
    # Ranks with the same calls behave alike: compare one of each kind (a job of thousands of
    # ranks has two kinds here, the culprit's and everyone else's), counting how many share it.
    kinds: dict[tuple[Hashable, ...], list[int]] = {}
    for rank, calls in ordered.items():
        kinds.setdefault(tuple((c.seq, _fingerprint(c)) for c in calls), []).append(rank)
    if len(kinds) > MAX_BEHAVIOURS:
        return None  # too many different histories for one rank's extra call to explain them
    reps = {ranks[0]: len(ranks) for ranks in kinds.values()}
    found: list[tuple[int, CallRecord]] = []
    for rank, count in reps.items():
        mine = ordered[rank]
        others: dict[int, list[CallRecord]] = {}
        for other in sorted(reps):
            if other != rank or count > 1:  # ranks that share this history are "others" too
                for c in ordered[other]:
                    others.setdefault(c.seq, []).append(c)
        at = _extra_at(mine, others, seq)
        if at is not None:
            found.extend([(rank, next(c for c in mine if c.seq == at))] * count)
    if len(found) != 1:
        return None
    rank, extra = found[0]
    where = f" at {extra.call_site}" if extra.call_site else ""
    text = (
        f"rank {rank} made an extra {canonical_op(extra.op)}{where} (seq {extra.seq}); "
        f"every later call on rank {rank} is shifted by one"
    )
    if len(ordered) == 2:
        other = next(r for r in ordered if r != rank)
        text += f" (with two ranks this is the same as rank {other} skipping it)"
    return text


def _same_call(a: CallRecord, b: CallRecord) -> bool:
    """The same call of the program: same call site, calls alike. (Not the step: a rank that
    skips a call on its own usually skips its optimizer step too, so its steps fall behind.)"""
    return a.call_site == b.call_site and _alike(a, b)


def explain_skipped_call(
    history: Mapping[int, Sequence[CallRecord]], culprit: int, waiting: Sequence[int]
) -> tuple[str, CallRecord] | None:
    """The mirror of :func:`explain_extra_call`: ``culprit`` skipped one call the others made (a
    NaN-loss ``continue`` before ``backward``, a conditional collective) and carried on, so from
    there on each of its calls met the others' *next* call. The calls look alike, so nothing
    mismatched; what tells is the call site each call was made at. Returns the story and the
    call skipped (the waiting ranks' record of it), or None: when the ranks never diverged in the
    calls kept, when call sites cannot tell the calls apart (one collective in the loop: a skip
    looks exactly like stopping one call early), or when the waiting ranks disagree among
    themselves."""
    mine = {c.seq: c for c in history.get(culprit, ())}
    if not mine or not waiting:
        return None
    ref: dict[int, CallRecord] = {}
    for rank in waiting:
        for c in history.get(rank, ()):
            other = ref.setdefault(c.seq, c)
            if not _same_call(other, c):
                return None  # the waiting ranks differ among themselves: not this story
    common = sorted(s for s in mine if s in ref)
    if len(common) < 2:
        return None
    for k in common:
        before = [s for s in common if s < k]
        if not all(_same_call(mine[s], ref[s]) for s in before):
            return None  # diverged earlier in a way a single skip does not explain
        if _same_call(mine[k], ref[k]):
            continue
        after = [s for s in mine if s >= k and s + 1 in ref]
        if not after or not all(_same_call(mine[s], ref[s + 1]) for s in after):
            return None
        if all(_same_call(ref[s], ref[s + 1]) for s in after):
            return None  # every call looks the same (one site, no steps): a shift cannot be seen
        skipped = ref[k]
        where = f" at {skipped.call_site}" if skipped.call_site else ""
        text = (
            f"rank {culprit} skipped {canonical_op(skipped.op)}{where}{in_step(skipped.step)} (seq {k}) and "
            f"carried on: from there on each of its calls met the others' next call, so it ran out of calls "
            f"one before them"
        )
        return text, skipped
    return None


Forward = tuple[int, str, int, int]  # (the rank's count of DDP forwards, group, seq at it, step)


def explain_skipped_backward(
    forwards: Mapping[int, Sequence[Forward]], culprit: int, waiting: Sequence[int], group: str
) -> tuple[str, dict[str, int]] | None:
    """A DDP rank that ran a forward pass without its backward (a NaN loss skipped, a batch it
    alone found empty) and carried on: its forward passes keep pace with the others' (the n-th
    forward of every rank), but from the one after the skip on, torch's sequence number on the
    DDP group at each forward is behind the others' by the all-reduces of one backward. With one
    all-reduce per step, its calls look exactly like the others' cut short; the forwards tell.

    ``forwards``: rank -> its recorded DDP forwards (``RankState.forwards``). Returns the story
    and ``{"forward": n, "step": s, "behind": d}`` (the forward without a backward, its step, the
    all-reduces it is behind), or None: no forwards on ``group``, the waiting ranks disagree, the
    culprit ran fewer forwards than the others (it left the loop), or the gap is not one constant
    gap opening at one forward."""
    mine = {n: (seq, step) for n, g, seq, step in forwards.get(culprit, ()) if g == group}
    if not mine or not waiting:
        return None
    ref: dict[int, int] = {}
    ref_last = 0
    for rank in waiting:
        theirs = [(n, seq) for n, g, seq, _ in forwards.get(rank, ()) if g == group]
        if not theirs:
            return None
        ref_last = max(ref_last, max(n for n, _ in theirs))
        for n, seq in theirs:
            if ref.setdefault(n, seq) != seq:
                return None  # the waiting ranks differ among themselves
    if max(mine) < ref_last:
        return None  # fewer forward passes than the others: it stopped iterating (an early exit)
    common = sorted(n for n in mine if n in ref)
    gaps = [(n, ref[n] - mine[n][0]) for n in common]
    opened = [i for i, (_, gap) in enumerate(gaps) if gap != 0]
    if not opened or opened[0] == 0:
        return None  # never diverged in the forwards kept, or diverged before them
    first = opened[0]
    behind = gaps[first][1]
    if behind <= 0 or any(gap != behind for _, gap in gaps[first:]):
        return None
    skipped = gaps[first - 1][0]  # the last forward at which it was level: no backward followed
    step = mine[skipped][1]
    calls = "all-reduce" if behind == 1 else f"{behind} all-reduces"
    text = (
        f"rank {culprit} ran forward pass {skipped} (step {step}) without its backward and carried on: "
        f"it never made that step's gradient {calls}, so from there on each of its all-reduces met the "
        f"others' next one and it ran out of them {behind} before the others"
    )
    return text, {"forward": skipped, "step": step, "behind": behind}
