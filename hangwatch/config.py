"""Every environment variable hangwatch reads, one documented constant each, and the defaults.

Precedence everywhere: command-line flag, then environment variable, then the default here.
This module imports nothing heavy: the in-rank bootstrap reads it at interpreter start.
"""

from __future__ import annotations

import os
import stat

# --- environment variables -------------------------------------------------------------

#: ``host:port`` of the coordinator. Setting it in a rank's environment attaches the hook.
ENV_ADDR = "HANGWATCH_ADDR"
#: ``1`` turns the in-rank hook off even when ``HANGWATCH_ADDR`` is set.
ENV_DISABLE = "HANGWATCH_DISABLE"
#: ``0``: a process its launcher started as a rank does not link to its node agent before
#: ``init_process_group`` returns (hangs before it, in ``init_process_group`` or before it is
#: entered, are then not seen).
ENV_JOINING = "HANGWATCH_JOINING"
#: The credential of node agents (registering agents and the ranks they proved, relaying
#: batches); without it agents present the job's token, which every rank holds.
ENV_AGENT_TOKEN = "HANGWATCH_AGENT_TOKEN"
ENV_AGENT_TOKEN_FILE = "HANGWATCH_AGENT_TOKEN_FILE"
#: A file holding the token (the command line shows a --token to every user in ps).
ENV_TOKEN_FILE = "HANGWATCH_TOKEN_FILE"
#: Shared secret; ranks, agents and CLI must present the coordinator's token.
ENV_TOKEN = "HANGWATCH_TOKEN"
#: Coordinator: server certificate and key (PEM) — setting both serves TLS.
ENV_TLS_CERT = "HANGWATCH_TLS_CERT"
ENV_TLS_KEY = "HANGWATCH_TLS_KEY"
#: Coordinator: CA bundle (PEM) that client certificates must chain to — setting it requires them.
ENV_TLS_CLIENT_CA = "HANGWATCH_TLS_CLIENT_CA"
#: Ranks, agents, CLI: CA bundle (PEM) to verify the coordinator — setting it connects with TLS.
ENV_TLS_CA = "HANGWATCH_TLS_CA"
#: Ranks, agents, CLI: client certificate and key (PEM), for a coordinator that requires them.
ENV_TLS_CLIENT_CERT = "HANGWATCH_TLS_CLIENT_CERT"
ENV_TLS_CLIENT_KEY = "HANGWATCH_TLS_CLIENT_KEY"
#: Job identifier reported by ranks (default: ``TORCHELASTIC_RUN_ID``, then ``default``).
ENV_JOB_ID = "HANGWATCH_JOB_ID"
#: Coordinator data directory (SQLite incident store).
ENV_DATA_DIR = "HANGWATCH_DATA_DIR"
#: Seconds a collective may wait before the hang detectors consider it stuck.
ENV_STUCK_AFTER = "HANGWATCH_STUCK_AFTER"
#: Slots of a rank's shared-memory ring (one record each); the oldest unread are overwritten
#: (and counted) when whoever reads the ring falls this far behind.
ENV_QUEUE_SIZE = "HANGWATCH_QUEUE_SIZE"
#: The node agent's Unix socket that ranks link to (default: ``agent-<port>.sock`` in this user's
#: private directory, ``<port>`` being the coordinator's, or the relay's, from ``HANGWATCH_ADDR``).
ENV_AGENT_SOCKET = "HANGWATCH_AGENT_SOCKET"
#: Seconds between heartbeats from a rank's sender thread.
ENV_HEARTBEAT = "HANGWATCH_HEARTBEAT"
#: Client log level (``debug``, ``info``, ``warning``; default ``warning``).
ENV_LOG_LEVEL = "HANGWATCH_LOG_LEVEL"
#: The node name a rank reports (default: hostname); it must match the ``--node-name`` of the node
#: agent that serves it (in Kubernetes, set both from the downward API's ``spec.nodeName``).
ENV_NODE_NAME = "HANGWATCH_NODE_NAME"
#: Set by the hook in a registered rank's environment: the pid of that rank. A process that
#: inherits it with a different pid is a subprocess of a rank and never registers itself.
ENV_RANK_PID = "HANGWATCH_RANK_PID"
#: Set with ``HANGWATCH_RANK_PID`` by a process that links as the rank its launcher says it will
#: be, before ``init_process_group`` (``client.joining``): that rank (``RANK/LOCAL_RANK``). A
#: process started by it with the same launcher variables is its subprocess; with others, a rank
#: of its own that it launched (Lightning's and ``mp.spawn``'s rank 0 starts the others).
ENV_RANK_OF = "HANGWATCH_RANK_OF"
#: ``0`` keeps the hook's fast path, and the node agent's gathering of runs, in Python even where
#: their C build (``client/_fastpath.c``) is installed (for A/B measurements and to rule it out);
#: default: C where built.
ENV_NATIVE = "HANGWATCH_NATIVE"
#: ``pip install``: ``1`` makes an install that cannot compile the C fast path fail, instead of
#: installing pure Python (``hatch_build.py``, which spells the name itself).
ENV_REQUIRE_NATIVE = "HANGWATCH_REQUIRE_NATIVE"
#: Coordinator: ``0`` takes every call one by one, no runs of alike calls (``records.CallRun``):
#: for A/B measurements and to rule runs out; default: runs.
ENV_RUNS = "HANGWATCH_RUNS"
#: Node agent (and the coordinator's embedded one): ``0`` reads every rank's ring every tick and
#: its Flight Recorder rings at every poll, whatever they show; default: a steady rank's ring
#: looked at every ``agent.shipped.STEADY_S`` and read every ``agent.shipped.READ_S`` (at once where the look
#: shows what a detector waits for), and a CPU Flight Recorder ring that Python calls account for
#: left unread (``flight_entries.PythonAccounts``). For A/B measurements and to rule them out.
ENV_READ_LESS = "HANGWATCH_READ_LESS"
#: ``0`` disables Flight Recorder polling (collectives issued from C++, e.g. DDP).
ENV_FLIGHT_RECORDER = "HANGWATCH_FLIGHT_RECORDER"
#: ``1`` aborts (terminates) the job's ranks once a hang is diagnosed and stored.
ENV_ABORT_ON_HANG = "HANGWATCH_ABORT_ON_HANG"
#: Size cap of the coordinator's incident store in MiB; the oldest incidents are pruned first.
ENV_MAX_DATA_MB = "HANGWATCH_MAX_DATA_MB"
#: Alert webhook URL, called with every new incident.
ENV_ALERT_WEBHOOK = "HANGWATCH_ALERT_WEBHOOK"
#: Port of the coordinator's Prometheus ``/metrics`` endpoint (``0``: off).
ENV_METRICS_PORT = "HANGWATCH_METRICS_PORT"
#: Node agent: port of its relay for this node's ranks (point their ``HANGWATCH_ADDR`` at it);
#: unset or ``0``: no relay, ranks talk to the coordinator directly.
ENV_RELAY_PORT = "HANGWATCH_RELAY_PORT"

# --- defaults --------------------------------------------------------------------------

#: Port the coordinator listens on when none is given; the CLI connects here by default.
DEFAULT_PORT = 29600
DEFAULT_HOST = "127.0.0.1"
DEFAULT_ADDR = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
#: Default Prometheus metrics port of the coordinator.
DEFAULT_METRICS_PORT = 29601
#: Port a relaying node agent listens on in the deploy/ examples (``--relay-port``).
DEFAULT_RELAY_PORT = 29602
DEFAULT_DATA_DIR = "./hangwatch-data"
DEFAULT_MAX_DATA_MB = 256.0
#: Upper bound of the adaptive stuck threshold (seconds) when ``--stuck-after`` is not given.
DEFAULT_STUCK_AFTER = 30.0
#: How long ranks may wait in ``init_process_group`` for the others before it is a hang, unless
#: ``--stuck-after`` is given: longer than any threshold a job's rhythm sets, for a rank may take
#: this long to start on a cold node (imports over a network file system, a container pull).
DEFAULT_INIT_AFTER = 60.0
#: Floor of the adaptive stuck threshold (seconds).
MIN_STUCK_AFTER = 5.0
DEFAULT_QUEUE_SIZE = 65536
DEFAULT_HEARTBEAT_S = 1.0
#: A rank whose heartbeats stop for this long while its process is alive is frozen.
DEFAULT_SILENCE_AFTER_S = 5.0
#: Ring size for PyTorch's Flight Recorder when the user has not chosen one.
DEFAULT_FR_BUFFER_SIZE = 256
#: How often a rank reads its Flight Recorder ring (C++-issued collectives reach the coordinator
#: up to this much later than the batches around them).
FR_POLL_INTERVAL_S = 1.0
#: However much a read costs the rank, a node agent reads its Flight Recorder rings at least this
#: often (``agent.flightrecorder``); the coordinator waits this long, and a batch's way, for a read
#: past a moment (``diagnosis.traces.TRACE_WAIT_S``).
FR_MAX_READ_EVERY_S = 20.0
#: A NCCL collective enqueued by every member whose start on the GPU is unknown (CUDA start
#: events off: ``TORCH_NCCL_ENABLE_TIMING`` unset) may still be waiting for compute queued before
#: it on the stream; it is called a transport stall only after this long (and 4x the stuck
#: threshold), where a started one is called so after the stuck threshold.
STALL_UNSTARTED_S = 120.0
DEFAULT_JOB_ID = "default"


def default_addr() -> str:
    """The coordinator address: ``HANGWATCH_ADDR`` or the documented default."""
    return os.environ.get(ENV_ADDR) or DEFAULT_ADDR


def env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        return default


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        return default


def _temp_dir() -> str:
    """Where temporary files go, as ``tempfile.gettempdir`` finds it for a writable system (without
    importing tempfile, most of what a hooked interpreter's start would cost)."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        d = os.environ.get(name)
        if d and os.path.isdir(d):
            return os.path.abspath(d)
    return "/tmp"


def private_dir() -> str:
    """``$XDG_RUNTIME_DIR/hangwatch`` (else ``<tmp>/hangwatch-<uid>``), created 0700; an error
    if it exists and is not a directory of this user that only this user can enter."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "hangwatch") if runtime else os.path.join(_temp_dir(), f"hangwatch-{os.getuid()}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{base} is not a private directory of this user (0700)")
    return base


def agent_socket_path(addr: str | None = None) -> str:
    """Where a rank finds its node agent: ``HANGWATCH_AGENT_SOCKET``, else the socket the
    coordinator's embedded agent (or a relaying agent) listening on ``addr``'s port opens."""
    explicit = os.environ.get(ENV_AGENT_SOCKET)
    if explicit:
        return explicit
    port = (addr or default_addr()).rsplit(":", 1)[-1]
    return os.path.join(private_dir(), f"agent-{port}.sock")


def launch_from_env() -> str:
    """Where the job's ranks met: its rendezvous endpoint, as the launcher set it."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{addr}:{port}" if addr or port else ""


def attempt_from_env() -> int:
    """The launcher's restart count: torchrun restarts every worker of a job on a failure."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def launcher_rank() -> str:
    """The rank the launcher gave this process, as ``HANGWATCH_RANK_OF`` holds it."""
    return f"{os.environ.get('RANK', '')}/{os.environ.get('LOCAL_RANK', '')}"


def inherited_rank() -> bool:
    """Whether this process inherited a rank's claim: a subprocess of that rank (a DataLoader
    worker, a tool it runs), which never links or registers as a rank itself."""
    owner = os.environ.get(ENV_RANK_PID)
    if not owner or owner == str(os.getpid()):
        return False
    claimed = os.environ.get(ENV_RANK_OF)
    return claimed is None or claimed == launcher_rank()


def job_id_from_env() -> str:
    return os.environ.get(ENV_JOB_ID) or os.environ.get("TORCHELASTIC_RUN_ID") or DEFAULT_JOB_ID
