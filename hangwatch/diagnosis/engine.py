"""The detection engine: runs the detectors, turns findings into incidents, attaches stacks.

The engine runs the detectors on every job the coordinator follows (``diagnosis.jobs``), one
job at a time, and owns the detectors' caches (``self.caches``, one per run of a job, passed in
every tick's ``Context`` with what changed since the last tick, see detectors/__init__.py):
detectors only read the job state. One root cause is one incident: findings carry a key
(``incidents.incident_key``), and a finding whose key (or whose slot) already has an incident
updates it instead of opening another. Hang incidents whose slot completes are closed as
resolved; those of a run no longer followed, as such. Stacks are requested from the node agents
as soon as an incident opens and attached when they arrive; every change is persisted.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from hangwatch import config, kinds
from hangwatch import records as r
from hangwatch.diagnosis import waits
from hangwatch.diagnosis.detectors import Context, Detector, DetectorCache, all_detectors, new_cache
from hangwatch.diagnosis.incidents import (
    Finding,
    Incident,
    IncidentKind,
    KeyFamily,
    incarnation_of,
    key_family,
    scoped,
    unscoped,
)
from hangwatch.diagnosis.jobs import Jobs
from hangwatch.diagnosis.state import JobState
from hangwatch.stackviews import child_where, summarize, user_frame, waited_children
from hangwatch.wording import joining, stories

log = logging.getLogger("hangwatch.coordinator")
#: After a job's records were refused for its or the coordinator's memory budget, its findings
#: wait this long: any rank's calls may be missing, and a trace with holes reads as skips and
#: mismatches (at 16,384 ranks over a 2,048 MiB job budget, a shape mismatch was blamed on 2,716
#: ranks). One rank's own budget leaves the others' evidence whole, and holds nothing.
BUDGET_HOLD_S = 30.0

#: Families of a hang at a slot that a mismatch found there later tells instead.
_SUPERSEDED = frozenset({KeyFamily.STUCK.value, KeyFamily.EARLY.value})

#: Incidents kept in memory (the store keeps more); the oldest resolved ones are let go first.
MAX_INCIDENTS_IN_MEMORY = 10_000

#: Hang kinds keyed by a slot, closed once every waiting rank has left that slot.
SLOT_KINDS = (IncidentKind.STUCK_COLLECTIVE, IncidentKind.EARLY_EXIT, IncidentKind.TRANSPORT_STALL)
#: Incidents whose ranks' later deaths are their aftermath (torch's watchdog aborts hung ranks).
#: A p2p deadlock (two stages that both send first) holds its ranks as a stuck collective does.
HANG_FAMILIES = kinds.HOLDING_FAMILIES
#: Hangs told at a slot (group, seq), one an incident: more ranks waiting there are told in it.
SLOT_HANGS = frozenset({KeyFamily.STUCK.value, KeyFamily.EARLY.value, KeyFamily.STALL.value})

#: Why a rank that registered itself over the network is never dumped or signalled: only a node
#: agent's registration (from the rank's own link, ``SO_PEERCRED``) ties a pid to a rank of a job.
UNPROVEN = (
    "not dumped: this rank registered itself over the network, so its pid is only its own claim "
    "(hangwatch reads and signals only ranks a node agent proved through their link to it)"
)

StackRequester = Callable[[list[r.Target], bool, Callable[[dict[int, r.StackDump]], None]], None]
IncidentListener = Callable[[Incident], None]


class Engine:
    def __init__(
        self,
        jobs: Jobs | JobState,
        lock: threading.RLock,
        *,
        stuck_after: float | None = None,
        silence_after: float = config.DEFAULT_SILENCE_AFTER_S,
        detectors: list[Detector] | None = None,
        request_stacks: StackRequester | None = None,
        persist: Callable[[Incident], object] | None = None,
        next_id: Callable[[], str] | None = None,
    ) -> None:
        self.jobs = jobs if isinstance(jobs, Jobs) else Jobs.of(jobs)
        self.lock = lock
        self.stuck_after_override = stuck_after
        self.silence_after = silence_after
        self.detectors = detectors if detectors is not None else all_detectors()
        self.caches: dict[str, DetectorCache] = {}  # per run: what the detectors remember between ticks
        self.request_stacks = request_stacks
        self.persist: Callable[[Incident], object] = persist or (lambda incident: None)
        self._counter = 0
        self.next_id = next_id or self._default_id
        self.incidents: dict[str, Incident] = {}
        self.by_key: dict[str, str] = {}
        self.listeners: list[IncidentListener] = []  # told of each new incident
        #: told when an open incident gains its aftermath (a death it caused): one root cause
        #: stays one alert, and the alert's story is completed (the webhook posts an update)
        self.update_listeners: list[IncidentListener] = []
        self._updated: list[Incident] = []
        #: per run, the job- or coordinator-wide refusals seen, and until when its findings wait
        self._refusals: dict[str, tuple[int, float]] = {}

    def held_for_budget(self, job: JobState, now: float) -> float:
        """Seconds the job's findings still wait after its records were last refused for the
        job's or the coordinator's memory budget (0: they do not)."""
        seen, until = self._refusals.get(job.incarnation, (0, 0.0))
        if job.refused_wide > seen:
            until = now + BUDGET_HOLD_S
            self._refusals[job.incarnation] = (job.refused_wide, until)
        return max(0.0, until - now)

    def _default_id(self) -> str:
        self._counter += 1
        return f"inc-{self._counter:04d}"

    @property
    def job(self) -> JobState:
        """The job a query without ``--job`` is about (see ``Jobs.current``)."""
        return self.jobs.current()

    def stuck_threshold(self, job: JobState | None = None) -> float:
        """The explicit ``--stuck-after``, or a threshold adapted to the job's own rhythm."""
        if self.stuck_after_override is not None:
            return self.stuck_after_override
        job = job if job is not None else self.job
        candidates = [config.MIN_STUCK_AFTER]
        p99 = job.wait_quantile(0.99)
        if p99 is not None:
            candidates.append(4 * p99)
        step = job.median_step_time()
        if step is not None:
            candidates.append(3 * step)
        return min(config.DEFAULT_STUCK_AFTER, max(candidates))

    def tick(self, now: float | None = None) -> list[Incident]:
        """Run every detector once; returns incidents opened by this tick."""
        now = time.time() if now is None else now
        opened: list[Incident] = []
        stack_jobs: list[tuple[Incident, list[int], bool]] = []
        with self.lock:
            by_incarnation: dict[str, list[Incident]] = {}
            for inc in self.incidents.values():
                by_incarnation.setdefault(incarnation_of(inc.key), []).append(inc)
            self._end_incarnations(by_incarnation, now)
            for job in self.jobs:
                job.before_detection(now, functools.partial(self.stuck_threshold, job))
                for finding, incident, new in self._detect(job, by_incarnation.get(job.incarnation, []), now):
                    if new and incident is not None:
                        opened.append(incident)
                        if finding.stack_ranks:
                            stack_jobs.append((incident, finding.stack_ranks, finding.native))
            self._resolve(now)
            updated, self._updated = self._updated, []
        for incident in opened:
            log.info("incident %s [%s]: %s", incident.id, incident.kind, incident.summary)
            for listener in self.listeners:
                try:
                    listener(incident)
                except Exception:
                    log.exception("incident listener failed")
        for incident in updated:
            for listener in self.update_listeners:
                try:
                    listener(incident)
                except Exception:
                    log.exception("incident listener failed")
        for incident, ranks, native in stack_jobs:
            self._request_stacks(incident, ranks, native)
        return opened

    def _detect(
        self, job: JobState, current: list[Incident], now: float
    ) -> list[tuple[Finding, Incident | None, bool]]:
        """One job's detectors, on what changed in it since the last tick; ``current``: its run's
        incidents. None while its records are refused for a budget wider than one rank's
        (``held_for_budget``): what changed waits for them."""
        if self.held_for_budget(job, now) > 0:
            return []
        claimed = {(inc.group, inc.seq) for inc in current if inc.status == "open" and inc.group}
        mismatched = {(inc.group, inc.seq) for inc in current if key_family(inc.key) == KeyFamily.MISMATCH.value}
        hangs = {
            rank: inc.key
            for inc in current
            if inc.status == "open" and key_family(inc.key) in HANG_FAMILIES
            for rank in inc.culprit_ranks + inc.waiting_ranks
        }
        told = {
            (inc.group, inc.seq): (unscoped(inc.key), frozenset(inc.waiting_ranks))
            for inc in current
            if inc.status == "open" and inc.group and key_family(inc.key) in SLOT_HANGS
        }
        cache = self.caches.get(job.incarnation)
        if cache is None:  # made once per run: making it is most of an idle tick's cost
            cache = self.caches[job.incarnation] = new_cache()
        ctx = Context(
            now=now,
            stuck_after_s=lambda: self.stuck_threshold(job),
            init_after=config.DEFAULT_INIT_AFTER if self.stuck_after_override is None else self.stuck_after_override,
            behind=job.behind(now),
            silence_after=self.silence_after,
            claimed=claimed,
            mismatched=mismatched,
            hangs=hangs,
            told=told,
            changes=job.take_changes(),
            cache=cache,
        )
        absorbed: list[tuple[Finding, Incident | None, bool]] = []
        for detector in self.detectors:
            try:
                findings = detector(job, ctx)
            except Exception:
                log.exception("detector %s failed", getattr(detector, "__module__", detector))
                continue
            for finding in findings:
                incident, new = self._absorb(finding, job, now)
                absorbed.append((finding, incident, new))
                if finding.group:
                    ctx.claimed.add((finding.group, finding.seq))
                if incident is not None and incident.status == "open" and key_family(incident.key) in HANG_FAMILIES:
                    # the next detectors see this tick's hangs as they see those already open
                    for rank in finding.culprit_ranks + finding.waiting_ranks:
                        ctx.hangs.setdefault(rank, incident.key)
        return absorbed

    def _end_incarnations(self, by_incarnation: dict[str, list[Incident]], now: float) -> None:
        """Runs no longer followed (a new run of the job began, the job was retired, or the
        coordinator restarted since): what the detectors remembered of them goes, and their open
        incidents can no longer change (their ranks are gone): they are resolved as such."""
        live = {job.incarnation for job in self.jobs}
        followed = set(self.caches)  # runs this engine has ticked (the others: from the store)
        self.caches = {run: cache for run, cache in self.caches.items() if run in live}
        for run, incidents in by_incarnation.items():
            if run in live:
                continue
            why = self.jobs.ended_incarnations.get(run) or (
                "the job's run ended (a new run of it began)"
                if run in followed
                else "no longer followed: the coordinator restarted (a hang still under way is reported again)"
            )
            for incident in incidents:
                if incident.status == "open":
                    incident.status = "resolved"
                    incident.resolved_time = now
                    incident.resolution = why
                    self.persist(incident)

    def _absorb(self, finding: Finding, job: JobState, now: float) -> tuple[Incident | None, bool]:
        finding.key = scoped(job.incarnation, finding.key)
        if finding.aftermath_of:
            finding.aftermath_of = scoped(job.incarnation, finding.aftermath_of)
            self._fold_aftermath(finding, now)
            return None, False
        existing_id = self.by_key.get(finding.key)
        if existing_id is not None:
            incident = self.incidents.get(existing_id)
            if incident is None:
                return None, False  # reported long ago, and no longer kept in memory
            summary = _with_aftermath(finding.summary, incident)
            if incident.status == "open" and (
                incident.summary != summary
                or incident.waiting_ranks != sorted(finding.waiting_ranks)
                or incident.culprit_ranks != sorted(finding.culprit_ranks)
                or incident.kind != finding.kind
            ):
                # the story told again as more evidence came: a new kind or culprit is a revision
                # the webhook posts; a clause more (seconds waited) is not
                revised = incident.kind != finding.kind or incident.culprit_ranks != sorted(finding.culprit_ranks)
                incident.summary = summary
                incident.culprit_ranks = sorted(finding.culprit_ranks)
                incident.waiting_ranks = sorted(finding.waiting_ranks)
                if revised:
                    incident.kind, incident.hint = finding.kind, finding.hint or incident.hint
                    incident.severity = kinds.severity(finding.kind)
                    incident.details["revised"] = int(str(incident.details.get("revised", 0))) + 1
                    if incident not in self._updated:
                        self._updated.append(incident)
                incident.details.update(finding.details)
                self.persist(incident)
            return incident, False
        incident = Incident.from_finding(self.next_id(), job.job_id, finding, now)
        incident.incarnation, incident.launch, incident.attempt = job.incarnation, job.launch, job.attempt
        if key_family(finding.key) in HANG_FAMILIES and job.ranks:
            # who waited for whom when it was told: ``report --graph`` draws it
            graph = waits.incident_graph(
                waits.graph(job, now, self.silence_after), incident.culprit_ranks, waits.hosts_of(job)
            )
            if graph is not None:
                incident.details["graph"] = graph
        self.incidents[incident.id] = incident
        self.by_key[finding.key] = incident.id
        if len(self.incidents) > MAX_INCIDENTS_IN_MEMORY:
            self._forget_oldest()
        self.persist(incident)
        if key_family(finding.key) == KeyFamily.MISMATCH.value and finding.group:
            self._supersede(incident, now)
        return incident, True

    def _supersede(self, verdict: Incident, now: float) -> None:
        """One slot, one story: a hang told at a slot whose calls, read later, disagree (C++
        calls from a Flight Recorder read that came after the threshold) was told on less
        evidence. The mismatch tells it; the hang is resolved into it."""
        for inc in self.incidents.values():
            if (
                inc.status == "open"
                and inc is not verdict
                and inc.incarnation == verdict.incarnation
                and (inc.group, inc.seq) == (verdict.group, verdict.seq)
                and key_family(inc.key) in _SUPERSEDED
            ):
                inc.status = "resolved"
                inc.resolved_time = now
                inc.resolution = stories.told_again(verdict.id, verdict.kind.value)
                self.persist(inc)

    def _fold_aftermath(self, finding: Finding, now: float) -> None:
        """A consequence (a rank killed by the mismatch it took part in) joins its root cause's
        incident as ``details["aftermath"]`` and a clause of its summary; it opens nothing. An
        incident of its own already opened for it (its root cause found only later) is closed."""
        root_id = self.by_key.get(finding.aftermath_of)
        root = self.incidents.get(root_id) if root_id is not None else None
        if root is None:
            return  # the root cause is not known (yet): the detector says so on a later tick
        aftermath = {
            "summary": finding.summary,
            "ranks": sorted(finding.culprit_ranks),
            "op": finding.op,
            **finding.details,
        }
        if root.details.get("aftermath") != aftermath:
            base = _without_aftermath(root)
            root.details["aftermath"] = aftermath
            root.summary = _with_aftermath(base, root)
            self.persist(root)
            if root not in self._updated:
                self._updated.append(root)
        own_id = self.by_key.get(finding.key)
        own = self.incidents.get(own_id) if own_id is not None else None
        if own is not None and own.status == "open" and own.id != root.id:
            own.status = "resolved"
            own.resolved_time = now
            own.resolution = stories.aftermath_of(root.id, root.kind.value)
            self.persist(own)

    def _forget_oldest(self) -> None:
        resolved = [i for i in self.incidents.values() if i.status != "open"]
        victim = min(resolved or self.incidents.values(), key=lambda i: i.detected_time)
        del self.incidents[victim.id]
        # its key stays known, so the same root cause is not reported again

    def _resolve(self, now: float) -> None:
        jobs = {job.incarnation: job for job in self.jobs}
        for incident in self.incidents.values():
            if incident.status != "open":
                continue
            job = jobs.get(incarnation_of(incident.key))
            if job is None:
                continue  # its run ended: resolved by _end_incarnations on the next tick
            reason = self._resolution(job, incident, now)
            if reason:
                incident.status = "resolved"
                incident.resolved_time = now
                incident.resolution = reason
                self.persist(incident)
                log.info("incident %s resolved: %s", incident.id, reason)

    @staticmethod
    def _died(job: JobState, ranks: list[int]) -> bool:
        """Whether one of ``ranks`` ended by an exception or a signal, or is gone (its hang never
        resolves)."""
        return any((st := job.ranks.get(rank)) is not None and not st.alive for rank in ranks)

    def _resolution(self, job: JobState, incident: Incident, now: float) -> str:
        if incident.kind in SLOT_KINDS and incident.group:
            if self._died(job, incident.culprit_ranks + incident.waiting_ranks):
                return ""
            slots = job.slots.get(incident.group)
            slot = slots.get(incident.seq) if slots is not None else None
            members = job.members(incident.group)
            late = ", ".join(str(rk) for rk in incident.culprit_ranks)
            if slot is None:
                # gone from the state: every call in it completed and later ones were made (the
                # state prunes such slots), or every member destroyed the group
                if slots is None or (slots and next(iter(slots)) > incident.seq):
                    return stories.went_past(incident.op, incident.seq, late)
                return ""
            done = all(c.exit_time is not None and c.error is None for c in slot.calls.values())
            if done and (not members or len(slot.calls) >= len(members)):
                return stories.all_completed(incident.op, incident.seq, late)
        if incident.op == r.INIT_OP and not incident.group:
            inside = [j for j in job.joining.values() if j.identity.phase == r.IN_INIT]
            if not inside or any(st.identity.attempt >= incident.attempt for st in job.ranks.values()):
                return joining.joined()
        if incident.kind == IncidentKind.RANK_FROZEN:
            for rank in incident.culprit_ranks:
                st = job.ranks.get(rank)
                if st is not None and now - st.last_seen < self.silence_after / 2:
                    return "the rank's heartbeats resumed"
        return ""

    # ---- stacks -------------------------------------------------------------------------

    def _request_stacks(self, incident: Incident, ranks: list[int], native: bool) -> None:
        if self.request_stacks is None:
            with self.lock:
                for rank in ranks:
                    incident.stack_notes[rank] = "no node agent is connected to dump stacks"
                self.persist(incident)
            return
        targets: list[r.Target] = []
        with self.lock:
            job = self.jobs.for_incarnation(incident.incarnation) or self.job
            for rank in ranks:
                st = job.ranks.get(rank)
                joiner = job.joining.get(rank)
                if st is None and joiner is not None:  # proven by its agent, not joined yet
                    i = joiner.identity
                    targets.append(r.Target(rank, i.pid, i.start_time, i.pid_namespace, r.link_tag(i.session)))
                    continue
                if st is None:
                    incident.stack_notes[rank] = "rank never registered"
                    continue
                if not st.proven:
                    incident.stack_notes[rank] = UNPROVEN
                    continue
                targets.append(st.target())

        def attach(dumps: dict[int, r.StackDump]) -> None:
            self.attach_stacks(incident.id, dumps)

        if targets:
            self.request_stacks(targets, native, attach)

    def attach_stacks(self, incident_id: str, dumps: dict[int, r.StackDump]) -> None:
        with self.lock:
            incident = self.incidents.get(incident_id)
            if incident is None:
                return
            for rank, dump in dumps.items():
                if dump.error:
                    incident.stack_notes[rank] = dump.error
                else:
                    incident.stacks[rank] = dump.text
                    incident.stack_notes.pop(rank, None)
                    doing = summarize(dump)
                    if doing:
                        incident.details.setdefault("stack_summary", {})[str(rank)] = doing
                    job = self.jobs.for_incarnation(incident.incarnation)
                    joiner = job.joining.get(rank) if job is not None else None
                    if joiner is not None and joiner.identity.pid == dump.pid:
                        joiner.where = user_frame(dump)  # where it is: its story says so next tick
                    st = job.ranks.get(rank) if job is not None else None
                    if st is not None and dump.children:  # what of its own it waits for, if anything
                        st.waits_for, st.waits_for_at = tuple(waited_children(dump)), time.time()
                        if st.waits_for:
                            _tell_waits_for(incident, rank, stories.waits_for_own(st.where_user, st.waits_for))
                    for child in dump.children:
                        what, _ = child_where(child)
                        body = child.text or f"no stacks: {child.error}"
                        incident.stacks[rank] += f"\n\n--- its {what}, pid {child.pid} ---\n{body}"
            incident.stacks_time = time.time()
            self.persist(incident)


def _tell_waits_for(incident: Incident, rank: int, told: str) -> None:
    """An absent rank's clause told again from its stack: what of its own it waits for (the
    stuck detector tells a slot once; its stack comes after)."""
    absent = incident.details.get("absent")
    if not isinstance(absent, dict) or not isinstance(old := absent.get(str(rank)), str) or old == told:
        return
    incident.summary = incident.summary.replace(f"rank {rank} {old}", f"rank {rank} {told}", 1)
    absent[str(rank)] = told


def _aftermath_clause(incident: Incident) -> str:
    aftermath = incident.details.get("aftermath")
    return f"; {aftermath['summary']}" if isinstance(aftermath, dict) and aftermath.get("summary") else ""


def _without_aftermath(incident: Incident) -> str:
    clause = _aftermath_clause(incident)
    return incident.summary[: -len(clause)] if clause and incident.summary.endswith(clause) else incident.summary


def _with_aftermath(summary: str, incident: Incident) -> str:
    """``summary`` (a finding's, of the root cause) with the incident's aftermath told after it."""
    return summary + _aftermath_clause(incident)
