"""Incidents: one root cause, its culprits, a diagnosis a person understands, and stacks.

``Finding`` is what a detector returns; the engine turns findings into ``Incident``s (one per
root cause, keyed), attaches stacks, persists them, and closes them when they resolve.

Keys are built from structured fields with ``incident_key`` (never from a summary's wording), so
the same root cause gets the same key whatever the text says this tick; they are stored as plain
strings (``family:field:...``), the form the incident store keeps and reloads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hangwatch.kinds import WARNING_KINDS as WARNING_KINDS
from hangwatch.kinds import IncidentKind as IncidentKind
from hangwatch.kinds import KeyFamily as KeyFamily
from hangwatch.kinds import hint as kinds_hint
from hangwatch.kinds import severity


@dataclass(frozen=True)
class IncidentKey:
    """One root cause. ``str()`` is the stored key: the family, then the fields that are set, in
    this order (``stuck:0:12``, ``died:session-3``, ``straggler:tp1:7``, ``p2p:0:4:0,1``)."""

    family: KeyFamily
    group: str | None = None
    seq: int | None = None
    session: str | None = None
    rank: int | None = None
    ranks: tuple[int, ...] = ()
    direction: str = ""  # p2p: "send" or "recv" (the blocked call the finding starts from)
    since: int | None = None  # frozen: when the silence began (whole seconds): one freeze, one key

    def __str__(self) -> str:
        parts = [self.family.value]
        if self.group is not None:
            parts.append(self.group)
        if self.seq is not None:
            parts.append(str(self.seq))
        if self.session is not None:
            parts.append(self.session)
        if self.rank is not None:
            parts.append(str(self.rank))
        if self.ranks:
            parts.append(",".join(map(str, self.ranks)))
        if self.direction:
            parts.append(self.direction)
        if self.since is not None:
            parts.append(str(self.since))
        return ":".join(parts)


def incident_key(
    family: KeyFamily,
    *,
    group: str | None = None,
    seq: int | None = None,
    session: str | None = None,
    rank: int | None = None,
    ranks: tuple[int, ...] = (),
    direction: str = "",
    since: int | None = None,
) -> str:
    """The key of one root cause, as stored (see ``IncidentKey``)."""
    return str(IncidentKey(family, group, seq, session, rank, ranks, direction, since))


def key_family(key: str) -> str:
    """The family part of a stored key (``"mismatch"`` for ``"mismatch:0:5"``, and for
    ``"3f9a1c2e/mismatch:0:5"``, the key as the engine stores it: scoped to the job's incarnation)."""
    return key.split(":", 1)[0].rsplit("/", 1)[-1]


def incarnation_of(key: str) -> str:
    """The run a stored key is scoped to (``""`` for a key that is not)."""
    head = key.split(":", 1)[0]
    return head.rsplit("/", 1)[0] if "/" in head else ""


def unscoped(key: str) -> str:
    """``key`` as a detector makes it: without the run a stored key is scoped to."""
    head, sep, rest = key.partition(":")
    return head.rsplit("/", 1)[-1] + sep + rest


def scoped(run: str, key: str) -> str:
    """``key`` scoped to a run of the job (unchanged if it already is): the same hang in a rerun
    is a new incident."""
    return key if "/" in key.split(":", 1)[0] else f"{run}/{key}"


@dataclass
class Finding:
    kind: IncidentKind
    key: str  # one root cause, one key: a finding with a known key updates that incident
    culprit_ranks: list[int]
    waiting_ranks: list[int]
    summary: str
    hint: str
    onset_time: float
    op: str = ""
    group: str = ""
    seq: int = 0
    step: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    stack_ranks: list[int] = field(default_factory=list)  # whose stacks to attach
    native: bool = False  # ask for native frames too
    #: the key of the incident this finding is a consequence of (a rank killed by the mismatch
    #: it took part in): folded into that incident's ``details["aftermath"]``, never its own
    aftermath_of: str = ""


@dataclass
class Incident:
    id: str
    job: str
    kind: IncidentKind
    key: str
    culprit_ranks: list[int]
    waiting_ranks: list[int]
    op: str
    group: str
    seq: int
    step: int
    summary: str
    hint: str
    onset_time: float
    detected_time: float
    severity: str = "error"
    status: str = "open"  # "open" | "resolved"
    resolved_time: float | None = None
    resolution: str = ""
    stacks: dict[int, str] = field(default_factory=dict)
    stack_notes: dict[int, str] = field(default_factory=dict)  # rank -> why its stack is missing
    stacks_time: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    #: the job's incarnation (a fresh id each time it runs; ``run`` in the JSON), its launch
    #: (rendezvous endpoint) and the launcher's restart count: the same hang in two
    #: incarnations or two jobs is two incidents
    incarnation: str = ""
    launch: str = ""
    attempt: int = 0

    def __post_init__(self) -> None:
        self.kind = IncidentKind(self.kind)  # a plain string of a known kind is accepted

    @classmethod
    def from_finding(cls, incident_id: str, job: str, f: Finding, now: float) -> Incident:
        return cls(
            id=incident_id,
            job=job,
            kind=f.kind,
            key=f.key,
            culprit_ranks=sorted(f.culprit_ranks),
            waiting_ranks=sorted(f.waiting_ranks),
            op=f.op,
            group=f.group,
            seq=f.seq,
            step=f.step,
            summary=f.summary,
            hint=f.hint or kinds_hint(f.kind),
            onset_time=f.onset_time,
            detected_time=now,
            severity=severity(f.kind),
            details=dict(f.details),
        )

    def to_json(self) -> dict[str, Any]:
        """The documented JSON contract (``docs/json.md``)."""
        return {
            "id": self.id,
            "job": self.job,
            "run": self.incarnation,
            "launch": self.launch,
            "attempt": self.attempt,
            "kind": self.kind.value,
            "severity": self.severity,
            "status": self.status,
            "culprit_ranks": self.culprit_ranks,
            "waiting_ranks": self.waiting_ranks,
            "op": self.op,
            "group": self.group,
            "seq": self.seq,
            "step": self.step,
            "summary": self.summary,
            "hint": self.hint,
            "stacks": {str(k): v for k, v in sorted(self.stacks.items())},
            "stack_notes": {str(k): v for k, v in sorted(self.stack_notes.items())},
            "onset_time": self.onset_time,
            "detected_time": self.detected_time,
            "stacks_time": self.stacks_time,
            "resolved_time": self.resolved_time,
            "resolution": self.resolution,
            "details": self.details,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Incident:
        return cls(
            id=str(data["id"]),
            job=str(data.get("job", "")),
            kind=IncidentKind(str(data["kind"])),
            key=str(data.get("key", data["id"])),
            culprit_ranks=[int(x) for x in data.get("culprit_ranks", [])],
            waiting_ranks=[int(x) for x in data.get("waiting_ranks", [])],
            op=str(data.get("op", "")),
            group=str(data.get("group", "")),
            seq=int(data.get("seq", 0)),
            step=int(data.get("step", 0)),
            summary=str(data.get("summary", "")),
            hint=str(data.get("hint", "")),
            onset_time=float(data.get("onset_time", 0.0)),
            detected_time=float(data.get("detected_time", 0.0)),
            severity=str(data.get("severity", "error")),
            status=str(data.get("status", "open")),
            resolved_time=data.get("resolved_time"),
            resolution=str(data.get("resolution", "")),
            stacks={int(k): str(v) for k, v in data.get("stacks", {}).items()},
            stack_notes={int(k): str(v) for k, v in data.get("stack_notes", {}).items()},
            stacks_time=data.get("stacks_time"),
            details=dict(data.get("details", {})),
            incarnation=str(data.get("run", "")),
            launch=str(data.get("launch", "")),
            attempt=int(data.get("attempt", 0)),
        )
