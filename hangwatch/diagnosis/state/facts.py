"""What the job state derives from a run's templates, once a cycle or signature, not once a run."""

from __future__ import annotations

from dataclasses import dataclass

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.rules.collective import compare_collective
from hangwatch.diagnosis.state.base import _RunRef, run_keys

#: Calls judged in themselves, by what they are (``_faulty``), for every job.
_JUDGED: dict[tuple[object, ...], tuple[object, object, bool]] = {}
MAX_JUDGED = 4096


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What the job state derives from a run's templates (``facts_of``), in one turn of
    them, kept on their ``records.Shape`` (or on a run's only template)."""

    size: int | None  # the group's, when derived
    costs: tuple[int, ...]  # each template's bytes
    odd: bool  # some call is taken call by call: not a collective of the group, or wrong in itself
    keys: tuple[tuple[object, ...], ...]  # ``base.run_keys``


def facts_of(run: r.CallRun, size: int | None) -> tuple[tuple[int, ...], bool, _RunRef]:
    """What ``Runs._run`` derives from ``run``'s templates, for a group of ``size``: each call's
    bytes a period (as ``_enter`` charges it), whether some call goes call by call, and the
    run's reference (``Runs._compare_run``). Derived once a rank's cycle (``records.Shape``,
    whatever call a run starts at) or signature, not at each run."""
    shape = run.shape
    turn = run.turn if shape is not None else 0
    if shape is None and run.cycle:
        facts = _derive(run.templates, size)  # (a cycle of the wire's: not kept)
    else:
        holder: r.Shape | r.CallRecord = shape if shape is not None else run.template
        facts = holder.facts  # type: ignore[assignment]
        if not isinstance(facts, RunFacts) or facts.size != size:
            facts = _derive(shape.templates if shape is not None else (run.template,), size)
            holder.facts = facts
    costs = facts.costs[turn:] + facts.costs[:turn] if turn else facts.costs
    ref = _RunRef(run.first_seq, run.last_seq, facts.keys, run.first_seq - turn)
    return costs, facts.odd, ref


def _derive(templates: tuple[r.CallRecord, ...], size: int | None) -> RunFacts:
    group = templates[0].group
    return RunFacts(
        size,
        tuple(c.cost or b.call_bytes(c) for c in templates),
        any(c.kind is not r.OpKind.COLLECTIVE or c.group != group or _faulty(c, size) for c in templates),
        run_keys(templates),
    )


def _faulty(template: r.CallRecord, size: int | None) -> bool:
    """Whether a call of ``template`` is wrong in itself (against its group's ``size``):
    each such call is a repeat the mismatch detector counts, so a run of them goes call by
    call. Judged once a template and size (``CallRecord.judged``): a rank's runs come from
    its few templates, over and over."""
    judged = template.judged
    if judged is not None and judged[0] == size:
        return judged[1]
    # another rank's template of the same call was judged already: its tensors are the same
    # objects (``signatures._shared``); the rank matters only where it is the root
    t = template
    extra = tuple(t.extra.items()) if t.extra else ()
    key = (t.op, id(t.inputs), id(t.outputs), t.reduce_op, t.root, t.async_op, extra, t.rank == t.root, size)
    known = _JUDGED.get(key)
    if known is not None and known[0] is t.inputs and known[1] is t.outputs:
        faulty = known[2]
    else:
        faulty = compare_collective({t.rank: t}, size) is not None
        if len(_JUDGED) >= MAX_JUDGED:
            _JUDGED.clear()
        _JUDGED[key] = (t.inputs, t.outputs, faulty)  # held: their ids stay theirs
    template.judged = (size, faulty)
    return faulty
