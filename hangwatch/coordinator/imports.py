"""Flight Recorder dumps imported into a followed job (``hangwatch analyze --import``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from hangwatch.coordinator.servicer import ImportBusy
from hangwatch.postmortem import packed, replay
from hangwatch.postmortem.dumps import Folder
from hangwatch.wording import format_ranks

if TYPE_CHECKING:
    from hangwatch.coordinator.daemon import Coordinator

#: Incidents one import may add (what the dumps show that the job's own incidents do not).
MAX_IMPORTED_INCIDENTS = 16


def import_payload(c: Coordinator, data: bytes, job_selector: str = "") -> dict[str, Any] | None:
    """An import's bytes (``hangwatch analyze --import``, ``packed.pack``): one at a time,
    inflated within its bound, and what parsing it holds charged to the memory budget while
    it lasts. ``ImportBusy`` when it cannot be taken now, ``DumpError`` when it is no import;
    else as :meth:`import_dumps`."""
    if not c.importing.acquire(blocking=False):
        raise ImportBusy("another import of dumps is being analysed: send this one when it is done")
    try:
        raw = packed.inflate(data)
        charge = len(raw) * packed.IMPORT_PARSE_FACTOR
        ledger = c.jobs.ledger
        with c.lock:
            if ledger.held + charge > ledger.budget.total:
                ledger.refuse("total")
                raise ImportBusy(
                    f"the coordinator's memory budget has no room to analyse this import ({charge >> 20} MiB)"
                )
            ledger.held += charge
        try:
            folder = packed.from_json(raw)
            del raw
            return import_dumps(c, folder, job_selector)
        finally:
            with c.lock:
                ledger.held -= charge
    finally:
        c.importing.release()


def import_dumps(c: Coordinator, folder: Folder, job_selector: str = "") -> dict[str, Any] | None:
    """A folder of Flight Recorder dumps (``hangwatch analyze --import``) joined to a followed
    job's history: analysed here, with the job's own hang threshold and size; each incident of
    the job whose collective the dumps hold gains what each rank's dump says of it
    (``details.flight_recorder``); what the dumps show that the job's incidents do not is
    added, resolved, as found post-mortem (it raises no alert, aborts nothing: files are no
    proof of a hang under way). None when the selector names no job."""
    with c.lock:
        job = c.select_job(job_selector)
        if job is None or not job.ranks:
            return None  # no job followed (an empty one has no run to join)
        stuck_after = c.engine.stuck_threshold(job)
        world = job.world_size or None
        live = [inc for inc in c.engine.incidents.values() if inc.incarnation == job.incarnation]
    analysis = replay.analyze(folder, stuck_after=stuck_after, world_size=world)  # outside the lock
    now = time.time()
    found = {(inc.group, inc.seq): inc for inc in analysis.incidents}
    attached: list[str] = []
    added: list[str] = []
    with c.lock:
        for inc in live:
            evidence = replay.slot_evidence(folder, inc.group, inc.seq) if inc.group else {}
            if not evidence:
                continue
            same = found.pop((inc.group, inc.seq), None)
            inc.details["flight_recorder"] = {
                "imported_time": now,
                "ranks": evidence,
                "missing_ranks": format_ranks(analysis.missing),
                "diagnosis": same.summary if same is not None else "",
                "agrees": same is not None and same.kind == inc.kind and same.culprit_ranks == inc.culprit_ranks,
            }
            c.engine.persist(inc)
            attached.append(inc.id)
        known = {inc.key for inc in live}
        skipped = 0
        for inc in found.values():
            # the job's incarnation, then the finding's own key without the analysis's throwaway one:
            # the same dumps give the same key, and the run is the job's (``incarnation_of``)
            key = f"{job.incarnation}/postmortem.{inc.key.split('/', 1)[-1]}"
            if key in known or len(added) >= MAX_IMPORTED_INCIDENTS:
                skipped += 1  # imported before (the same dumps again), or past the bound
                continue
            known.add(key)
            inc.id = c.engine.next_id()
            inc.job, inc.incarnation, inc.launch, inc.attempt = job.job_id, job.incarnation, job.launch, job.attempt
            inc.key = key
            inc.detected_time = now
            inc.status, inc.resolved_time = "resolved", now
            inc.resolution = "found post-mortem, in Flight Recorder dumps imported by `hangwatch analyze --import`"
            c.engine.incidents[inc.id] = inc
            c.engine.persist(inc)
            added.append(inc.id)
    return {
        "job": job.job_id,
        "run": job.incarnation,
        "ranks": format_ranks(analysis.ranks),
        "missing_ranks": format_ranks(analysis.missing),
        "attached": attached,
        "added": added,
        "not_added": skipped,
        "notes": analysis.notes,
    }
