"""The flood: a synthetic training job driven through the real ``JobState.ingest`` and ``Engine.tick``.

A workload on top of ``tests.factories.SimJob`` (which registers the ranks and hands each batch to
``JobState.ingest``, as the daemon does), with a simulated clock so thousands of steps take
seconds. ``tests/diagnosis/test_bounded_memory.py`` checks the job state stays bounded under it;
``bench/soak_memory.py`` runs it for longer.
"""

from __future__ import annotations

import dataclasses
import math

from hangwatch import records as r
from hangwatch.coordinator.daemon import TICK_S
from hangwatch.diagnosis.engine import Engine
from hangwatch.diagnosis.incidents import Incident
from hangwatch.diagnosis.state import RankState
from tests.factories import SimJob, call, identity

T0 = 1_000.0
SITE = "train.py:42 in train_step"
SMALL = (r.TensorMeta((1024,), "float32"),)
BIG = (r.TensorMeta((4096, 1024), "bfloat16"),)
#: Steps and sequence numbers start here, as in a job that has run a while (and so that they are
#: heap-allocated ints throughout, not small cached ones until 256: that would read as growth).
OFFSET = 1000


class Flood:
    """A training job of ``ranks`` ranks in tensor-parallel groups of ``tp``, one step per call to
    ``_step``, each step ``step_s`` seconds of simulated time.

    Per rank and step: a ``StepEvent``; two world all_reduces (DDP buckets, group "0"); an
    all_reduce on its tp group and one on its strided dp group; a send to the next and a recv
    from the previous rank of its tp group (a pipeline ring: p2p pairs). Every ``marker_every``
    steps a ``MarkerEvent`` and an ``accelerate.check_trigger`` call. Irregular but realistic:

    * ``complete_every``: the dp all_reduce arrives already complete (``exit_time`` set at enter);
    * ``lost_exit_every``: the tp all_reduce's exit never arrives (the rank's queue dropped it);
      the rank's next collective on that group closes it;
    * ``reregister_every``: one rank (in turn, among ``POOL`` of them) re-registers with a new
      session (new call ids, its groups announced again), the job going on;
    * ``duplicate_every``: one rank's batch (in turn, among ``POOL``) is delivered twice (resent
      after a lost reply);
    * ``lossy_marker_calls``: rank 0 makes this many ``accelerate.check_trigger`` calls per step
      whose exits are all lost: open calls that never close.

    Batches go through ``JobState.ingest`` as ``Coordinator.report`` hands them over; the engine ticks every
    ``TICK_S`` of simulated time, as the daemon's detection loop does. The pattern repeats every
    ``period`` steps, so sizes taken at multiples of it compare exactly.
    """

    POOL = 4

    def __init__(
        self,
        ranks: int,
        *,
        tp: int = 8,
        step_s: float = 0.05,
        marker_every: int = 4,
        complete_every: int = 4,
        lost_exit_every: int = 5,
        reregister_every: int = 20,
        duplicate_every: int = 10,
        lossy_marker_calls: int = 0,
    ) -> None:
        assert ranks % tp == 0 and ranks >= 2 * tp
        self.world = ranks
        self.tp = tp
        self.step_s = step_s
        self.marker_every = marker_every
        self.complete_every = complete_every
        self.lost_exit_every = lost_exit_every
        self.reregister_every = reregister_every
        self.duplicate_every = duplicate_every
        self.lossy_marker_calls = lossy_marker_calls
        self.steps_per_tick = max(1, round(TICK_S / step_s))
        self.sim = SimJob(ranks, register_all=False)
        self.job = self.sim.job
        self.engine: Engine = self.sim.tick_engine
        self.opened: list[Incident] = []
        self.step = 0
        self.sessions_made = 0
        self.next_id = [1] * ranks
        self.states: list[RankState] = []
        self.tp_name = [f"tp{k // tp}" for k in range(ranks)]
        self.dp_name = [f"dp{k % tp}" for k in range(ranks)]
        spread = min(self.POOL, ranks - 1)
        self.pool = [1 + j * ((ranks - 1) // spread) for j in range(spread)]  # never rank 0
        for k in range(ranks):
            self.states.append(self._register(k, T0))

    @property
    def period(self) -> int:
        parts = [self.marker_every, self.complete_every, self.lost_exit_every, self.steps_per_tick]
        parts += [self.reregister_every * len(self.pool), self.duplicate_every * len(self.pool)]
        return math.lcm(*[p for p in parts if p > 0])

    def _pooled(self, j: int) -> int:
        return self.pool[j % len(self.pool)]

    # distinct (group, seq) slots one step opens: two world slots, one per tp and per dp group
    @property
    def slots_per_step(self) -> int:
        return 2 + self.world // self.tp + self.tp

    def _groups_of(self, k: int) -> list[r.GroupInfo]:
        # fresh tuples per rank, as the wire decodes them (each rank announces its own copy)
        base = k - k % self.tp
        return [
            r.GroupInfo("0", tuple(range(self.world)), "gloo", 0),
            r.GroupInfo(self.tp_name[k], tuple(range(base, base + self.tp)), "gloo", 1),
            r.GroupInfo(self.dp_name[k], tuple(range(k % self.tp, self.world, self.tp)), "gloo", 2),
        ]

    def _register(self, k: int, now: float) -> RankState:
        previous = self.sim.job.ranks.get(k)
        if previous is not None:  # a rank restarted alone: its old process is gone first
            previous.proc = r.ProcessStatus(previous.identity.pid, r.ProcState.DEAD, now)
        self.sessions_made += 1
        ident = identity(
            k,
            self.world,
            job_id="flood",
            pid=10_000 + k,
            local_rank=k % 8,
            start_time=now,
            session=f"session-{k}-{self.sessions_made}",
            backend="gloo",
        )
        state = self.sim.register(k, now, ident)
        self.next_id[k] = 1  # a new process numbers its calls from 1 again
        announce: list[r.RankEvent] = [r.GroupEvent(k, r.GroupEventKind.CREATED, g, now) for g in self._groups_of(k)]
        self.deliver(state, announce, now)
        return state

    def deliver(self, state: RankState, events: list[r.RankEvent], now: float) -> None:
        """One batch, through ``JobState.ingest`` (what ``Coordinator.report`` calls)."""
        transit = 0.001 + 0.0005 * ((self.step + state.rank) % 3)
        # the rank's clock agrees with ours here
        self.sim.deliver(state.rank, events, now, sent_time=now - transit, queued=len(events))

    def _call(
        self, k: int, op: str, group: str, seq: int, t: float, *, peer: int | None = None, done: bool = False
    ) -> r.CallRecord:
        call_id = self.next_id[k]
        self.next_id[k] = call_id + 1
        p2p = peer is not None
        return call(
            k,
            seq,
            op,
            call_id=call_id,
            group=group,
            inputs=BIG if p2p or group.startswith("tp") else SMALL,
            reduce_op=None if p2p or op.startswith("accelerate") else "sum",
            peer=peer,
            step=OFFSET + self.step + 1,
            call_site=SITE,
            enter_time=t,
            exit_time=t + 0.002 if done else None,
        )

    def _events(self, k: int, s: int, t: float, lose_tp_exit: bool) -> list[r.RankEvent]:
        tp = self.tp
        t = t + (k % 7) * 1e-4  # ranks do not arrive at once
        events: list[r.RankEvent] = [r.StepEvent(k, OFFSET + s + 1, t)]
        base = k - k % tp
        nxt, prv = base + (k + 1) % tp, base + (k - 1) % tp
        complete = self.complete_every > 0 and (s + k) % self.complete_every == 0
        n = OFFSET + s
        plan: list[tuple[str, str, int, int | None, bool, bool]] = [  # op, group, seq, peer, done, lost
            ("all_reduce", "0", 2 * n + 1, None, False, False),
            ("all_reduce", "0", 2 * n + 2, None, False, False),
            ("all_reduce", self.tp_name[k], n + 1, None, False, lose_tp_exit),
            ("all_reduce", self.dp_name[k], n + 1, None, complete, False),
            ("send", self.tp_name[k], n + 1, nxt, False, False),
            ("recv", self.tp_name[k], n + 1, prv, False, False),
        ]
        if self.marker_every and s % self.marker_every == 0:
            events.append(r.MarkerEvent(k, "accelerate.set_trigger", t, "stop flag", SITE, n + 1))
            plan.append(("accelerate.check_trigger", "0", 0, None, False, False))
        if k == 0:
            plan.extend(("accelerate.check_trigger", "0", 0, None, False, True) for _ in range(self.lossy_marker_calls))
        for i, (op, group, seq, peer, done, lost) in enumerate(plan):
            enter = t + i * 0.004
            call = self._call(k, op, group, seq, enter, peer=peer, done=done)
            events.append(call)
            if not done and not lost:
                events.append(r.CallExit(k, call.call_id, enter + 0.002))
        return events

    def _step(self) -> None:
        s = self.step
        t = T0 + 1.0 + s * self.step_s
        now = t + self.step_s / 2  # when the batches arrive
        rereg = resend = -1
        if self.reregister_every and s % self.reregister_every == self.reregister_every - 1:
            rereg = self._pooled(s // self.reregister_every)  # re-registers before the next step
        if self.duplicate_every and s % self.duplicate_every == 0:
            resend = self._pooled(s // self.duplicate_every)
        for k in range(self.world):
            # (an exit lost just before a re-registration would leave a hole the prune keeps 256 seqs)
            lose = self.lost_exit_every > 0 and (s + k) % self.lost_exit_every == 0 and k != rereg
            events = self._events(k, s, t, lose)
            self.deliver(self.states[k], events, now)
            if k == resend:
                resent = [dataclasses.replace(e) if isinstance(e, r.CallRecord) else e for e in events]
                self.deliver(self.states[k], resent, now + 0.001)
        if rereg >= 0:
            self.states[rereg] = self._register(rereg, now + 0.002)
        self.step += 1
        if self.step % self.steps_per_tick == 0:
            self.opened += self.engine.tick(now + 0.003)

    def run_to(self, step: int) -> None:
        while self.step < step:
            self._step()
