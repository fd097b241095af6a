"""A hang diagnosed from Flight Recorder dumps alone: each rank's entries become the records its
node agent would have read live (``hangwatch.flight_entries``), fed to a real ``JobState`` and
the coordinator's own detectors, so the diagnosis, its incident and its JSON are the live ones.

What a dump cannot say is said, not guessed:

- **When.** A dump is the ring as it was when its file was written (the file's modification
  time). A call open in one rank's dump is only known open until then, so the analysis is made
  as of the earliest dump: a healthy job's dumps written seconds apart do not turn one rank's
  call in flight into a hang.
- **Who is missing.** A rank with no dump (it died, was killed before torch's timeout, or wrote
  elsewhere) is named; whatever the dumps show it did not do is not proof it did not do it.
- **What each rank was doing instead.** Only the stack of each call when it was issued, and only
  in pickle dumps written with stack traces; no live stacks, no training step, no call site
  otherwise. Completion states are what the ring kept (gloo's ring says retired or not; NCCL's,
  started and completed on the device).
- **p2p.** gloo's ring records no send or recv; NCCL's p2p entries are counted, not analysed.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from hangwatch import records as r
from hangwatch.diagnosis.detectors import mismatch, stuck
from hangwatch.diagnosis.engine import Engine
from hangwatch.diagnosis.incidents import Incident
from hangwatch.diagnosis.state import JobState
from hangwatch.flight_entries import EntryTracker
from hangwatch.postmortem.dumps import MAX_RANKS, Folder, RankDump, group_of, user_site
from hangwatch.wording import format_ranks

#: Collectives of a group fed to the detectors below the slowest rank's last one: older ones were
#: completed by every rank, so they only feed the rules' history (64 a group) and mismatches
#: that did not hang, which a cheaper comparison of their signatures finds first (``_tails``).
TAIL = 256

#: Seqs fed to the detectors at a time (below the distance at which the job state lets go of a
#: slot every rank completed).
WINDOW = 8

#: Ranks with no dump given a stack note each (the rest are in ``details.postmortem``).
STACK_NOTES = 64

#: The job id the analysis's incidents carry.
JOB_ID = "flight-recorder-dumps"
#: A call open this long before the earliest dump is a hang (``--stuck-after``): the
#: coordinator's own default. torch's timeouts (10 min NCCL, 30 min gloo) are far above it; a
#: healthy job's dumps show calls in flight for far less, though writing a dump with stack frames
#: stalls its rank (and so the others) for a moment (BENCHMARKS.md).
DEFAULT_STUCK_AFTER_S = 30.0

LACKS = (
    "the dumps hold each rank's collectives only: no training step, no live stack of what a rank "
    "was doing when the dumps were written"
)


class _NoPythonCalls:
    """No hook ran: every entry becomes a record."""

    def covers(self, group: str, seq: int) -> bool:
        return False

    def newest(self, group: str) -> int:
        return 0


@dataclass
class Analysis:
    """The incidents found, and what the reader should know about the dumps they came from."""

    incidents: list[Incident]
    world_size: int
    ranks: list[int]
    missing: list[int]
    notes: list[str] = field(default_factory=list)
    as_of: float = 0.0

    def incidents_json(self) -> list[dict[str, Any]]:
        return [inc.to_json() for inc in self.incidents]


def _ranks_text(raw: Any) -> tuple[int, ...]:
    """A dump's ``pg_config`` ranks (a JSON text of global ranks), those a job can have only."""
    try:
        ranks = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(ranks, list | tuple):
            return ()
        return tuple(x for x in ranks if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_RANKS)
    except (ValueError, TypeError, RecursionError):
        return ()


def _world_size(folder: Folder, given: int | None) -> int:
    if given:
        return min(given, MAX_RANKS)
    return min(MAX_RANKS, max(_config_size(folder), max(folder.dumps, default=-1) + 1))


def _config_size(folder: Folder) -> int:
    """The most ranks any dump's group config lists (0: none lists any)."""
    return max(
        (len(_ranks_text(cfg.get("ranks"))) for d in folder.dumps.values() for cfg in d.pg_config.values()
         if isinstance(cfg, dict)),
        default=0,
    )  # fmt: skip


#: Dumps written this far apart are hardly of one hang (torch's ranks dump within seconds).
APART_S = 600.0


def _other_runs(folder: Folder) -> list[str]:
    """Signs that some dumps are from another run (torch's default folder is /tmp, where an
    earlier run's files stay): more ranks than the dumps' own group configs say the job has, or
    dumps written long apart from the others."""
    notes = []
    said = _config_size(folder)
    beyond = [rk for rk in folder.dumps if said and rk >= said]
    if beyond:
        notes.append(
            f"the dumps' group configs say the job has {said} ranks, yet there are dumps of rank(s) "
            f"{format_ranks(beyond)}: are some from another run?"
        )
    times = sorted(d.written for d in folder.dumps.values())
    middle = times[len(times) // 2]
    apart = [rk for rk, d in folder.dumps.items() if abs(d.written - middle) > APART_S]
    if apart:
        notes.append(
            f"the dumps of rank(s) {format_ranks(apart)} were written more than {APART_S:.0f} s apart from "
            "the others': are they from another run?"
        )
    return notes


def _groups(folder: Folder, world: int) -> dict[str, tuple[int, ...]]:
    """Each process group's members: the default group is every rank; another group's are the
    ranks whose dumps know it (its status, its entries), or what a dump's config lists."""
    members: dict[str, set[int]] = {}
    for rank, dump in folder.dumps.items():
        names = set(dump.pg_status)
        names.update(_seq(e)[0] for e in dump.entries)
        for name in names:
            members.setdefault(name, set()).add(rank)
    for dump in folder.dumps.values():  # once every rank's groups are known, whichever dump lists them
        for key, cfg in dump.pg_config.items():
            ranks = _ranks_text(cfg.get("ranks")) if isinstance(cfg, dict) else ()
            if ranks and str(key) in members:
                members[str(key)].update(rk for rk in ranks if rk < world)
    out = {name: tuple(sorted(ranks)) for name, ranks in members.items() if name and name != "0"}
    out["0"] = tuple(range(world))
    return out


def _seq(entry: dict[str, Any]) -> tuple[str, int]:
    key = entry.get("_key")  # set once by the loader (``dumps._slim``)
    if key is not None:
        return key  # type: ignore[no-any-return]
    try:
        return group_of(entry), int(entry.get("collective_seq_id") or 0)
    except (TypeError, ValueError):
        return group_of(entry), 0


def _site(entry: dict[str, Any]) -> tuple[str, list[str]]:
    """An entry's call site (the loader's, read once from its frames) and its frames as text."""
    site, lines = user_site(entry.get("frames"))
    return str(entry.get("call_site", site)), lines


def _tails(folder: Folder) -> dict[str, int]:
    """Per group, the first collective to feed the detectors: :data:`TAIL` below the slowest
    rank's last, or the group's first where its older collectives disagree across ranks (what
    op, shapes and dtypes each rank's entry records)."""
    last: dict[str, int] = {}
    for dump in folder.dumps.values():
        mine: dict[str, int] = {}
        for e in dump.entries:
            if not e.get("is_p2p"):
                group, seq = _seq(e)
                mine[group] = max(mine.get(group, 0), seq)
        for group, seq in mine.items():
            last[group] = min(last.get(group, seq), seq)
    cut = {group: seq - TAIL for group, seq in last.items()}
    seen: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
    for dump in folder.dumps.values():
        for e in dump.entries:
            key = _seq(e)
            if key[1] >= cut.get(key[0], 0) or e.get("is_p2p"):
                continue
            sig = (e.get("profiling_name"), e.get("input_sizes"), e.get("input_dtypes"))
            if seen.setdefault(key, sig) != sig:
                group = key[0]
                cut[group] = 0  # a mismatch that did not hang: the whole group goes to the rules
    return cut


def _records(
    dump: RankDump, cut: dict[str, int] | None = None
) -> tuple[list[r.RankEvent], dict[tuple[str, int], list[str]], int]:
    """The rank's entries from each group's ``cut`` on as records (with call sites from their
    frames), each call's frames, and how many p2p entries were passed over."""
    tracker = EntryTracker(dump.rank)
    entries = dump.entries
    if cut:
        entries = [e for e in entries if e.get("is_p2p") or (k := _seq(e))[1] >= cut.get(k[0], 0)]
    events = tracker.update(entries, _NoPythonCalls(), 0, dump.written)
    by_key = {}
    p2p = 0
    for e in entries:
        if e.get("is_p2p"):
            p2p += 1
            continue
        by_key[_seq(e)] = e
    frames: dict[tuple[str, int], list[str]] = {}
    for event in events:
        if not isinstance(event, r.CallRecord):
            continue
        entry = by_key.get((event.group, event.seq), {})
        site, lines = _site(entry)
        event.step = -1  # unknown: a dump keeps no training step
        event.call_site = site  # unknown without frames (not "issued from C++": nobody knows)
        if lines:
            frames[(event.group, event.seq)] = lines
        done_ns = entry.get("time_discovered_completed_ns")
        if event.exit_time is not None:
            # retired: the ring keeps when the device completed it (NCCL), else only that it did
            event.exit_time = float(done_ns) / 1e9 if done_ns else event.enter_time
    return events, frames, p2p


def analyze(folder: Folder, *, stuck_after: float = DEFAULT_STUCK_AFTER_S, world_size: int | None = None) -> Analysis:
    """Diagnose what ``folder``'s dumps show, as the coordinator would have live."""
    world = _world_size(folder, world_size)
    present = sorted(folder.dumps)
    missing = [rk for rk in range(world) if rk not in folder.dumps]
    notes: list[str] = []
    if not present:
        return Analysis([], world, [], missing, ["no dump could be read"])
    as_of = min(d.written for d in folder.dumps.values())
    job = JobState()
    job.from_dumps = True
    groups = _groups(folder, world)
    frames: dict[int, dict[tuple[str, int], list[str]]] = {}
    p2p = 0
    cut = _tails(folder)
    # Each rank's records, fed to the detectors a window of seqs at a time across all ranks, as
    # they would have arrived live: a slot every rank completed is let go as soon as the ranks are
    # a few calls past it, so a mismatch that did not hang is seen only if the detectors look
    # before the ranks' later calls arrive.
    windows: dict[int, dict[int, list[r.RankEvent]]] = {}
    sessions: dict[int, str] = {}
    for rank in present:
        dump = folder.dumps[rank]
        ident = r.RankIdentity(JOB_ID, rank, world, "", 0, session=f"dump-{rank}", backend=dump.ring)
        job.register(ident, dump.written)
        sessions[rank] = ident.session
        made: list[r.RankEvent] = [
            r.GroupEvent(rank, r.GroupEventKind.CREATED, r.GroupInfo(name, ranks), dump.written)
            for name, ranks in groups.items()
            if rank in ranks and name != "0"
        ]
        job.ingest(ident.session, rank, made, now=dump.written, sent_time=dump.written)
        events, frames[rank], skipped = _records(dump, cut)
        p2p += skipped
        for event in events:
            seq = event.seq if isinstance(event, r.CallRecord) else 0
            windows.setdefault(seq // WINDOW, {}).setdefault(rank, []).append(event)
    numbers = itertools.count(1)
    engine = Engine(
        job,
        threading.RLock(),
        stuck_after=stuck_after,
        detectors=[mismatch.detect, stuck.detect],
        next_id=lambda: f"dump-{next(numbers):04d}",  # never mistaken for a live incident, in a log or a report
    )
    for window in sorted(windows):
        for rank, events in windows[window].items():
            written = folder.dumps[rank].written
            job.ingest(sessions[rank], rank, events, now=written, sent_time=written)
        engine.tick(as_of)
    incidents = sorted(engine.incidents.values(), key=lambda inc: inc.id)
    if missing:
        notes.append(
            f"no dump of rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)} (of {world}): "
            "it may have died or been killed before torch's timeout, or written its dump elsewhere; "
            "what the dumps do not show it doing is no proof it did not"
        )
    notes.extend(_other_runs(folder))
    if p2p:
        notes.append(f"{p2p} p2p entries (send/recv) not analysed: Flight Recorder numbers them apart from collectives")
    if not any(d.frames for d in folder.dumps.values()):
        notes.append("no stack frames in the dumps: call sites unknown (pickle dumps carry them when asked)")
    if not incidents and any("cpu" in d.ring for d in folder.dumps.values()):
        notes.append("gloo's ring records no send or recv: a hang in p2p calls does not show in these dumps")
    for inc in incidents:
        _annotate(inc, folder, frames, groups.get(inc.group, ()), missing, notes, as_of)
    return Analysis(incidents, world, present, missing, notes, as_of)


def _annotate(
    inc: Incident,
    folder: Folder,
    frames: dict[int, dict[tuple[str, int], list[str]]],
    members: tuple[int, ...],
    missing: list[int],
    notes: list[str],
    as_of: float,
) -> None:
    """What the incident rests on: which dumps, what they lack, and each rank's stack as the ring
    recorded it when the rank issued its call in this slot (or its last call on the group)."""
    inc.details["postmortem"] = {
        "as_of": as_of,
        "dumps": {str(rk): d.path for rk, d in sorted(folder.dumps.items())},
        "missing_ranks": format_ranks(missing),  # a job of a million ranks: a range, not a list
        "lacks": LACKS,
        "notes": list(notes),
    }
    member_set, culprits = set(members), set(inc.culprit_ranks)  # a job's million ranks: no scans
    unknown = [rk for rk in missing if rk in member_set and rk not in culprits]
    if unknown:
        inc.summary += f"; no dump of rank{'s' if len(unknown) > 1 else ''} {format_ranks(unknown)}: unknown"
    inc.stack_notes.clear()  # the engine's "no agent to dump stacks": a post-mortem has none to ask
    for rank in sorted({*inc.culprit_ranks, *inc.waiting_ranks}):
        mine = frames.get(rank)
        if mine is None:
            if len(inc.stack_notes) < STACK_NOTES:
                inc.stack_notes[rank] = "no dump of this rank"
            continue
        key = (inc.group, inc.seq)
        label = f"issuing {inc.op} (group {inc.group}, seq {inc.seq})"
        if key not in mine:
            earlier = [k for k in mine if k[0] == inc.group and k[1] < inc.seq]
            if not earlier:
                inc.stack_notes[rank] = "its dump keeps no stack frames for its calls on this group up to here"
                continue
            key = max(earlier)
            label = f"issuing its last call on group {inc.group} (seq {key[1]}); not where it is now"
        inc.stacks[rank] = f"Flight Recorder, rank {rank}, {label}:\n" + "\n".join(f"  {f}" for f in mine[key])


def slot_evidence(folder: Folder, group: str, seq: int) -> dict[str, dict[str, Any]]:
    """What each rank's dump says of the collective (``group``, ``seq``): its entry (op, shapes,
    state, times, the stack it was issued from), or, where the rank has none, its last entry on
    the group (it never got there). Ranks whose dumps do not know the group are left out."""
    out: dict[str, dict[str, Any]] = {}
    for rank, dump in sorted(folder.dumps.items()):
        on_group = []
        for e in dump.entries:
            key = _seq(e)
            if key[0] == group and not e.get("is_p2p"):
                on_group.append((key[1], e))
        if not on_group:
            continue
        here = [e for s, e in on_group if s == seq]
        entry = here[0] if here else max(on_group, key=lambda item: item[0])[1]
        site, lines = _site(entry)
        out[str(rank)] = {
            "dump": dump.path,
            "written": dump.written,
            "reached": bool(here),
            "seq": int(entry.get("collective_seq_id") or 0),
            "op": str(entry.get("profiling_name", "")),
            "input_sizes": entry.get("input_sizes", []),
            "input_dtypes": entry.get("input_dtypes", []),
            "state": str(entry.get("state", "")),
            "retired": bool(entry.get("retired")),
            "created": float(entry.get("time_created_ns") or 0) / 1e9,
            "completed": float(entry.get("time_discovered_completed_ns") or 0) / 1e9,
            "call_site": site,
            "frames": lines,
        }
    return out
