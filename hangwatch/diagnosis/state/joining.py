"""Processes started as a job's ranks that have not joined it yet (``init_process_group`` has
not returned in them), as their node agents proved and told them (``RankIdentity.phase``)."""

from __future__ import annotations

from dataclasses import dataclass

from hangwatch import records as r
from hangwatch.diagnosis.state.base import _Base


@dataclass
class Joiner:
    """One process started as a rank, not joined yet."""

    identity: r.RankIdentity  # its phase included
    since: float  # when it came to that phase (the coordinator's clock)
    first_seen: float
    #: where it is: the innermost frame of its own code, from a stack dumped for an incident
    where: str = ""


class Joining(_Base):
    """Who is on the way to join: a rank is taken off once it registers as one."""

    def join(self, identity: r.RankIdentity, now: float) -> None:
        """A starting process's phase, from its node agent."""
        if identity.phase not in r.JOIN_PHASES or identity.attempt < self.attempt:
            return  # a process of an earlier attempt of the launcher: gone with its run
        st = self.ranks.get(identity.rank)
        if st is not None and st.identity.pid == identity.pid and st.identity.start_time == identity.start_time:
            return  # joined already: its registration came first
        if not self.job_id:
            self.job_id, self.launch, self.attempt = identity.job_id, identity.launch, identity.attempt
        joiner = self.joining.get(identity.rank)
        if joiner is None or joiner.identity.session != identity.session:
            self.joining[identity.rank] = Joiner(identity, now, now)
        elif joiner.identity.phase != identity.phase:
            joiner.identity, joiner.since = identity, now

    def joined(self, rank: int) -> None:
        """``rank`` registered: it joined."""
        self.joining.pop(rank, None)

    def joiners_live(self) -> bool:
        return any(j.identity.phase != r.GONE for j in self.joining.values())
