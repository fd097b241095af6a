"""What every rule works with: the :class:`Mismatch` they return, each op's :class:`Spec`
(the catalogue's :class:`~hangwatch.catalogue.Agree` plus its single-call check), and
:class:`SlotCalls`, the calls of one (group, seq) slot with the helpers that compare one value
across ranks and word the result.

Culprits: the ranks are grouped by the value a rule looks at; the largest group is the
reference and every other rank is a culprit. Ties (e.g. two ranks) go, for rooted ops, to the
side that contains the root (when comparing roots: the side whose claimed root is one of its
own ranks) and otherwise to the side holding the lowest rank. Ranks whose record lacks the
value (no tensors recorded, no root, ...) are left out of that rule rather than guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hangwatch import catalogue
from hangwatch.catalogue import GROUP_RANKS, canonical_op, parse_ints
from hangwatch.diagnosis.incidents import IncidentKind
from hangwatch.diagnosis.rules.checks import CHECKS, Intrinsic
from hangwatch.records import CallRecord, TensorMeta
from hangwatch.wording import conj, describe_call, listing, more
from hangwatch.wording import mismatches as words

OP_MISMATCH = IncidentKind.OP_MISMATCH
SHAPE_MISMATCH = IncidentKind.SHAPE_MISMATCH
DTYPE_MISMATCH = IncidentKind.DTYPE_MISMATCH
ARG_MISMATCH = IncidentKind.ARG_MISMATCH
P2P_MISMATCH = IncidentKind.P2P_MISMATCH


@dataclass(frozen=True)
class Mismatch:
    """A disagreement between ranks, worded for a person."""

    kind: IncidentKind  # one of the five *_mismatch kinds
    culprit_ranks: tuple[int, ...]  # the ranks that disagree with the rest
    agreeing_ranks: tuple[int, ...]
    summary: str  # one line
    details: dict[int, str]  # rank -> how that rank called it (describe_call)
    hint: str  # what to do


@dataclass(frozen=True)
class Spec:
    """An op's :class:`~hangwatch.catalogue.Agree` with its check resolved."""

    agree: catalogue.Agree
    intrinsic: Intrinsic | None = None

    @property
    def root(self) -> str | None:
        return self.agree.root

    @property
    def reduce(self) -> bool:
        return self.agree.reduce

    @property
    def full(self) -> tuple[str, ...]:
        return self.agree.full

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self.agree.dtypes

    @property
    def lengths(self) -> tuple[str, ...]:
        return self.agree.lengths

    @property
    def pairwise(self) -> str | None:
        return self.agree.pairwise

    @property
    def note(self) -> str:
        return self.agree.note


#: canonical op -> its spec, for every catalogue row ranks are compared on (not p2p, markers).
SPECS: dict[str, Spec] = {
    op.name: Spec(op.agree, CHECKS[op.check] if op.check else None) for op in catalogue.OPS if op.agree is not None
}

#: Unknown collectives: compare what is recorded about arguments, never tensors.
UNKNOWN = Spec(catalogue.UNKNOWN)


def spec(canon: str) -> Spec:
    return SPECS.get(canon, UNKNOWN)


def reference(sigs: Mapping[int, Hashable], prefer: Callable[[Hashable, list[int]], bool] | None) -> set[int]:
    """The ranks of the largest agreeing group (ties: ``prefer``red side, then lowest rank)."""
    groups: dict[Hashable, list[int]] = {}
    for rank in sorted(sigs):
        groups.setdefault(sigs[rank], []).append(rank)

    def key(item: tuple[Hashable, list[int]]) -> tuple[int, int, int]:
        sig, ranks = item
        preferred = prefer is not None and prefer(sig, ranks)
        return (-len(ranks), 0 if preferred else 1, ranks[0])

    return set(min(groups.items(), key=key)[1])


def group_ranks(c: CallRecord) -> tuple[int, ...] | None:
    return parse_ints(c.extra.get(GROUP_RANKS))


def field_label(field: str) -> str:
    return "output " if field == "outputs" else ""


class SlotCalls:
    """The calls of one (group, seq) slot and the helpers every rule uses."""

    def __init__(self, calls: Mapping[int, CallRecord], group_size: int | None) -> None:
        self.calls = dict(sorted(calls.items()))
        first = next(iter(self.calls.values()))
        self.group = first.group
        self.seq = min(c.seq for c in self.calls.values())
        self.op = canonical_op(first.op)
        self.spec = spec(self.op)
        if group_size is None:
            sizes = {len(g) for c in self.calls.values() if (g := group_ranks(c)) is not None}
            group_size = sizes.pop() if len(sizes) == 1 else None
        self.gs = group_size
        roots = {c.root for c in self.calls.values() if c.root is not None}
        self.root = roots.pop() if len(roots) == 1 else None

    def present(self, field: str) -> dict[int, tuple[TensorMeta, ...]]:
        """Each rank's tensors in ``field``, leaving out ranks that recorded none."""
        out: dict[int, tuple[TensorMeta, ...]] = {}
        for r, c in self.calls.items():
            metas: tuple[TensorMeta, ...] = getattr(c, field)
            if metas:
                out[r] = metas
        return out

    def where(self, ranks: Sequence[int]) -> str:
        """``"the code at train.py:42 on rank 1"`` (grouped by call site)."""
        sites: dict[str, list[int]] = {}
        for rank in ranks:
            sites.setdefault(self.calls[rank].call_site, []).append(rank)
        return words.by_site(sites)

    def sites(self, ranks: Sequence[int]) -> str:
        """``" at train.py:42"`` (the distinct call sites of ``ranks``), or ``""``."""
        found = list(dict.fromkeys(self.calls[r].call_site for r in ranks if self.calls[r].call_site))
        if not found:
            return ""
        return " at " + ", ".join(found[:3]) + more(len(found), 3)

    def which(self, ranks: Sequence[int], verb: str) -> str:
        """``"check the code at x.py:3 on rank 1, which builds"``: ``verb`` (base form) agrees."""
        return f"check {self.where(ranks)}, which {conj(verb, ranks)}"

    def mismatch(self, kind: IncidentKind, culprits: Iterable[int], summary: str, hint: str) -> Mismatch:
        bad = tuple(sorted(set(culprits)))
        return Mismatch(
            kind=kind,
            culprit_ranks=bad,
            agreeing_ranks=tuple(r for r in self.calls if r not in bad),
            summary=summary,
            details={r: describe_call(c) for r, c in self.calls.items()},
            hint=hint,
        )

    def head(self, what: str, op: str | None = None) -> str:
        return f"{op or self.op} {what} in group {self.group} seq {self.seq}"

    def cross(
        self,
        sigs: Mapping[int, Hashable],
        kind: IncidentKind,
        what: str,
        show: Callable[[int], str],
        hint: Callable[[list[int], list[int]], str],
        prefer: Callable[[Hashable, list[int]], bool] | None = None,
    ) -> Mismatch | None:
        """Compare one value across the ranks that have it; the minority are the culprits."""
        if len(set(sigs.values())) < 2:
            return None
        if prefer is None and self.spec.root is not None and self.root is not None:
            root = self.root

            def prefer(_sig: Hashable, ranks: list[int]) -> bool:
                return root in ranks

        ref = reference(sigs, prefer)
        culprits = [r for r in sigs if r not in ref]
        summary = f"{self.head(what)}: {listing({r: show(r) for r in sigs})}"
        return self.mismatch(kind, culprits, summary, hint(sorted(ref), culprits))
