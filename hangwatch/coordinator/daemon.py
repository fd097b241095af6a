"""The coordinator daemon: the composition root that wires state, detectors, store, agents, gRPC.

coordinator = Coordinator(CoordinatorOptions(port=0, data_dir="/tmp/hw"))
coordinator.start()          # serves on coordinator.port; returns immediately
...
coordinator.stop()
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from hangwatch import config, tls
from hangwatch import records as r
from hangwatch.coordinator import abort, imports, queries
from hangwatch.coordinator.agents import AgentHub
from hangwatch.coordinator.alerts import WebhookAlerter
from hangwatch.coordinator.intake import Intake
from hangwatch.coordinator.metrics import MetricsServer
from hangwatch.coordinator.options import MAX_STEADY_READ_S, ConfigError, CoordinatorOptions, report_interval_for
from hangwatch.coordinator.server import BindError, RpcServer
from hangwatch.coordinator.servicer import BLOCKING, CoordinatorServicer
from hangwatch.coordinator.store import IncidentStore
from hangwatch.diagnosis import budget
from hangwatch.diagnosis.engine import UNPROVEN, Engine
from hangwatch.diagnosis.jobs import Jobs
from hangwatch.diagnosis.state import JobState
from hangwatch.postmortem.dumps import Folder
from hangwatch.serving import host_port, is_loopback
from hangwatch.signatures import CallDecoder
from hangwatch.stackviews import dump_json

if TYPE_CHECKING:
    from hangwatch.agent.rings import RingServer
    from hangwatch.agent.shipper import Shipper

log = logging.getLogger("hangwatch.coordinator")

TICK_S = 0.25
AGENT_POLL_S = 0.5
STORE_RETRY_S = 5.0  # how often incidents a failed write left in memory are written again


__all__ = ["ConfigError", "Coordinator", "CoordinatorOptions", "report_interval_for"]


class Coordinator(Intake):
    def __init__(self, options: CoordinatorOptions) -> None:
        if not is_loopback(options.host) and not options.token and not options.allow_insecure_bind:
            raise ConfigError(
                f"refusing to listen on {options.host} without a token: pass --token (or set "
                f"{config.ENV_TOKEN}), or --allow-insecure-bind on a trusted network"
            )
        self.options = options
        self.coordinator_id = uuid.uuid4().hex[:12]
        #: ranks' batches may carry runs of alike calls (``records.CallRun``); ``HANGWATCH_RUNS=0``: not
        self.takes_runs = config.env_flag(config.ENV_RUNS, True)
        steady = options.steady_read_s
        if steady is not None and not 0.0 <= steady <= MAX_STEADY_READ_S:
            raise ConfigError(f"steady reads {steady} s apart: from 0 to {MAX_STEADY_READ_S:g} s")
        self.steady_read = steady
        self.lock = threading.RLock()
        self.importing = threading.Lock()  # one import of dumps analysed at a time
        try:
            limits = budget.Budget.of_mb(options.rank_budget_mb, options.job_budget_mb, options.memory_budget_mb)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.jobs = Jobs(budget.Ledger(limits))
        self.decoders: dict[str, CallDecoder] = {}  # session -> its interned call signatures
        self.store = IncidentStore(options.data_dir, max_bytes=int(options.max_data_mb * 1024 * 1024))
        embedded = None
        if options.embedded_agent:
            from hangwatch.agent.core import NodeAgentCore

            embedded = NodeAgentCore()
        self.hub = AgentHub(embedded)
        self.engine = Engine(
            self.jobs,
            self.lock,
            stuck_after=options.stuck_after,
            silence_after=options.silence_after,
            request_stacks=self._request_stacks,
            persist=self.store.save,
            next_id=self._next_id,
        )
        for incident in self.store.load():
            self.engine.incidents[incident.id] = incident
            self.engine.by_key[incident.key] = incident.id
        self._id_counter = self.store.next_number()
        self.rejected: dict[str, int] = {}
        self._apply_failed = False
        self.started = time.time()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.server: RpcServer | None = None
        self.port = 0
        if options.abort_on_hang:
            self.engine.listeners.append(lambda incident: abort.after(self, incident))
        self.alerter: WebhookAlerter | None = None
        if options.alert_webhook:
            self.alerter = WebhookAlerter(options.alert_webhook)
            self.engine.listeners.append(self.alerter)
            self.engine.update_listeners.append(self.alerter.updated)
        self.metrics: MetricsServer | None = None
        self.rings: RingServer | None = None
        self.shipper: Shipper | None = None  # the embedded agent's, once rank links are served

    @property
    def job(self) -> JobState:
        """The job a query without ``--job`` is about (``Jobs.current``)."""
        return self.jobs.current()

    def _next_id(self) -> str:
        ident = f"inc-{self._id_counter:04d}"
        self._id_counter += 1
        return ident

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> int:
        credentials = None
        if self.options.tls_cert or self.options.tls_key:
            if not (self.options.tls_cert and self.options.tls_key):
                raise ConfigError("TLS needs both --tls-cert and --tls-key")
            credentials = tls.server_credentials(
                self.options.tls_cert, self.options.tls_key, self.options.tls_client_ca
            )
        server = RpcServer(
            CoordinatorServicer(self),
            host_port(self.options.host, self.options.port),
            credentials=credentials,
            blocking=BLOCKING,
            blocking_workers=self.options.max_workers,
            on_late=lambda late: self.jobs.lag.observe(time.time(), late, "loop"),
            options=[
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ],
        )
        try:
            port = server.start()
        except BindError as exc:
            server.stop(0)
            raise ConfigError(str(exc)) from None
        self.server = server
        self.port = port
        if self.options.metrics_port:
            self.metrics = MetricsServer(self, self.options.host, self.options.metrics_port)
            self.metrics.start()
        self._spawn(self._detect_loop, "hangwatch-detect")
        if self.hub.embedded is not None:
            self._spawn(self._embedded_agent_loop, "hangwatch-agent")
            self._start_rank_links(port)
        if self.options.token and not self.options.agent_token:
            log.warning(
                "agents authenticate with the ranks' token: any process holding it can pose as a node agent "
                "(set --agent-token / %s, and give it to agents only)",
                config.ENV_AGENT_TOKEN,
            )
        log.info("coordinator %s listening on %s:%d", self.coordinator_id, self.options.host, port)
        return port

    @property
    def addr(self) -> str:
        host = self.options.host
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return host_port(host, self.port)

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        if self.rings is not None:
            self.rings.changed.set()  # the rank links' loop may sleep up to a second
        if self.server is not None:
            self.server.stop(grace)
        for thread in self._threads:
            thread.join(2.0)
        if self.metrics is not None:
            self.metrics.stop()
        if self.alerter is not None:
            self.alerter.close()
        if self.rings is not None:
            self.rings.stop()
        self.hub.close()
        self.store.close()

    def wait(self) -> None:
        while not self._stop.wait(1.0):
            pass

    def _detect_loop(self) -> None:
        retry_at = 0.0
        while not self._stop.wait(TICK_S):
            try:
                self.engine.tick()
                if self.store.unsaved and time.monotonic() >= retry_at:
                    retry_at = time.monotonic() + STORE_RETRY_S
                    with self.lock:
                        if self.store.retry():
                            log.info("incidents written again: the data directory takes writes")
            except Exception:
                log.exception("detection tick failed")

    def _start_rank_links(self, port: int) -> None:
        """The embedded agent's rank links: ranks on this node whose ``HANGWATCH_ADDR`` names this
        coordinator's port find its socket (``config.agent_socket_path``), hand it their rings,
        and are read from here. Without it (another user's ranks, a socket that cannot be made)
        ranks ship their own records, as before."""
        from hangwatch.agent.rings import RingServer
        from hangwatch.agent.shipper import Shipper

        core = self.hub.embedded
        assert core is not None
        try:
            path = self.options.agent_socket or config.agent_socket_path(f"127.0.0.1:{port}")
            self.rings = RingServer(path, proofs=core.proofs)
            self.rings.start()
        except OSError as e:
            log.warning("no rank links on this node (%s): ranks will ship their own records", e)
            self.rings = None
            return
        shipper = self.shipper = Shipper(self.rings, self, self.hub.embedded_host, core.inspector)
        self._spawn(lambda: shipper.run(self._stop), "hangwatch-rings")
        log.info("rank links on %s", path)

    def _embedded_agent_loop(self) -> None:
        core = self.hub.embedded
        assert core is not None
        host = self.hub.embedded_host
        while not self._stop.wait(AGENT_POLL_S):
            try:
                core.set_targets(self.targets_on(host, include_remote_hosts=False))
                statuses = core.poll()
                if statuses:
                    self.apply_process_statuses(host, statuses)
            except Exception:
                log.exception("embedded agent poll failed")

    # ---- stacks and abort -----------------------------------------------------------------

    def hosts(self, targets: list[r.Target]) -> dict[int, str]:
        """Where each target's process runs (targets of one job: their ranks are distinct)."""
        with self.lock:
            return {t.rank: st.identity.host for t in targets if (st := self.jobs.holding(t)) is not None}

    def _request_stacks(self, targets: list[r.Target], native: bool, callback: Any) -> None:
        self.hub.request_stacks(targets, self.hosts(targets), native, callback)

    def select_job(self, selector: str = "") -> JobState | None:
        """The job ``--job`` names (a key, job id or run, or a prefix of one; the latest of several
        that match), or the current one; None when the selector names none."""
        with self.lock:
            if not selector:
                return self.jobs.current()
            found = self.jobs.find(selector)
            return found[-1] if found else None

    def dump_stacks(self, ranks: list[int] | None, native: bool, job_selector: str = "") -> dict[str, Any] | None:
        job = self.select_job(job_selector)
        if job is None:
            return None
        with self.lock:
            chosen = sorted(job.ranks) if ranks is None else [rk for rk in ranks if rk in job.ranks]
            targets = [job.ranks[rk].target() for rk in chosen if job.ranks[rk].proven]
            unproven = [rk for rk in chosen if not job.ranks[rk].proven]
        if not chosen:
            return None
        dumps = self.hub.dump_now(targets, self.hosts(targets), native) if targets else {}
        for rk in unproven:
            dumps[rk] = r.StackDump(job.ranks[rk].identity.pid, time.time(), error=UNPROVEN)
        return {str(rk): dump_json(d) for rk, d in sorted(dumps.items())}

    # ---- queries --------------------------------------------------------------------------

    def import_payload(self, data: bytes, job_selector: str = "") -> dict[str, Any] | None:
        """As :func:`imports.import_payload`."""
        return imports.import_payload(self, data, job_selector)

    def import_dumps(self, folder: Folder, job_selector: str = "") -> dict[str, Any] | None:
        """As :func:`imports.import_dumps`."""
        return imports.import_dumps(self, folder, job_selector)

    def incidents_json(self, job_selector: str = "") -> list[dict[str, Any]]:
        """As :func:`queries.incidents_json`."""
        return queries.incidents_json(self, job_selector)

    def incident_json(self, incident_id: str) -> dict[str, Any] | None:
        with self.lock:
            inc = self.engine.incidents.get(incident_id)
            return inc.to_json() if inc else None

    def status(self, job_selector: str = "") -> dict[str, Any] | None:
        """As :func:`queries.status`."""
        return queries.status(self, job_selector)
