"""The node agent as a relay: its node's ranks talk to it, it talks to the coordinator.

Without a relay every rank holds a connection to the coordinator and sends it a few RPCs a
second, so the coordinator's connection count and RPC rate grow with the ranks. With one, ranks
point ``HANGWATCH_ADDR`` at their node's agent; the agent forwards ``Register`` (and the CLI's
queries) as they come, and gathers ``Report`` batches for at most ``interval_s`` into one
``ReportMany``: the coordinator sees one connection and about ``1 / interval_s`` RPCs a second
per node, whatever the number of ranks on it.

A rank's ``Report`` is answered with the coordinator's own reply to its batch (so "register
again" reaches the rank exactly as without a relay), or fails with UNAVAILABLE when the
coordinator cannot be reached: the rank keeps its batch and resends it, as it would anyway.
The relay holds at most ``max_pending`` batches; beyond that it answers RESOURCE_EXHAUSTED at
once, and the rank's own bounded queue takes the strain. Nothing here waits without a bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, NoReturn

import grpc

from hangwatch import tls
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos.hangwatch_pb2_grpc import CoordinatorStub
from hangwatch.serving import TOKEN_REFUSED, add_service, token_ok

log = logging.getLogger(__name__)

#: The least time between two upstream calls: batches arriving meanwhile gather into the next one
#: (urgent ones, which a rank is waiting on, go at once).
DEFAULT_INTERVAL_S = 0.5
MAX_INTERVAL_S = 1.0  # however large the job
MAX_PENDING = 4096  # batches waiting for the next upstream call
MAX_REPORTS_PER_CALL = 1024  # the coordinator accepts up to 4096
UPSTREAM_TIMEOUT_S = 5.0
#: A rank's Report waits at most this long for its batch to be forwarded (its own deadline is 2 s).
WAIT_S = 1.8

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class _Waiting:
    """One rank's batch until the upstream reply for it arrives."""

    __slots__ = ("done", "error", "received", "reply", "report")

    def __init__(self, report: pb.ReportBatch) -> None:
        self.report = report
        self.received = time.monotonic()
        self.done = threading.Event()
        self.reply: pb.ReportReply | None = None
        self.error = ""


class Relay:
    """Forwards batches upstream; transport-agnostic on the rank side (``submit`` is called by
    the gRPC servicer below, or directly by a load generator)."""

    def __init__(
        self,
        coordinator: str,
        token: str | None,
        host: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_pending: int = MAX_PENDING,
        channel_factory: Callable[[], grpc.Channel] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.token = token or ""
        self.host = host
        self.interval_s = self.base_interval_s = interval_s
        self.max_pending = max_pending
        self._channel = (channel_factory or (lambda: tls.channel(coordinator, CHANNEL_OPTIONS)))()
        self.stub = CoordinatorStub(self._channel)  # type: ignore[no-untyped-call]
        self._pending: list[_Waiting] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._urgent = threading.Event()
        self._stop = threading.Event()
        self._last_call = 0.0
        self._thread: threading.Thread | None = None
        # counters, for the agent's log and the bench
        self.forwarded_reports = 0
        self.upstream_calls = 0
        self.upstream_failures = 0
        self.refused_full = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hangwatch-relay", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(UPSTREAM_TIMEOUT_S + 1)
        self._fail_all("relay stopping")
        self._channel.close()

    # ---- the rank side ----------------------------------------------------------------------

    def submit(self, report: pb.ReportBatch, wait_s: float = WAIT_S) -> pb.ReportReply | str:
        """Queue one rank's batch and wait for the coordinator's reply to it, or a reason why
        there is none (the rank then resends)."""
        waiting = _Waiting(report)
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self.refused_full += 1
                return "full"
            self._pending.append(waiting)
            first = len(self._pending) == 1
        if report.urgent:  # a rank waits on it (a call of a new kind): no gathering
            self._urgent.set()
            self._wake.set()
        elif first:
            self._wake.set()
        if not waiting.done.wait(wait_s):
            with self._lock:  # still queued: take it back, the rank will resend it
                if waiting in self._pending:
                    self._pending.remove(waiting)
                    return "timeout"
            waiting.done.wait(UPSTREAM_TIMEOUT_S)  # already on its way: its reply comes soon
        return waiting.reply if waiting.reply is not None else (waiting.error or "timeout")

    def register(self, request: pb.RegisterRequest, timeout: float) -> pb.RegisterReply:
        reply: pb.RegisterReply = self.stub.Register(request, timeout=timeout)
        # a large job's ranks report less often (the coordinator says how often): gather longer
        # too, so the coordinator's call rate stays bounded as nodes are added
        self.interval_s = max(self.base_interval_s, min(reply.report_interval_s / 2, MAX_INTERVAL_S))
        return reply

    # ---- the coordinator side -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                break
            # gather: at most one upstream call per interval, unless a batch is urgent
            delay = self._last_call + self.interval_s - time.monotonic()
            if delay > 0 and not self._urgent.is_set():
                self._urgent.wait(delay)
            self._urgent.clear()
            self._last_call = time.monotonic()
            while True:
                with self._lock:
                    batch, self._pending = self._pending[:MAX_REPORTS_PER_CALL], self._pending[MAX_REPORTS_PER_CALL:]
                if not batch:
                    break
                self._forward(batch)
                if len(batch) < MAX_REPORTS_PER_CALL:
                    break

    def _forward(self, batch: list[_Waiting]) -> None:
        request = pb.RelayBatch(token=self.token, relay_host=self.host)
        now = time.monotonic()
        for w in batch:  # the coordinator takes the holding time out of its clock-offset estimate
            w.report.relay_held_s = now - w.received
        request.reports.extend(w.report for w in batch)
        self.upstream_calls += 1
        try:
            reply: pb.RelayReply = self.stub.ReportMany(request, timeout=UPSTREAM_TIMEOUT_S)
        except grpc.RpcError as exc:
            self.upstream_failures += 1
            if self.upstream_failures == 1 or self.upstream_failures % 100 == 0:
                log.warning("relay: coordinator %s: %s", self.coordinator, _describe(exc))
            for w in batch:
                w.error = "unavailable"
                w.done.set()
            return
        self.forwarded_reports += len(batch)
        for i, w in enumerate(batch):
            w.reply = reply.replies[i] if i < len(reply.replies) else None
            w.error = "" if w.reply is not None else "no reply"
            w.done.set()

    def _fail_all(self, why: str) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for w in batch:
            w.error = why
            w.done.set()


def _describe(e: grpc.RpcError) -> str:
    call: object = e
    if isinstance(call, grpc.Call):
        return f"{call.code().name}: {call.details()}"
    return repr(e)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable")


class RelayServicer:
    """The ``Coordinator`` service as a rank (or the CLI) sees it on its node's agent."""

    def __init__(self, relay: Relay, token: str | None) -> None:
        self.relay = relay
        self.token = token or ""

    def _auth(self, token: str, context: grpc.ServicerContext) -> None:
        if not token_ok(self.token, token):
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSED)

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        self._auth(request.token, context)
        reply: pb.RegisterReply = self._forward(
            context, lambda: self.relay.register(request, timeout=_deadline(context))
        )
        return reply

    def Report(self, request: pb.ReportBatch, context: grpc.ServicerContext) -> pb.ReportReply:
        self._auth(request.token, context)
        request.token = ""  # the relay's own token vouches for it upstream
        result = self.relay.submit(request, min(WAIT_S, _deadline(context)))
        if isinstance(result, str):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if result == "full" else grpc.StatusCode.UNAVAILABLE
            _abort(context, code, f"relay could not forward the batch ({result}); resend it")
        return result

    def _forward(self, context: grpc.ServicerContext, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except grpc.RpcError as exc:
            inner: object = exc
            code = inner.code() if isinstance(inner, grpc.Call) else grpc.StatusCode.UNAVAILABLE
            _abort(context, code, f"via relay: {_describe(exc)}")

    def _query(self, name: str, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        method = getattr(self.relay.stub, name)
        return self._forward(context, lambda: method(request, timeout=_deadline(context)))  # type: ignore[no-any-return]

    def GetStatus(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        return self._query("GetStatus", request, context)

    def ListIncidents(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        return self._query("ListIncidents", request, context)

    def GetIncident(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        return self._query("GetIncident", request, context)

    def DumpStacks(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        return self._query("DumpStacks", request, context)

    def ImportDumps(self, request: pb.ImportRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        call = self.relay.stub.ImportDumps
        return self._forward(context, lambda: call(request, timeout=_deadline(context)))  # type: ignore[no-any-return]

    def _not_here(self, context: grpc.ServicerContext) -> NoReturn:
        _abort(context, grpc.StatusCode.UNIMPLEMENTED, "this is a relaying node agent, not the coordinator")

    def ReportMany(self, request: pb.RelayBatch, context: grpc.ServicerContext) -> pb.RelayReply:
        self._not_here(context)

    def RegisterAgent(self, request: pb.AgentRegisterRequest, context: grpc.ServicerContext) -> pb.AgentRegisterReply:
        self._not_here(context)

    def AgentPoll(self, request: pb.AgentPollRequest, context: grpc.ServicerContext) -> pb.AgentPollReply:
        self._not_here(context)


def _deadline(context: grpc.ServicerContext) -> float:
    remaining = context.time_remaining()
    return UPSTREAM_TIMEOUT_S if remaining is None else max(0.1, min(UPSTREAM_TIMEOUT_S, remaining - 0.1))


class RelayServer:
    """The relay's gRPC server on this node (``host:port``; port 0 picks a free one)."""

    def __init__(
        self,
        relay: Relay,
        token: str | None,
        host: str = "127.0.0.1",
        port: int = 0,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.relay = relay
        # one thread per rank waiting for its batch to go upstream: size for a big node
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="hangwatch-relay-rpc"),
            options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)],
        )
        add_service(RelayServicer(relay, token), self.server)
        bind = f"{host}:{port}"
        self.port = (
            self.server.add_secure_port(bind, credentials) if credentials else self.server.add_insecure_port(bind)
        )
        if self.port == 0:
            raise OSError(f"relay cannot listen on {host}:{port} (in use?)")
        self.host = host

    def start(self) -> None:
        self.relay.start()
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=1.0)
        self.relay.stop()

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"
