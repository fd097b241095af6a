"""All-to-all pairing (rule 7 of :mod:`~hangwatch.diagnosis.rules.collective`): rank i's
output chunk j must match rank j's input chunk i.

``all_to_all`` inputs legitimately differ across ranks, so they are checked pairwise rather
than compared whole. ``all_to_all_single`` chunks come from split sizes (or an even split of
dim 0); ``all_to_all`` chunks are the list's tensors. A pair that disagrees names both ranks;
the culprits are the ranks in the most disagreeing pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hangwatch.catalogue import GROUP_RANK, INPUT_SPLITS, OUTPUT_SPLITS, SPLITS_VARY, parse_ints
from hangwatch.diagnosis.rules.checks import numel, single
from hangwatch.diagnosis.rules.slot import SHAPE_MISMATCH, Mismatch, SlotCalls, field_label, group_ranks
from hangwatch.records import TensorMeta
from hangwatch.wording import format_shape
from hangwatch.wording import mismatches as words


def group_index(s: SlotCalls) -> dict[int, int] | None:
    """rank -> its index in the group: ``extra["group_rank"]``, else its position in
    ``extra["group_ranks"]``, else the order of the ranks present (only if all are present)."""
    index: dict[int, int] = {}
    for r, c in s.calls.items():
        parsed = parse_ints(c.extra.get(GROUP_RANK))
        if parsed is None or len(parsed) != 1:
            break
        index[r] = parsed[0]
    else:
        if len(set(index.values())) == len(index):
            return index
    for c in s.calls.values():
        members = group_ranks(c)
        if members is not None and all(r in members for r in s.calls):
            return {r: members.index(r) for r in s.calls}
    if s.gs is None or s.gs == len(s.calls):
        return {r: i for i, r in enumerate(s.calls)}
    return None


@dataclass(frozen=True)
class _Pair:
    receiver: int
    sender: int
    expects: str  # what the receiver expects, e.g. "3 rows (output_split_sizes[1] = 3)"
    sends: str


def _pair_culprits(pairs: Sequence[_Pair]) -> list[int]:
    """The ranks in the most disagreeing pairs; a tie among all of them spares the lowest rank."""
    counts: dict[int, int] = {}
    for p in pairs:
        for r in {p.receiver, p.sender}:
            counts[r] = counts.get(r, 0) + 1
    top = max(counts.values())
    culprits = sorted(r for r, n in counts.items() if n == top)
    if len(culprits) == len(counts) and len(culprits) > 1:
        culprits = culprits[1:]
    return culprits


def _pairs_mismatch(s: SlotCalls, pairs: list[_Pair], hint: str, what: str) -> Mismatch:
    p = pairs[0]
    text = words.pair_text(p.receiver, p.expects, p.sender, p.sends, len(pairs) - 1)
    culprits = _pair_culprits(pairs)
    return s.mismatch(SHAPE_MISMATCH, culprits, f"{s.head(what)}: {text}", words.check_where(hint, s.where(culprits)))


@dataclass(frozen=True)
class _Chunks:
    """One side (input or output) of one rank's all_to_all_single, per peer index."""

    meta: TensorMeta
    key: str  # INPUT_SPLITS / OUTPUT_SPLITS
    splits: tuple[int, ...] | None  # None: an even split
    n: int

    @property
    def row(self) -> int:
        return numel(self.meta.shape[1:])

    def __len__(self) -> int:
        return len(self.splits) if self.splits is not None else self.n

    def elements(self, j: int) -> int:
        if self.splits is not None:
            return self.splits[j] * self.row
        return numel(self.meta.shape) // self.n

    def describe(self, j: int) -> str:
        if self.splits is None:
            return f"{self.elements(j)} elements (an even split of {format_shape(self.meta.shape)})"
        k = self.splits[j]
        return f"{words.chunk_amount(k, self.row, len(self.meta.shape) == 1)} ({self.key}[{j}] = {k})"


def _chunks(metas: Sequence[TensorMeta], key: str, splits: tuple[int, ...] | None, n: int) -> _Chunks | None:
    meta = single(metas)
    if meta is None or not meta.shape:
        return None
    if splits is None and (n <= 0 or numel(meta.shape) % n):
        return None  # reported by the intrinsic rule
    return _Chunks(meta, key, splits, n)


def _even_numel_field(s: SlotCalls, field: str) -> Mismatch | None:
    metas = {r: m for r, ms in s.present(field).items() if (m := single(ms)) is not None}
    sigs = {r: numel(m.shape) for r, m in metas.items()}
    what = "output tensor" if field == "outputs" else "input tensor"

    def show(r: int) -> str:
        return f"{format_shape(metas[r].shape)} ({sigs[r]} elements)"

    def hint(ref: list[int], bad: list[int]) -> str:
        return words.even_split_hint(what, s.which(bad, "pass"))

    return s.cross(sigs, SHAPE_MISMATCH, f"{field_label(field)}size mismatch", show, hint)


def _rule_pairwise_single(s: SlotCalls) -> Mismatch | None:
    if any(SPLITS_VARY in (c.extra.get(INPUT_SPLITS), c.extra.get(OUTPUT_SPLITS)) for c in s.calls.values()):
        return None  # sizes a call site changes at every call are not recorded: nothing to pair
    in_splits = {r: parse_ints(c.extra.get(INPUT_SPLITS)) for r, c in s.calls.items()}
    out_splits = {r: parse_ints(c.extra.get(OUTPUT_SPLITS)) for r, c in s.calls.items()}
    explicit = [v for v in (*in_splits.values(), *out_splits.values()) if v is not None]
    if not explicit and any(c.source != "python" for c in s.calls.values()):
        return None  # Flight Recorder keeps no split sizes: uneven splits look like a mismatch
    if not explicit:
        # Even splits everywhere: every rank must pass the same number of elements.
        for field in ("inputs", "outputs"):
            found = _even_numel_field(s, field)
            if found:
                return found
        return None
    index = group_index(s)
    if index is None:
        return None
    n = s.gs or max(len(v) for v in explicit)
    at = {i: r for r, i in index.items()}
    sends: dict[int, _Chunks] = {}
    recvs: dict[int, _Chunks] = {}
    for r, c in s.calls.items():
        snd = _chunks(c.inputs, INPUT_SPLITS, in_splits[r], n)
        rcv = _chunks(c.outputs, OUTPUT_SPLITS, out_splits[r], n)
        if snd is not None:
            sends[r] = snd
        if rcv is not None:
            recvs[r] = rcv
    pairs: list[_Pair] = []
    for i_rank, rcv in recvs.items():
        i = index[i_rank]
        for j in range(len(rcv)):
            j_rank = at.get(j)
            if j_rank is None or j_rank not in sends or i >= len(sends[j_rank]):
                continue
            snd = sends[j_rank]
            if rcv.elements(j) != snd.elements(i):
                pairs.append(_Pair(i_rank, j_rank, rcv.describe(j), snd.describe(i)))
    if not pairs:
        return None
    return _pairs_mismatch(
        s,
        pairs,
        words.SPLIT_PAIRING,
        "split mismatch",
    )


def _rule_pairwise_list(s: SlotCalls) -> Mismatch | None:
    index = group_index(s)
    if index is None:
        return None
    at = {i: r for r, i in index.items()}
    pairs: list[_Pair] = []
    for i_rank, c in s.calls.items():
        for j, out in enumerate(c.outputs):
            j_rank = at.get(j)
            if j_rank is None or j_rank not in s.calls:
                continue
            ins = s.calls[j_rank].inputs
            if index[i_rank] >= len(ins):
                continue
            sent = ins[index[i_rank]]
            if sent.shape != out.shape:
                pairs.append(
                    _Pair(
                        i_rank,
                        j_rank,
                        f"{format_shape(out.shape)} (output {j})",
                        f"{format_shape(sent.shape)} (input {index[i_rank]})",
                    )
                )
    if not pairs:
        return None
    return _pairs_mismatch(
        s,
        pairs,
        words.LIST_PAIRING,
        "shape mismatch",
    )


def rule_pairwise(s: SlotCalls) -> Mismatch | None:
    """The op's pairing (``Agree.pairwise``): ``"single"`` or ``"list"``; None for other ops."""
    if s.spec.pairwise == "single":
        return _rule_pairwise_single(s)
    if s.spec.pairwise == "list":
        return _rule_pairwise_list(s)
    return None
