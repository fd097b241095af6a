"""The coordinator's options, checked where they are used (``Coordinator.__init__``)."""

from __future__ import annotations

from dataclasses import dataclass

from hangwatch import config
from hangwatch.diagnosis import budget


class ConfigError(ValueError):
    """Options that would make the coordinator unsafe or unusable."""


@dataclass
class CoordinatorOptions:
    host: str = config.DEFAULT_HOST
    port: int = config.DEFAULT_PORT
    data_dir: str = config.DEFAULT_DATA_DIR
    token: str | None = None
    #: node agents' own credential: RegisterAgent, AgentPoll, relayed batches and registrations of
    #: the ranks an agent proved need it (None: agents present ``token``, as ranks do)
    agent_token: str | None = None
    stuck_after: float | None = None
    silence_after: float = config.DEFAULT_SILENCE_AFTER_S
    embedded_agent: bool = True
    abort_on_hang: bool = False
    allow_insecure_bind: bool = False
    max_workers: int = 64  # threads for the RPCs that wait (agent long polls, stack dumps, queries)
    metrics_port: int = 0  # 0: no /metrics endpoint
    max_data_mb: float = config.DEFAULT_MAX_DATA_MB  # incident store cap; oldest pruned first
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require client certificates signed by this CA
    alert_webhook: str | None = None
    agent_socket: str | None = None  # the embedded agent's socket for rank links (default: config)
    #: memory budgets in MiB: what one rank, one job and the whole coordinator may hold
    #: (``coordinator.budget``); calls beyond them are refused and counted
    rank_budget_mb: float = budget.DEFAULT_RANK_MB
    job_budget_mb: float | None = None  # None: budget.DEFAULT_JOB_MB, grown with the job's ranks
    memory_budget_mb: float = budget.DEFAULT_TOTAL_MB
    #: how far apart node agents read a steady rank's ring (None: ``steady_read_for`` the job)
    steady_read_s: float | None = None


def report_interval_for(world_size: int) -> float:
    """How often ranks should send: every 0.2 s up to ~200 ranks, then less often as the job
    grows (1 s at 1,024 ranks, 2 s from 2,048), so that ranks talking to the coordinator directly
    make about 1,000 RPCs a second at most (each costs the coordinator a few hundred microseconds
    whatever it carries). Calls of a new kind and a rank's end are flushed at once whatever this
    says, so mismatches and early exits are not delayed by it; heartbeats stay well inside the
    5 s after which a silent rank counts as frozen."""
    return max(0.2, min(2.0, world_size / 1024))


#: The furthest apart a node agent reads a steady rank's ring (``agent.shipped.MAX_PACE_S``).
MAX_STEADY_READ_S = 5.0


def steady_read_for(world_size: int) -> float:
    """How far apart node agents read the ring of a rank in a steady state: as it reports up to
    8,192 ranks, then further apart (4 s at 16,384, 5 s from 20,480). A batch costs the
    coordinator about the same whatever it carries (a node agent folds a steady rank's calls
    into one entry): fewer, larger batches are what lets one process follow such a job. Between
    reads the agent says the rank is alive as often as it reports (``ReportBatch.unread``), and
    it reads at once a rank that goes quiet or stays inside a call, so waits, freezes, ends and
    hangs are heard as before; only a steady rank's calls come later."""
    return max(report_interval_for(world_size), min(MAX_STEADY_READ_S, world_size / 4096))
