"""Shared phrasing for diagnoses: what a rank is doing, in one short clause."""

from __future__ import annotations

from hangwatch.coordinator.state import RankState


def doing(state: RankState, now: float) -> str:
    """What a rank is doing right now, as well as the coordinator can tell without py-spy."""
    if state.end is not None:
        where = f" at {state.end.call_site}" if state.end.call_site else ""
        return {
            "clean_exit": f"has exited its script{where}",
            "destroyed": f"called destroy_process_group(){where}",
            "exception": f"died with {state.end.detail}{where}",
            "signal": f"was killed by {state.end.detail}{where}",
        }.get(state.end.kind.value, "has ended")
    blocked = state.oldest_open()
    if blocked is not None:
        waited = now - blocked.enter_time
        return (
            f"is waiting in {blocked.op} (group {blocked.group}, seq {blocked.seq}) at "
            f"{blocked.call_site or '?'} for {waited:.0f} s"
        )
    if state.where_user:
        if state.where and state.where != state.where_user:
            return f"is busy in {state.where_user} (innermost: {state.where})"
        return f"is busy in {state.where_user}"
    return "is outside any collective"
