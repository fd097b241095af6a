"""The JSON the CLI shows: ``status`` (job, ranks, open incidents). See `docs/json.md`."""

from __future__ import annotations

import dataclasses
from typing import Any

from hangwatch import records as r
from hangwatch.diagnosis.state import JobState, RankState


def rank_state(st: RankState, now: float, silence_after: float) -> tuple[str, float]:
    """A rank's state word and the Unix time it entered that state."""
    if st.end is not None:
        word = {
            r.EndKind.CLEAN_EXIT: "exited",
            r.EndKind.DESTROYED: "exited",
            r.EndKind.EXCEPTION: "died",
            r.EndKind.SIGNAL: "died",
        }[st.end.kind]
        return word, st.to_local(st.end.time)
    if not st.alive:
        return "died", st.last_seen
    if now - st.last_seen > silence_after:
        return "frozen", st.last_seen  # (or its relay went: see detectors.frozen.relay_lost)
    blocked = st.oldest_open()
    if blocked is not None:
        return "waiting", blocked.enter_time
    return "running", st.last_progress


def hook_path(hook_version: str) -> str | None:
    """``native`` or ``python: why`` from a registration's ``hook_version`` (``0.1.0 (native)``:
    ``session.hook_version``); None where the hook does not say."""
    _, paren, path = hook_version.partition(" (")
    return path.removesuffix(")") or None if paren else None


def rank_json(st: RankState, now: float, silence_after: float) -> dict[str, Any]:
    state, since = rank_state(st, now, silence_after)
    blocked = st.oldest_open()
    call = blocked or st.last_call
    return {
        "rank": st.rank,
        "host": st.identity.host,
        "pid": st.identity.pid,
        "local_rank": st.identity.local_rank,
        "state": state,
        "step": st.step,
        "last_op": call.op if call else None,
        "group": call.group if call else None,
        "seq": call.seq if call else None,
        "call_site": call.call_site if call else None,
        "since": since,
        "where": st.where_user or st.where,
        "last_seen": st.last_seen,
        "queued": st.queued,
        "dropped": st.dropped,
        "process": st.proc.state.value if st.proc else None,
        "relay": st.relay or None,
        "via": st.via,
        # what its hook or node agent slowed down to stay within its CPU budget (None: nothing)
        "budget": st.budget_note or None,
        # how its hook records calls: "native", or "python: why" (None: a hook that does not say)
        "hook": hook_path(st.identity.hook_version),
        # why its hook stopped recording calls (None: it records them)
        "capture_off": next((m.detail or "off" for m in reversed(st.markers) if m.name == r.CAPTURE_OFF), None),
        "end": (
            {"kind": st.end.kind.value, "detail": st.end.detail, "call_site": st.end.call_site} if st.end else None
        ),
        # completion as seen on the device (NCCL, from Flight Recorder) or at the host's return
        "completion": "device" if st.progress else "host",
        "host_returned": blocked.returned_time if blocked is not None else None,
        "timeout_at": _timeout_at(st, blocked),
        # its GPUs as the node agent's NVML saw them (empty on CPU nodes or without the gpu extra)
        "gpus": [dataclasses.asdict(g) for g in st.proc.gpus] if st.proc is not None else [],
    }


def _timeout_at(st: RankState, call: r.CallRecord | None) -> float | None:
    """When torch's own watchdog gives up on the call the rank waits in (where Flight Recorder
    told the group's timeout)."""
    if call is None:
        return None
    progress = st.progress.get(call.group)
    if progress is None or progress.timeout_ms <= 0:
        return None
    return call.enter_time + progress.timeout_ms / 1000


def status_json(
    job: JobState,
    now: float,
    silence_after: float,
    extra_job: dict[str, Any],
    incidents: list[dict[str, Any]],
) -> dict[str, Any]:
    ranks = [rank_json(st, now, silence_after) for _, st in sorted(job.ranks.items())]
    counts: dict[str, int] = {}
    for rk in ranks:
        counts[rk["state"]] = counts.get(rk["state"], 0) + 1
    info = {
        "id": job.job_id,
        "run": job.incarnation,  # this incarnation of the job (a rerun or a restart is a new one)
        "runs": job.incarnations,
        "attempt": job.attempt,
        "launch": job.launch,
        "world_size": job.world_size,
        "registered": len(job.ranks),
        "states": counts,
        "records_received": job.records_received,
        "records_in_runs": job.run_calls,  # of them, taken whole in runs of alike calls (issue 16)
        "records_in_cycles": job.cycle_calls,  # of those, in runs of a cycle of signatures
        # of those in runs, on the device (NCCL) as they came: open until progress completed them
        "records_on_device": job.device_calls,
        "device_stops": job.device_opened,  # of those, made open calls where a device stopped at them
        "relays": sorted({rk["relay"] for rk in ranks if rk["relay"]}),
        "dropped": sum(rk["dropped"] for rk in ranks),
        "conflicts": list(job.conflicts),  # registrations refused or overridden, newest last
        # processes started as its ranks that have not joined (init_process_group not returned)
        "joining": {
            str(rank): {
                "phase": j.identity.phase,
                "pid": j.identity.pid,
                "host": j.identity.host,
                "since": j.since,
                "where": j.where,
            }
            for rank, j in sorted(job.joining.items())
        },
        "time": now,
    }
    info.update(extra_job)
    return {"job": info, "ranks": ranks, "incidents": incidents}


def job_line(job: JobState, key: str, now: float, silence_after: float) -> dict[str, Any]:
    """A job's line in ``status``'s ``jobs``: which job, which run, and how its ranks stand."""
    counts: dict[str, int] = {}
    for st in job.ranks.values():
        word = rank_state(st, now, silence_after)[0]
        counts[word] = counts.get(word, 0) + 1
    return {
        "key": key,
        "id": job.job_id,
        "launch": job.launch,
        "run": job.incarnation,
        "attempt": job.attempt,
        "world_size": job.world_size,
        "registered": len(job.ranks),
        "states": counts,
        "started": job.started,
        "held_bytes": job.held,  # what its tables hold, as charged against the memory budget
    }
