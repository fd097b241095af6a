"""Who a job's ranks are: registrations, the claims they make, and the run they belong to.

A rank is proven only by its own link to its node's agent; a direct registration is a
claim, bound to its first registrant, and unproven claims never shape a job that proven ranks
join (world size, attempt, launch).
"""

from __future__ import annotations

from hangwatch import records as r
from hangwatch.diagnosis import budget as b
from hangwatch.diagnosis.state.base import (
    CLAIM_SILENT_S,
    SILENT_GONE_S,
    ClaimRefused,
    _Base,
    _same_process,
)
from hangwatch.diagnosis.state.ranks import (
    RankState,
)


class Registry(_Base):
    """Who a job's ranks are: registrations, the claims they make, and the run they belong to."""

    def _new_run(self, identity: r.RankIdentity, now: float, via: str) -> bool:
        """Whether ``identity`` starts a new run of the job: the launcher restarted it (a higher
        attempt), or every rank of the current run has ended. A run's state is never mixed with
        another's. (Another launch is another job: ``coordinator.jobs``.)"""
        if not self.ranks:
            return False
        if identity.attempt > self.attempt:
            proven = [st for st in self.ranks.values() if st.proven and st.end is None and st.alive]
            return via == "agent" or not proven  # an unproven claim never ends a run of proven ranks
        previous = self.ranks.get(identity.rank)
        if previous is None or previous.identity.session == identity.session:
            return False  # a rank of this run registering at its own pace (the others may be done)
        # a rank number of a run that is over, in a new process: the next run
        return not any(
            st.end is None and st.alive and now - st.last_seen <= SILENT_GONE_S for st in self.ranks.values()
        )

    def _shaped_by_claims(self, identity: r.RankIdentity) -> bool:
        """Whether only unproven claims made this job's shape (world size, attempt, launch) and
        ``identity`` contradicts it."""
        if not self.ranks or any(st.proven for st in self.ranks.values()):
            return False
        return (identity.world_size, identity.attempt, identity.launch) != (
            self.world_size or identity.world_size,
            self.attempt,
            self.launch,
        )

    def register(self, identity: r.RankIdentity, now: float, via: str = "direct") -> RankState:
        # a proven rank is never refused for what unproven claims alone said of the job
        set_aside = len(self.ranks) if via == "agent" and self._shaped_by_claims(identity) else 0
        if set_aside or self._new_run(identity, now, via):
            incarnations, ledger = self.incarnations + 1, self.ledger
            ledger.held -= self.held
            self.__init__(ledger, self.lag)  # type: ignore[misc]  # a clean slate: nothing of the last run is kept
            self.incarnations = incarnations
        if set_aside:
            self._conflict(
                identity, now, via, f"set aside {set_aside} unproven claim(s) that shaped this job otherwise"
            )
        if not self.ranks:
            self.launch, self.attempt = identity.launch, identity.attempt
        previous = self.ranks.get(identity.rank)
        if previous is not None and previous.identity.session == identity.session:
            # the same session, whichever path ships it: only its holder knows it. A rank is
            # proven by the link its agent registers, and is then the process of that link,
            # whatever an earlier registration under the session named.
            previous.last_seen = now
            previous.via = via
            if via == "agent":
                if not previous.proven and not _same_process(previous.identity, identity):
                    self._conflict(
                        identity, now, via, f"proved pid {identity.pid}, not pid {previous.identity.pid} it claimed"
                    )
                previous.identity = identity
                previous.proven = True
            return previous
        self._check_claim(identity, previous, now, via)
        if not self._room(None, b.RANK_BYTES - (previous.held if previous is not None else 0)):
            self._conflict(identity, now, via, "refused: the coordinator's memory budget is spent")
            raise ClaimRefused(f"rank {identity.rank}: no room left in the coordinator's memory budget")
        if previous is not None:
            self._forget_session(previous)
        state = RankState(
            identity=identity, registered_at=now, last_seen=now, last_progress=now, via=via, proven=via == "agent"
        )
        self._charge(state, b.RANK_BYTES)
        self.ranks[identity.rank] = state
        self.sessions[identity.session] = identity.rank
        self.job_id = identity.job_id or self.job_id
        self.world_size = self.world_size or identity.world_size  # the launch's, as its first rank said
        return state

    def _check_claim(self, identity: r.RankIdentity, previous: RankState | None, now: float, via: str) -> None:
        """Refuse (``ClaimRefused``) a registration that contradicts the run: another world size,
        an older attempt, or a second process for a rank whose first is alive and heard from. A
        process an agent proved (``via="agent"``) takes the rank from an unproven claim."""
        why = ""
        if self.world_size and identity.world_size != self.world_size:
            why = f"claims world size {identity.world_size}, but this run's ranks have {self.world_size}"
        elif identity.attempt != self.attempt:  # older, or newer and unproven beside proven ranks
            why = f"is of attempt {identity.attempt}, but this run is attempt {self.attempt}"
        elif previous is not None:
            same = (previous.identity.host, previous.identity.pid, previous.identity.start_time) == (
                identity.host,
                identity.pid,
                identity.start_time,
            )  # the same process, a new session (it initialised its process group again)
            live = previous.end is None and previous.alive and now - previous.last_seen < CLAIM_SILENT_S
            held = live and not same
            holder = f"pid {previous.identity.pid} on {previous.identity.host} ({previous.via})"
            if held and via == "agent" and not previous.proven:
                self._conflict(identity, now, via, f"took rank {identity.rank} from an unproven claim by {holder}")
                return
            if live and previous.proven and via != "agent":
                why = f"claims rank {identity.rank}, held by {holder}, which its node's agent proved"
            elif held:
                why = f"claims rank {identity.rank}, held by {holder}"
        if why:
            self._conflict(identity, now, via, f"refused: {why}")
            raise ClaimRefused(f"rank {identity.rank} (pid {identity.pid} on {identity.host}) {why}")

    def _conflict(self, identity: r.RankIdentity, now: float, via: str, what: str) -> None:
        self.conflicts.append(
            {"time": now, "rank": identity.rank, "pid": identity.pid, "host": identity.host, "via": via, "what": what}
        )

    def _forget_session(self, previous: RankState) -> None:
        """A rank registers again with a new session (its process restarted): the old session's
        open calls leave their slots and the p2p pairing. (Its completed calls stay; slots the
        old numbering left behind are pruned as stale, see ``_prune``.)"""
        self.sessions.pop(previous.identity.session, None)
        for call in previous.open_calls.values():
            self._unslot(call)
            self.p2p_open.pop((previous.rank, call.call_id), None)
        # its tables go with it: their calls are let go (those still in slots stay charged), then
        # what is charged to it alone (per-group tables, markers...)
        for call in previous.open_calls.values():
            self._unhold(previous, call)
        for hist in previous.history.values():
            self._evict(previous, hist, len(hist))
        # the runs it passed go too: their cost is in its tables, given back below, and a run
        # left behind would be given back again when its group goes
        for byrank in self.passed.values():
            for run in byrank.pop(previous.rank, ()):
                self._drop_run(run)
        if previous.last_kept:
            self._release_kept(previous)
        self._charge(None, -previous.held)  # its own tables, exactly (what calls it left in slots stay the job's)
        previous.held = 0

    def rank_for_session(self, session: str) -> RankState | None:
        rank = self.sessions.get(session)
        return None if rank is None else self.ranks.get(rank)
