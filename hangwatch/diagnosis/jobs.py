"""The jobs one coordinator serves: each launch of a job has a state of its own.

A job is told apart by its id (``HANGWATCH_JOB_ID``, else torchrun's run id, which is ``"none"``
for every torchrun with default settings) *and* its launch (the rendezvous endpoint its ranks
met at; on a loopback address, the host too: two single-node jobs on two nodes may both meet
at ``127.0.0.1:29500``). Two jobs at once, or one after another, never share ranks, slots,
thresholds or incidents. Within one job, ``JobState`` tells its runs apart (a restart by the
launcher, a rerun at the same endpoint).

A job is *over* once each of its ranks has ended or its process is gone. An over job is kept
(``status`` shows how it ended) until a new rank process registers anywhere (a rerun through
``torchrun --standalone`` meets at a new port, with a new run id: nothing but the old job's end
ties the two), until it has been over for ``OVER_KEPT_S``, or until ``MAX_JOBS`` needs its room.
A live job is never retired. Retiring a job ends its
run: the engine resolves the run's open incidents (``ended_incarnations`` says why). A new job that
would exceed ``MAX_JOBS`` live jobs is refused (``JobsFull``), never merged into another.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

from hangwatch import records as r
from hangwatch.diagnosis.budget import Ledger
from hangwatch.diagnosis.lag import Lag
from hangwatch.diagnosis.state import SILENT_GONE_S, ClaimRefused, JobState, RankState
from hangwatch.serving import is_loopback

#: Jobs one coordinator follows at once (live or over); beyond it the oldest over job goes.
MAX_JOBS = 64
#: A job that has no rank (every registration refused) this long is over.
EMPTY_JOB_S = 60.0
#: How long an over job's state is kept for ``status`` before it is retired.
OVER_KEPT_S = 3600.0
#: Runs whose end is remembered (why their incidents were resolved).
ENDED_KEPT = 1024


#: Sessions of retired jobs whose rank had ended or died, kept to refuse them again.
FINISHED_KEPT = 65536


class JobsFull(Exception):
    """A new job when ``MAX_JOBS`` jobs are live."""


class SessionOver(ClaimRefused):
    """A registration of a session whose rank ended in a job no longer followed: the process is
    on its way out (interpreter teardown, DataLoader workers joining), and its node agent, told
    the session is unknown, registers it again. It must not begin a new run of its job, whose
    ranks would then be seen to "die" with no word of their end."""


def job_key(identity: r.RankIdentity) -> str:
    """``job_id@launch``: the launch's endpoint, with the host when the endpoint is loopback;
    the id alone when no endpoint is known (a job initialised from a ``tcp://`` URL)."""
    launch = identity.launch
    if not launch:
        return identity.job_id
    addr = launch.rsplit(":", 1)[0].strip("[]")
    if not addr or addr == "localhost" or is_loopback(addr):
        return f"{identity.job_id}@{identity.host}/{launch}"
    return f"{identity.job_id}@{launch}"


class Jobs:
    """Every job this coordinator follows, by key, in the order they began."""

    def __init__(self, ledger: Ledger | None = None) -> None:
        #: what every job holds against the coordinator's memory budgets (``budget``)
        self.ledger = ledger or Ledger()
        self.lag = Lag()  # how far behind the coordinator runs, over all its jobs
        self.by_key: collections.OrderedDict[str, JobState] = collections.OrderedDict()
        self.keys: dict[int, str] = {}  # id(JobState) -> its key
        self.sessions: dict[str, JobState] = {}  # session id -> its job
        #: run -> why it ended (the engine resolves its open incidents with this)
        self.ended_incarnations: collections.OrderedDict[str, str] = collections.OrderedDict()
        #: sessions whose rank ended or died in a retired job (``SessionOver``)
        self.finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.refused = 0  # registrations refused because MAX_JOBS jobs were live
        self.records_retired = 0  # records received by jobs no longer followed (a counter's base)

    @classmethod
    def of(cls, job: JobState) -> Jobs:
        """One job, already made (the detector tests' ``SimJob``)."""
        jobs = cls(job.ledger)
        jobs._add(job.job_id or "job", job)
        return jobs

    def __iter__(self) -> Iterator[JobState]:
        return iter(list(self.by_key.values()))

    def __len__(self) -> int:
        return len(self.by_key)

    def key_of(self, job: JobState) -> str:
        return self.keys.get(id(job), "")

    def _add(self, key: str, job: JobState) -> None:
        self.by_key[key] = job
        self.keys[id(job)] = key

    # ---- registration -------------------------------------------------------------------

    def register(self, identity: r.RankIdentity, now: float, via: str = "direct") -> tuple[JobState, RankState]:
        if identity.session in self.finished:
            raise SessionOver(f"rank {identity.rank}: its session ended, in a run no longer followed")
        key = job_key(identity)
        job = self.by_key.get(key)
        if identity.session not in self.sessions:  # a new process: over jobs of its id are reruns
            self.retire_over(now, rerun_of=identity.job_id, keep=job)
        made = job is None
        if job is None:
            if len(self.by_key) >= MAX_JOBS and via == "agent":
                self._retire_claims()  # a proven rank is never refused for jobs of claims alone
            if len(self.by_key) >= MAX_JOBS:
                self.refused += 1
                raise JobsFull(f"this coordinator already follows {MAX_JOBS} live jobs")
            job = JobState(self.ledger, self.lag)
            self._add(key, job)
        run = job.incarnation
        previous = job.ranks.get(identity.rank)
        try:
            state = job.register(identity, now, via)
        except Exception:
            if made:  # its first registration refused: no job was begun
                self.by_key.pop(key, None)
                self.keys.pop(id(job), None)
            raise
        if previous is not None and previous.identity.session != identity.session:
            self.sessions.pop(previous.identity.session, None)  # that process's session is over
        job.joined(identity.rank)
        if job.incarnation != run:
            self._ended(run, "the job's run ended (a new run of it began)")
            self.sessions = {s: j for s, j in self.sessions.items() if j is not job or s in job.sessions}
        self.sessions[identity.session] = job
        return job, state

    def join(self, identity: r.RankIdentity, now: float) -> JobState | None:
        """A process started as a rank of a job, not joined yet (``identity.phase``): its job
        begins with it where none has (None: it ended before any of it was known)."""
        key = job_key(identity)
        job = self.by_key.get(key)
        if job is None:
            if identity.phase == r.GONE:
                return None
            self.retire_over(now, rerun_of=identity.job_id)
            if len(self.by_key) >= MAX_JOBS:
                self.refused += 1
                raise JobsFull(f"this coordinator already follows {MAX_JOBS} live jobs")
            job = JobState(self.ledger, self.lag)
            self._add(key, job)
        job.join(identity, now)
        return job

    def for_session(self, session: str) -> JobState | None:
        job = self.sessions.get(session)
        if job is None or session not in job.sessions:
            return None
        return job

    # ---- which jobs -------------------------------------------------------------------------

    def current(self) -> JobState:
        """The job a query without ``--job`` is about: the latest to begin of those with a live
        rank, else the latest to begin (an empty state when there is none)."""
        jobs = list(self.by_key.values())
        live = [j for j in jobs if not over(j)]
        return (live or jobs or [JobState(Ledger(self.ledger.budget))])[-1]

    def find(self, selector: str) -> list[JobState]:
        """Jobs a ``--job`` selector names: a key, a job id or a run, exactly; else a prefix of
        one (``train`` never selects ``train-big`` when a job ``train`` exists)."""
        exact = [job for key, job in self.by_key.items() if selector in (key, job.job_id, job.incarnation)]
        if exact:
            return exact
        return [
            job
            for key, job in self.by_key.items()
            if any(s.startswith(selector) for s in (key, job.job_id, job.incarnation) if s)
        ]

    def for_incarnation(self, run: str) -> JobState | None:
        return next((j for j in self.by_key.values() if j.incarnation == run), None)

    def holding(self, target: r.Target) -> RankState | None:
        """The rank a process target belongs to, in whichever job."""
        for job in self.by_key.values():
            st = job.ranks.get(target.rank)
            if st is not None and st.identity.pid == target.pid and st.identity.start_time == target.start_time:
                return st
        return None

    def ranks(self) -> Iterator[RankState]:
        for job in list(self.by_key.values()):
            yield from job.ranks.values()

    # ---- retirement -------------------------------------------------------------------------

    def retire_over(self, now: float, rerun_of: str | None = None, keep: JobState | None = None) -> None:
        """Retire over jobs: all of them when a new process registers (``rerun_of``: its job id;
        ``keep``: the job it registers in), else those kept past ``OVER_KEPT_S``; and the oldest
        over jobs while ``MAX_JOBS`` are followed. A rerun through ``torchrun --standalone`` has
        a new endpoint and a new run id: only the ended job's being over tells it apart from a
        job running beside it."""
        for key, job in list(self.by_key.items()):
            if not over(job, now) or job is keep:
                continue
            if rerun_of is not None:
                self._retire(
                    key,
                    "the job's run ended (a new run of it began)"
                    if job.job_id == rerun_of
                    else "the job ended (its ranks are gone, and another job began)",
                )
            elif now - last_seen(job) > OVER_KEPT_S:
                self._retire(key, "the job ended")
        for key, job in list(self.by_key.items()):
            if len(self.by_key) < MAX_JOBS:
                break
            if over(job, now) and job is not keep:
                self._retire(key, "the job ended")

    def _retire_claims(self) -> None:
        """Retire the oldest job that no agent proved a rank of."""
        for key, job in self.by_key.items():
            if not any(st.proven for st in job.ranks.values()):
                self._retire(key, "retired for a job with proven ranks (none of its own was proven)")
                return

    def _retire(self, key: str, why: str) -> None:
        job = self.by_key.pop(key)
        self.keys.pop(id(job), None)
        self.records_retired += job.records_received
        self.ledger.held -= job.held  # all it held goes with it
        self.sessions = {s: j for s, j in self.sessions.items() if j is not job}
        for st in job.ranks.values():
            if st.end is not None or not st.alive:
                self.finished[st.identity.session] = None
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        self._ended(job.incarnation, why)

    def _ended(self, run: str, why: str) -> None:
        self.ended_incarnations[run] = why
        while len(self.ended_incarnations) > ENDED_KEPT:
            self.ended_incarnations.popitem(last=False)


def over(job: JobState, now: float | None = None) -> bool:
    """Every rank of the job has ended, is gone, or has been silent for ``SILENT_GONE_S`` (a job
    left with no rank, its registrations refused, is over after a minute)."""
    now = time.time() if now is None else now
    if not job.ranks:
        return not job.joiners_live() and now - job.started > EMPTY_JOB_S
    return all(st.end is not None or not st.alive or now - st.last_seen > SILENT_GONE_S for st in job.ranks.values())


def last_seen(job: JobState) -> float:
    return max((st.last_seen for st in job.ranks.values()), default=job.started)
