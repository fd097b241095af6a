"""What the coordinator takes in: registrations, ranks' batches, and what node agents see of processes."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from hangwatch import records as r
from hangwatch import wire
from hangwatch.agent.identity import START_TIME_TOLERANCE_S
from hangwatch.coordinator.agents import AgentHub
from hangwatch.coordinator.options import report_interval_for, steady_read_for
from hangwatch.coordinator.servicer import MAX_WORLD_SIZE, IntakeError
from hangwatch.diagnosis import budget
from hangwatch.diagnosis.jobs import Jobs, JobsFull, SessionOver, job_key
from hangwatch.diagnosis.state import ClaimRefused, RankState
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.signatures import CallDecoder

log = logging.getLogger("hangwatch.coordinator")


class Intake:
    """The coordinator's intake (``Coordinator``'s): what the servicer and the rank links call."""

    coordinator_id: str
    lock: threading.RLock
    jobs: Jobs
    decoders: dict[str, CallDecoder]  # session -> its interned call signatures
    takes_runs: bool
    steady_read: float | None  # (``CoordinatorOptions.steady_read_s``)
    hub: AgentHub
    rejected: dict[str, int]
    _apply_failed: bool

    def register_rank(self, identity: r.RankIdentity, via: str = "direct") -> tuple[int, float, float]:
        """Register (or re-register) a rank in its job; returns the highest call id already held
        for its session (0 for a new one), how often it should report, and how far apart a node
        agent reads its ring while it is steady."""
        with self.lock:
            known = len(self.jobs.ended_incarnations), len(self.jobs)
            before = self.jobs.by_key.get(job_key(identity))
            earlier = before.ranks.get(identity.rank) if before is not None else None
            try:
                job, state = self.jobs.register(identity, time.time(), via)
            except JobsFull as e:
                self.metrics_rejected("jobs")
                raise IntakeError(str(e)) from None
            except SessionOver as e:
                log.info("registration refused: %s", e)  # a rank's process on its way out
                raise IntakeError(str(e)) from None
            except ClaimRefused as e:
                self.metrics_rejected("claim")
                log.warning("registration refused: %s", e)
                raise IntakeError(str(e)) from None
            if (len(self.jobs.ended_incarnations), len(self.jobs)) != known:  # a run ended or a job began
                log.info("job %s: run %s (%s)", identity.job_id, job.incarnation, self.jobs.key_of(job))
            # the rank's earlier process's session is over, and one registering again starts
            # afresh; so are the sessions of ended runs: found by a walk of every session where
            # the sessions followed are not those with a table and this one (not at each of a
            # large job's registrations)
            for session in {identity.session, earlier.identity.session if earlier is not None else ""}:
                gone = self.decoders.pop(session, None)
                if gone is not None:
                    gone.release()
            if len(self.decoders) + 1 != len(self.jobs.sessions):
                kept = {s: d for s, d in self.decoders.items() if self.jobs.for_session(s) is not None}
                for session, gone in self.decoders.items():
                    if session not in kept:
                        gone.release()
                self.decoders = kept
            # the rank's table starts empty too; its signatures count against the memory budget
            self.decoders[identity.session] = CallDecoder(
                cost=budget.call_bytes, charge=self._charge_table(state), fold=self.takes_runs
            )
            last_call_id = state.last_call_id
            interval = report_interval_for(job.world_size)
            steady = self.steady_read if self.steady_read is not None else steady_read_for(job.world_size)
        log.info(
            "rank %d registered (pid %d on %s, job %s, via %s)",
            identity.rank,
            identity.pid,
            identity.host,
            identity.job_id,
            via,
        )
        return last_call_id, interval, steady

    def join(self, identity: r.RankIdentity, via: str) -> None:
        """A process started as a rank, not joined yet: only its node agent, which proved it,
        says so (``RankIdentity.phase``)."""
        if via != "agent" or identity.phase not in r.JOIN_PHASES:
            self.metrics_rejected("invalid")
            raise IntakeError("a process that has not joined is told by the node agent that proved it")
        with self.lock:
            try:
                self.jobs.join(identity, time.time())
            except JobsFull as e:
                self.metrics_rejected("jobs")
                raise IntakeError(str(e)) from None

    def accept_registration(self, identity: r.RankIdentity, via: str = "direct") -> pb.RegisterReply:
        """Register a rank (from a ``Register`` RPC, or from the node agent that read its link).
        Raises :class:`IntakeError` for an identity that cannot be a rank of a job."""
        if not (0 < identity.world_size <= MAX_WORLD_SIZE) or not (0 <= identity.rank < identity.world_size):
            self.metrics_rejected("invalid")
            raise IntakeError(f"invalid rank {identity.rank} for world size {identity.world_size}")
        if not identity.session:
            raise IntakeError("registration without a session id")
        if identity.phase:
            self.join(identity, via)
            return pb.RegisterReply(coordinator_id=self.coordinator_id, server_time=time.time())
        last_call_id, interval, steady = self.register_rank(identity, via)
        return pb.RegisterReply(
            coordinator_id=self.coordinator_id,
            server_time=time.time(),
            report_interval_s=interval,
            steady_read_s=steady if steady > interval else 0.0,
            last_call_id=last_call_id,
            takes_runs=self.takes_runs,
            takes_cycles=self.takes_runs,  # runs of a cycle of signatures, where runs are taken
            takes_steps=self.takes_runs,  # and runs that cross steps (a node agent's folds)
        )

    def accept_report(self, request: pb.ReportBatch, relay: str = "") -> pb.ReportReply:
        """Decode and apply one rank's batch (from a ``Report`` RPC, a relay, or the node agent
        that read the rank's ring)."""
        decoder = self.decoder_for(request.session)
        if decoder is None:
            return pb.ReportReply(reregister=True, server_time=time.time())
        events, rejected, folded = decoder.decode(request.rank, request)
        accepted = self.report(request, events, relay)
        if accepted is None:
            return pb.ReportReply(reregister=True, server_time=time.time())
        if rejected:
            self.metrics_rejected("malformed", rejected)
        return pb.ReportReply(server_time=time.time(), accepted=accepted + folded)

    def _charge_table(self, state: RankState) -> Callable[[int], bool]:
        """How a rank's signature table asks for memory: within a quarter of the rank's budget
        and the coordinator's total (not a job's: the table is the session's, not the run's)."""
        ledger = self.jobs.ledger

        def charge(n: int) -> bool:
            with self.lock:
                if n > 0 and (state.table_bytes + n > ledger.budget.rank // 4 or ledger.held + n > ledger.budget.total):
                    ledger.refuse("rank" if state.table_bytes + n > ledger.budget.rank // 4 else "total")
                    return False
                state.table_bytes += n
                ledger.held += n
                return True

        return charge

    def accept_events(self, header: pb.ReportBatch, events: list[r.RankEvent]) -> int | None:
        """The embedded agent's batches, typed already (``RingEncoder.decode``): applied as
        ``accept_report`` applies a decoded one; None when the rank must register again."""
        if self.decoder_for(header.session) is None:
            return None
        return self.report(header, events)

    def record_cost(self, call: r.CallRecord) -> int:
        """A signature's bytes, as the memory budget charges each call made from it."""
        return budget.call_bytes(call)

    def decoder_for(self, session: str) -> CallDecoder | None:
        """The signature table of a registered session (None: the rank must register)."""
        return self.decoders.get(session)

    def report(self, batch: pb.ReportBatch, events: list[r.RankEvent], relay: str = "") -> int | None:
        """Apply a decoded batch (``events``; ``batch`` for its header) to the job state: the
        number of events applied, or None when the rank must register again."""
        now = time.time()
        asked = time.monotonic()
        with self.lock:
            # how long the batch waited for the state: the coordinator's own queue
            self.jobs.lag.observe(now, time.monotonic() - asked)
            job = self.jobs.for_session(batch.session)
            if job is None:
                return None
            result = job.ingest(
                batch.session,
                batch.rank,
                events,
                now=now,
                sent_time=batch.sent_time,
                mono_time=batch.mono_time,
                alive_time=batch.alive_time,
                held_s=batch.relay_held_s,
                relay=relay,
                queued=batch.queued,
                dropped=batch.dropped,
                where=wire.clip(batch.where, wire.MAX_SITE),
                where_user=wire.clip(batch.where_user, wire.MAX_SITE),
                where_stack=_clipped(batch.where_stack, budget.STACK_KEPT, budget.STACK_FRAME),
                budget_note=wire.clip(batch.budget_note, wire.MAX_SITE),
                flight_time=batch.flight_read_time,
                flight_unseen=_clipped(batch.flight_unseen, budget.UNSEEN_KEPT, budget.UNSEEN_NAME),
                unread=batch.unread,
            )
            if result is None:
                return None
            if result.failed:
                self.metrics_rejected("internal", result.failed)
                if not self._apply_failed:
                    self._apply_failed = True
                    log.error(
                        "could not apply an event from rank %d (reported once)", batch.rank, exc_info=result.error
                    )
        return result.applied

    def apply_process_statuses(self, host: str, statuses: list[r.ProcessStatus]) -> None:
        """What a node agent sees of its ranks' processes. A process's end keeps the earliest time
        it was seen gone (a rank's link closing is that moment; a later poll only confirms it) and
        whatever was learnt of how it ended."""
        ended = (r.ProcState.DEAD, r.ProcState.ZOMBIE)
        with self.lock:
            # by pid and start time: two containers on one node may each run a pid 42
            by_pid: dict[int, list[RankState]] = {}
            for held in self.jobs.ranks():
                if held.identity.host == host:
                    by_pid.setdefault(held.identity.pid, []).append(held)
            for status in statuses:
                st = next(
                    (
                        held
                        for held in by_pid.get(status.pid, ())
                        if abs(held.identity.start_time - status.start_time) <= START_TIME_TOLERANCE_S
                    ),
                    None,
                )
                if st is None:
                    continue
                before = st.proc
                if before is not None and before.state in ended and status.state in ended:
                    status = dataclasses.replace(
                        status,
                        time=min(before.time, status.time),
                        exit_code=status.exit_code if status.exit_code is not None else before.exit_code,
                        signal=status.signal if status.signal is not None else before.signal,
                        oom_killed=status.oom_killed or before.oom_killed,
                    )
                if before is not None and before.gpus and not status.gpus and status.state in ended:
                    # a gone process runs on no GPU any more: what its GPUs last showed (an Xid
                    # that killed it) stays with it
                    status = dataclasses.replace(status, gpus=before.gpus)
                st.proc = status

    def targets_on(self, host: str, include_remote_hosts: bool = True) -> list[r.Target]:
        with self.lock:
            return [
                st.target()
                for st in self.jobs.ranks()
                if st.identity.host == host and (include_remote_hosts or self.hub.agent_for(host) is None)
            ]

    def metrics_rejected(self, reason: str, count: int = 1) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + count


def _clipped(texts: Sequence[str], kept: int, limit: int) -> tuple[str, ...]:
    """The first ``kept`` of ``texts``, each clipped to ``limit`` (most batches carry none)."""
    return tuple(wire.clip(text, limit) for text in texts[:kept]) if texts else ()
