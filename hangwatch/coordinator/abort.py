"""``--abort-on-hang``: a hang's ranks are signalled once their stacks are taken."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from hangwatch.diagnosis.engine import UNPROVEN
from hangwatch.diagnosis.incidents import Incident

if TYPE_CHECKING:
    from hangwatch.coordinator.daemon import Coordinator

log = logging.getLogger("hangwatch.coordinator")


def after(c: Coordinator, incident: Incident) -> None:
    if incident.severity != "error":
        return

    def abort_after_stacks() -> None:
        deadline = time.time() + 15.0
        while time.time() < deadline and incident.stacks_time is None and incident.stack_notes == {}:
            time.sleep(0.2)
        with c.lock:
            job = c.jobs.for_incarnation(incident.incarnation)  # only the incident's own job is touched
            if job is None:
                return
            job.aborted_at = time.time()
            live = [st for st in job.ranks.values() if st.end is None]
            targets = [st.target() for st in live if st.proven]  # only proven ranks
            unproven = {st.rank: UNPROVEN.replace("not dumped", "not signalled") for st in live if not st.proven}
            if unproven:
                told = incident.details.setdefault("abort", {"signalled_pids": [], "refused": {}})
                told["refused"].update({str(rank): why for rank, why in unproven.items()})
                c.store.save(incident)
        if targets:
            log.warning("--abort-on-hang: terminating %d rank(s) after incident %s", len(targets), incident.id)
            c.hub.abort(targets, c.hosts(targets), on_result=record)

    def record(signalled: list[int], refused: dict[int, str]) -> None:
        """What the agents did, in the incident: pids signalled, ranks refused and why."""
        with c.lock:
            told = incident.details.setdefault("abort", {"signalled_pids": [], "refused": {}})
            told["signalled_pids"] = sorted({*told["signalled_pids"], *signalled})
            told["refused"].update({str(rank): why for rank, why in refused.items()})
            c.store.save(incident)

    threading.Thread(target=abort_after_stacks, name="hangwatch-abort", daemon=True).start()
