"""How hangwatch words things for a person: rank ranges, shapes, calls, what a peer is doing,
incident titles; ``stories`` holds every sentence an incident tells. One place for the
coordinator's incident texts and the CLI's output, so the same thing reads the same everywhere.

It lives beside ``records.py`` and ``catalogue.py`` rather than inside the coordinator because
the CLI uses it too and must not import the coordinator.
Every text here is part of the output contract (tests/test_readme.py renders the README's
samples with it): change wording on purpose, never as a side effect.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from hangwatch import catalogue, kinds
from hangwatch.records import RECV_OPS, SEND_OPS, CallRecord, ProcessStatus, RankEnd, TensorMeta

#: How many tensors :func:`describe_call` shows before "… (+N)".
SHOW_TENSORS = 3

#: Incident kinds as report titles (``hangwatch report``).
KIND_TITLES = {row.kind.value: row.title for row in kinds.KINDS}


# --------------------------------------------------------------------------------------------
# Ranks


def format_ranks(ranks: Iterable[int], empty: str = "") -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3, 5"`` (sorted, duplicates dropped, runs collapsed);
    ``empty`` for no ranks."""
    ordered = sorted(set(ranks))
    if not ordered:
        return empty
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j == i:
            parts.append(str(ordered[i]))
        elif j == i + 1:
            parts.append(f"{ordered[i]}, {ordered[j]}")
        else:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(parts)


def ranks_label(ranks: Iterable[int]) -> str:
    """``"rank 3"`` / ``"ranks 0-3, 5"`` (at least one rank)."""
    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {format_ranks(ordered)}"


def conj(verb: str, ranks: Sequence[int]) -> str:
    """``verb`` agreeing with ``ranks``: ``"rank 0 uses"`` / ``"ranks 0, 1 use"``."""
    if len(set(ranks)) != 1:
        return verb
    return verb + ("es" if verb.endswith(("s", "sh", "ch")) else "s")


def listing(shown: Mapping[int, str]) -> str:
    """``{0: "[1, 5]", 1: "[1, 5]", 2: "[2]"}`` -> ``"ranks 0, 1: [1, 5]; rank 2: [2]"``."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(shown):
        by_text.setdefault(shown[rank], []).append(rank)
    groups = sorted(by_text.items(), key=lambda item: item[1][0])
    return "; ".join(f"{ranks_label(ranks)}: {text}" for text, ranks in groups)


# --------------------------------------------------------------------------------------------
# Tensors


def format_shape(shape: tuple[int, ...]) -> str:
    """``(1, 2, 5)`` -> ``"[1, 2, 5]"``; a scalar ``()`` -> ``"[]"``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def more(total: int, limit: int) -> str:
    """``" … (+N)"`` when ``total`` items were cut to ``limit``, else ``""``."""
    return f" … (+{total - limit})" if total > limit else ""


def is_objects(meta: TensorMeta) -> bool:
    return meta.dtype == "object"


def format_objects(meta: TensorMeta) -> str:
    if len(meta.shape) == 1:
        n = meta.shape[0]
        return f"{n} object" if n == 1 else f"{n} objects"
    return f"{format_shape(meta.shape)} object"


def format_metas(metas: Sequence[TensorMeta], limit: int = SHOW_TENSORS) -> str:
    """Compact tensors: ``"[1, 5] float32"``, ``"[2], [2], [3] … (+5) float32"``."""
    if not metas:
        return ""
    if all(is_objects(m) for m in metas):
        return ", ".join(format_objects(m) for m in metas[:limit]) + more(len(metas), limit)
    shown = metas[:limit]
    dtypes = {m.dtype for m in metas}
    if len(dtypes) == 1:
        text = ", ".join(format_shape(m.shape) for m in shown) + more(len(metas), limit)
        return f"{text} {metas[0].dtype}"
    return ", ".join(f"{format_shape(m.shape)} {m.dtype}" for m in shown) + more(len(metas), limit)


def format_shapes(metas: Sequence[TensorMeta]) -> str:
    """Shapes only: ``"[1, 5]"`` for one tensor, ``"[1, 5], [2] … (+3)"`` for a list."""
    if len(metas) == 1 and is_objects(metas[0]):
        return format_objects(metas[0])
    return ", ".join(format_shape(m.shape) for m in metas[:SHOW_TENSORS]) + more(len(metas), SHOW_TENSORS)


def format_dtypes(dtypes: Sequence[str]) -> str:
    if len(dtypes) == 1:
        return dtypes[0]
    if len(set(dtypes)) == 1:
        return f"{len(dtypes)} x {dtypes[0]}"
    return "[" + ", ".join(dtypes[:SHOW_TENSORS]) + more(len(dtypes), SHOW_TENSORS) + "]"


def tensors_word(n: int) -> str:
    return "1 tensor" if n == 1 else f"{n} tensors"


# --------------------------------------------------------------------------------------------
# Calls


def describe_call(c: CallRecord) -> str:
    """``"broadcast(src=0) [1, 2, 5] float32 at train.py:42 in step"``: the op as recorded, its
    relevant arguments, its tensors (a few, then "… (+N)") and the call site."""
    agree = catalogue.agreement(catalogue.canonical_op(c.op))
    args: list[str] = []
    if c.op in SEND_OPS and c.peer is not None:
        args.append(f"dst={c.peer}")
    elif c.op in RECV_OPS and c.peer is not None:
        args.append(f"src={c.peer}")
    elif c.root is not None:
        args.append(f"{agree.root or 'root'}={c.root}")
    if c.reduce_op and agree.reduce:
        args.append(f"op={catalogue.norm_reduce(c.reduce_op)}")
    for key, label in ((catalogue.INPUT_SPLITS, "in_splits"), (catalogue.OUTPUT_SPLITS, "out_splits")):
        splits = catalogue.parse_ints(c.extra.get(key))
        if splits is not None:
            args.append(f"{label}={list(splits)}")
    if c.async_op:
        args.append("async")
    text = f"{c.op}({', '.join(args)})"
    inputs = format_metas(c.inputs)
    if inputs:
        text += f" {inputs}"
    if c.outputs and c.outputs != c.inputs:
        text += f" -> {format_metas(c.outputs)}"
    if c.call_site:
        text += f" at {c.call_site}"
    return text


def p2p_doing(p: CallRecord, me: CallRecord) -> str:
    """What the peer's blocked call ``p`` does instead, seen from ``me``: ``"receiving from
    rank 0"``, ``"also sending to rank 1"``."""
    sending = p.op in SEND_OPS
    verb = "sending to" if sending else "receiving from"
    if p.peer == me.rank and sending == (me.op in SEND_OPS):
        verb = "also " + verb
    text = f"{verb} rank {p.peer}"
    if p.group != me.group:
        text += f" in group {p.group}"
    return text


def gpu_faults(proc: ProcessStatus | None) -> str:
    """ "; its GPU 3 (NVIDIA H100) reported Xid 79 at 12:01:02": what NVML saw go wrong on a
    rank's GPUs (Xid errors, uncorrected ECC errors); "" when nothing (or no NVML)."""
    if proc is None:
        return ""
    out = []
    for g in proc.gpus:
        name = f"GPU {g.index}" + (f" ({g.name})" if g.name else "")
        if g.xid:
            when = time.strftime("%H:%M:%S", time.localtime(g.xid_time)) if g.xid_time else "?"
            out.append(f"its {name} reported Xid {g.xid} at {when}")
        if g.ecc_uncorrected > 0:
            out.append(f"its {name} has {g.ecc_uncorrected} uncorrected ECC error(s)")
    return "".join(f"; {text}" for text in out)


def gpu_load(procs: Mapping[int, ProcessStatus | None]) -> str:
    """ "rank 0's GPU 0 at 100 %, rank 2's GPU 2 at 100 %": the utilisation NVML saw on each
    rank's GPUs ("" without NVML). A rank hung in a NCCL collective typically shows 100 %: the
    NCCL kernel spins while it waits for its peers."""
    parts = [
        f"rank {rk}'s GPU {g.index} at {g.utilization} %"
        for rk, proc in sorted(procs.items())
        if proc is not None
        for g in proc.gpus
        if g.utilization >= 0
    ]
    return ", ".join(parts)


def on_device(where: str, where_user: str) -> str:
    """A collective the host returned from and the device has not completed (NCCL), and where
    the host thread is meanwhile: usually blocked at the next CUDA synchronisation."""
    host = where_user or where
    if where and where_user and where != where_user:
        host = f"{where_user} (innermost: {where})"
    return "enqueued on the GPU and not completed; its host thread returned" + (f" and is in {host}" if host else "")


def doing(end: RankEnd | None, blocked: CallRecord | None, where: str, where_user: str, now: float) -> str:
    """What a rank is doing right now, in one clause, as well as can be told without py-spy:
    how it ended, the oldest call it waits in, or the user frame its main thread is in."""
    if end is not None:
        at = f" at {end.call_site}" if end.call_site else ""
        return {
            "clean_exit": f"has exited its script{at}",
            "destroyed": f"called destroy_process_group(){at}",
            "exception": f"died with {end.detail}{at}",
            "signal": f"was killed by {end.detail}{at}",
        }.get(end.kind.value, "has ended")
    if blocked is not None:
        waited = now - blocked.enter_time
        text = (
            f"is waiting in {blocked.op} (group {blocked.group}, seq {blocked.seq}) at "
            f"{blocked.call_site or '?'} for {waited:.0f} s"
        )
        if blocked.returned_time is not None:
            text += f" ({on_device(where, where_user)})"
        return text
    if where_user:
        if where and where != where_user:
            return f"is busy in {where_user} (innermost: {where})"
        return f"is busy in {where_user}"
    return "is outside any collective"


def in_step(step: int, text: str = " in step {}") -> str:
    """``text`` with the step in it, or nothing where the step is unknown (negative: records made
    from Flight Recorder dumps, which keep no training step)."""
    return text.format(step) if step >= 0 else ""
