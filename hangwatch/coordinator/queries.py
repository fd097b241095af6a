"""What the CLI asks the coordinator: incidents and a job's status."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from hangwatch import wire
from hangwatch.diagnosis import waits
from hangwatch.diagnosis.incidents import Incident
from hangwatch.diagnosis.views import job_line, status_json

if TYPE_CHECKING:
    from hangwatch.coordinator.daemon import Coordinator


def incidents_json(c: Coordinator, job_selector: str = "") -> list[dict[str, Any]]:
    """Every incident kept, or those of the jobs ``job_selector`` names (their runs, live or
    ended, are matched by job id, launch or run)."""
    with c.lock:
        runs = {job.incarnation for job in c.jobs.find(job_selector)} if job_selector else set()
        return [
            inc.to_json()
            for inc in c.engine.incidents.values()
            if not job_selector or inc.incarnation in runs or _names(job_selector, inc)
        ]


def status(c: Coordinator, job_selector: str = "") -> dict[str, Any] | None:
    """``status --json``: one job (``job_selector``'s, else the current one) and a line for
    every job followed; None when the selector names no job."""
    now = time.time()
    with c.lock:
        job = c.select_job(job_selector)
        if job is None:
            return None
        open_incidents = [
            {k: v for k, v in inc.to_json().items() if k not in ("stacks", "details")}
            for inc in c.engine.incidents.values()
            if inc.status == "open" and inc.incarnation == job.incarnation
        ]
        extra = {
            "coordinator_id": c.coordinator_id,
            "started": c.started,
            "key": c.jobs.key_of(job),
            "stuck_after": round(c.engine.stuck_threshold(job), 1),
            # how far behind the coordinator runs: silences this long are its own, not the ranks'
            "behind_s": round(job.behind(now), 2),
            "agents": c.hub.hosts(),
            "store": {
                "path": str(c.store.path),
                "write_errors": c.store.write_errors,
                "last_error": c.store.last_error,
                "pruned": c.store.pruned,
                "unsaved": len(c.store.unsaved),  # kept in memory until the disk takes writes
                "moved_aside": c.store.moved_aside or None,  # a corrupt database set aside at start
            },
            "rejected": {**c.rejected, "truncated": wire.truncated},  # strings cut at ingest
            "budget": {
                **c.jobs.ledger.view(),
                "job_held_bytes": job.held,
                "job_limit_bytes": c.jobs.ledger.budget.job_for(job.world_size),  # grown with its ranks
                "job_refused": job.refused,
                # findings wait after records were refused for a budget wider than a rank's
                "held_s": round(c.engine.held_for_budget(job, now), 1),
            },
        }
        status = status_json(job, now, c.options.silence_after, extra, open_incidents)
        status["graph"] = {
            **waits.graph_json(waits.graph(job, now, c.options.silence_after)),
            "hosts": waits.hosts_of(job),  # the views group ranks by node
        }
        open_by_incarnation: dict[str, int] = {}
        for inc in c.engine.incidents.values():
            if inc.status == "open":
                open_by_incarnation[inc.incarnation] = open_by_incarnation.get(inc.incarnation, 0) + 1
        status["jobs"] = [
            {
                **job_line(j, c.jobs.key_of(j), now, c.options.silence_after),
                "open_incidents": open_by_incarnation.get(j.incarnation, 0),
                "shown": j is job,
            }
            for j in c.jobs
        ]
        return status


def _names(selector: str, incident: Incident) -> bool:
    return any(
        s.startswith(selector) for s in (incident.job, incident.incarnation, f"{incident.job}@{incident.launch}") if s
    )
