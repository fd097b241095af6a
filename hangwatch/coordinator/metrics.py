"""Prometheus metrics for the coordinator, in the text exposition format, on ``/metrics``.

A few gauges and counters, computed from the coordinator's state on each scrape; the HTTP
server is the standard library's, on its own daemon thread.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from hangwatch import wire
from hangwatch.diagnosis.views import rank_state
from hangwatch.kinds import IncidentKind
from hangwatch.serving import token_ok

if TYPE_CHECKING:
    from hangwatch.coordinator.daemon import Coordinator

STATES = ("running", "waiting", "frozen", "exited", "died")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Rate:
    """Records received per second between two scrapes."""

    def __init__(self) -> None:
        self.last = (time.monotonic(), 0)

    def update(self, total: int) -> float:
        now = time.monotonic()
        then, before = self.last
        self.last = (now, total)
        return (total - before) / (now - then) if now > then else 0.0


def render(c: Coordinator, rate: _Rate) -> str:
    now = time.time()
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value:g}" for labels, value in samples)

    with c.lock:
        ranks = list(c.jobs.ranks())
        states: dict[tuple[str, str], int] = {}
        progress: list[tuple[str, float]] = []
        for job in c.jobs:
            key = _escape(c.jobs.key_of(job))
            for s in STATES:
                states[(key, s)] = 0
            for st in job.ranks.values():
                word, _ = rank_state(st, now, c.options.silence_after)
                states[(key, word)] = states.get((key, word), 0) + 1
                progress.append((f'{{job="{key}",rank="{st.rank}"}}', max(0.0, now - st.last_progress)))
        by_kind = dict.fromkeys((k.value for k in IncidentKind), 0)
        open_count = 0
        for inc in c.engine.incidents.values():
            by_kind[inc.kind] = by_kind.get(inc.kind, 0) + 1
            open_count += inc.status == "open"
        received = c.jobs.records_retired + sum(job.records_received for job in c.jobs)
        dropped = sum(st.dropped for st in ranks)
        rejected = {**c.rejected, "truncated": wire.truncated}
        write_errors = c.store.write_errors
        ledger = c.jobs.ledger
        held: list[tuple[str, float]] = [(f'{{job="{c.jobs.key_of(job)}"}}', job.held) for job in c.jobs]
        limits: list[tuple[str, float]] = [
            (f'{{scope="{k}"}}', getattr(ledger.budget, k)) for k in ("rank", "job", "total")
        ]
        refused: list[tuple[str, float]] = [(f'{{scope="{k}"}}', n) for k, n in sorted(ledger.refused_by.items())]
        trimmed = ledger.trimmed
        behind = max([c.jobs.lag.behind(now), *(job.behind(now) for job in c.jobs)])
    metric(
        "hangwatch_ranks",
        "gauge",
        "Registered ranks by job and state.",
        [(f'{{job="{j}",state="{s}"}}', n) for (j, s), n in sorted(states.items())],
    )
    metric(
        "hangwatch_rank_seconds_since_progress",
        "gauge",
        "Seconds since each rank last entered or left a call, or stepped.",
        progress,
    )
    metric(
        "hangwatch_incidents_total",
        "counter",
        "Incidents diagnosed, by kind.",
        [(f'{{kind="{_escape(k)}"}}', n) for k, n in sorted(by_kind.items())],
    )
    metric("hangwatch_incidents_open", "gauge", "Incidents not yet resolved.", [("", open_count)])
    metric(
        "hangwatch_coordinator_behind_seconds",
        "gauge",
        "Seconds the coordinator hears its ranks late (its queue, its transport): silences this long blame no rank.",
        [("", behind)],
    )
    metric("hangwatch_records_received_total", "counter", "Call records received from ranks.", [("", received)])
    metric(
        "hangwatch_records_dropped_total",
        "counter",
        "Events the ranks dropped because their bounded queue was full.",
        [("", dropped)],
    )
    metric(
        "hangwatch_ingest_records_per_second",
        "gauge",
        "Records received per second since the last scrape.",
        [("", rate.update(received))],
    )
    metric(
        "hangwatch_messages_rejected_total",
        "counter",
        "Messages refused, by reason.",
        [(f'{{reason="{_escape(k)}"}}', n) for k, n in sorted(rejected.items())],
    )
    metric("hangwatch_budget_held_bytes", "gauge", "Bytes each job's tables hold (estimated upward).", held)
    metric("hangwatch_budget_limit_bytes", "gauge", "Memory budgets: per rank, per job, in all.", limits)
    metric(
        "hangwatch_budget_refused_total",
        "counter",
        "Calls, groups and registrations refused because a memory budget was spent, by budget.",
        refused,
    )
    metric(
        "hangwatch_budget_trimmed_total",
        "counter",
        "History records let go early to make room in a rank's budget.",
        [("", trimmed)],
    )
    metric(
        "hangwatch_store_write_errors_total",
        "counter",
        "Incident writes that failed (disk full?).",
        [("", write_errors)],
    )
    return "\n".join(lines) + "\n"


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """``/metrics`` for Prometheus; with a token set, scrapes present it as a bearer token
    (``authorization: {credentials: ...}`` in the scrape config)."""

    def __init__(self, coordinator: Coordinator, host: str, port: int) -> None:
        rate = _Rate()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics here")
                    return
                token = coordinator.options.token
                presented = self.headers.get("Authorization", "")
                if token and not token_ok(token, presented.removeprefix("Bearer ")):
                    coordinator.metrics_rejected("auth")
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Bearer realm="hangwatch"')
                    self.end_headers()
                    return
                body = render(coordinator, rate).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        bare = host.strip("[]")
        server_class = _V6Server if ":" in bare else ThreadingHTTPServer
        self.httpd = server_class((bare, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="hangwatch-metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
