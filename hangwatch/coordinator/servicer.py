"""The gRPC edge of the coordinator: authenticate, validate, convert, and hand over typed records.

Every handler checks the token first (UNAUTHENTICATED, no state change), bounds what it accepts
(INVALID_ARGUMENT with a clear message), and converts protobuf to records with
``hangwatch.wire`` before anything touches the job state.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from hangwatch import wire
from hangwatch.postmortem import dumps
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from hangwatch.serving import TOKEN_REFUSED, Refused, token_ok

if TYPE_CHECKING:
    from hangwatch.coordinator.daemon import Coordinator

log = logging.getLogger("hangwatch.coordinator")

MAX_EVENTS_PER_BATCH = 20_000
MAX_REPORTS_PER_RELAY = 4096
MAX_WORLD_SIZE = 1 << 20  # the largest world size a registration may claim
MAX_POLL_WAIT_S = 10.0


class IntakeError(ValueError):
    """A registration that cannot be accepted (from an RPC or a node agent); the message says why."""


class ImportBusy(Exception):
    """An import of dumps that cannot be taken now (another is under way, or no room for it)."""


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    raise Refused(code, message)  # the server's wrapper ends the call with it (serving.py)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    def _auth(self, token: str, context: grpc.ServicerContext) -> None:
        """The job's token (an agent's credential does too: an agent may do what a rank does)."""
        agent = self.c.options.agent_token
        if not token_ok(self.c.options.token, token) and not (agent is not None and token_ok(agent, token)):
            self.c.metrics_rejected("auth")
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSED)

    def _auth_agent(self, token: str, context: grpc.ServicerContext) -> None:
        """A node agent's call: the agent credential where one is set, else the job's token."""
        expected = self.c.options.agent_token
        if expected is None:
            self._auth(token, context)
        elif not token_ok(expected, token):
            self.c.metrics_rejected("auth")
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "this call needs the agent credential (--agent-token)")

    # ---- ranks ----------------------------------------------------------------------------

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        if request.via == "agent":  # a rank an agent proved through its link: only an agent says so
            self._auth_agent(request.token, context)
        else:
            self._auth(request.token, context)
        try:
            return self.c.accept_registration(wire.identity_from_pb(request.identity), request.via or "direct")
        except IntakeError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Report(self, request: pb.ReportBatch, context: grpc.ServicerContext) -> pb.ReportReply:
        self._auth(request.token, context)
        problem = self._oversized(request)
        if problem:
            self.c.metrics_rejected("oversized")
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        return self._report(request, "")

    def ReportMany(self, request: pb.RelayBatch, context: grpc.ServicerContext) -> pb.RelayReply:
        """A node agent's relayed batches: the relay's token vouches for them (it checked each
        rank's); each batch is bounded and applied exactly as if its rank had sent it."""
        self._auth_agent(request.token, context)
        if len(request.reports) > MAX_REPORTS_PER_RELAY:
            self.c.metrics_rejected("oversized")
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"relay batch of {len(request.reports)} reports exceeds the limit of {MAX_REPORTS_PER_RELAY}",
            )
        reply = pb.RelayReply()
        for report in request.reports:
            if self._oversized(report):
                self.c.metrics_rejected("oversized")
                reply.replies.add(server_time=time.time())  # refused: accepted = 0
                continue
            reply.replies.append(self._report(report, request.relay_host))
        reply.server_time = time.time()
        return reply

    @staticmethod
    def _oversized(request: pb.ReportBatch) -> str:
        events = len(request.events) + len(request.calls.signature) + len(request.signatures)
        # (steps in columns are events; a cycle's signatures, each one the decoder looks up)
        events += max(len(request.step_number), len(request.step_time)) + len(request.calls.run_signature)
        if events > MAX_EVENTS_PER_BATCH:
            return f"batch of {events} events exceeds the limit of {MAX_EVENTS_PER_BATCH}"
        return ""

    def _report(self, request: pb.ReportBatch, relay: str) -> pb.ReportReply:
        return self.c.accept_report(request, relay)

    # ---- agents ---------------------------------------------------------------------------

    def RegisterAgent(self, request: pb.AgentRegisterRequest, context: grpc.ServicerContext) -> pb.AgentRegisterReply:
        self._auth_agent(request.token, context)
        a = request.agent
        if not a.host:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "agent registration without a host name")
        if self.c.hub.embedded is not None and a.host == self.c.hub.embedded_host:
            self.c.metrics_rejected("agent")
            _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"host {a.host} is the coordinator's own: its embedded agent serves it and cannot be displaced",
            )
        agent = self.c.hub.register_remote(a.host, a.pid, a.can_ptrace, a.ptrace_note)
        return pb.AgentRegisterReply(agent_id=agent.agent_id, coordinator_id=self.c.coordinator_id)

    def AgentPoll(self, request: pb.AgentPollRequest, context: grpc.ServicerContext) -> pb.AgentPollReply:
        self._auth_agent(request.token, context)
        agent = self.c.hub.remote.get(request.agent_id)
        if agent is None:
            return pb.AgentPollReply(reregister=True)
        agent.last_poll = time.time()
        statuses = [wire.process_status_from_pb(p) for p in request.processes]
        if statuses:
            self.c.apply_process_statuses(agent.host, statuses)
        for result in request.results:
            if result.id in agent.aborting:
                self.c.hub.aborted(agent, result.id, list(result.aborted_pids), dict(result.refused))
                continue
            dumps = {d.rank: wire.stack_dump_from_pb(d) for d in result.stacks}
            self.c.hub.complete(agent, result.id, dumps)
        reply = pb.AgentPollReply()
        for target in self.c.targets_on(agent.host):
            reply.watch.add(
                rank=target.rank,
                pid=target.pid,
                start_time=target.start_time,
                pid_namespace=target.pid_namespace,
                link=target.link,
            )
        wait = min(max(request.wait_s, 0.0), MAX_POLL_WAIT_S)
        deadline = time.monotonic() + wait
        while True:
            try:
                timeout = max(0.0, deadline - time.monotonic())
                command = agent.commands.get(timeout=timeout) if timeout > 0 else agent.commands.get_nowait()
            except queue.Empty:
                break
            kind, command_id, targets, arg = command
            cmd = reply.commands.add(id=command_id)
            body: Any = cmd.dump if kind == "dump" else cmd.abort
            for t in targets:
                body.targets.add(
                    rank=t.rank, pid=t.pid, start_time=t.start_time, pid_namespace=t.pid_namespace, link=t.link
                )
            if kind == "dump":
                cmd.dump.native = bool(arg)
                cmd.dump.timeout_s = 10.0
            else:
                cmd.abort.grace_s = float(arg)
            deadline = 0.0  # got one: return promptly with whatever else is queued
        agent.last_poll = time.time()
        return reply

    # ---- queries --------------------------------------------------------------------------

    def GetStatus(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        self._auth(request.token, context)
        status = self.c.status(request.job)
        if status is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"no job {request.job!r}")
        return pb.JsonReply(json=json.dumps(status))

    def ListIncidents(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        self._auth(request.token, context)
        incidents = self.c.incidents_json(request.job)
        if request.limit:
            incidents = incidents[-request.limit :]
        return pb.JsonReply(json=json.dumps(incidents))

    def GetIncident(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        self._auth(request.token, context)
        incident = self.c.incident_json(request.id)
        if incident is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"no incident {request.id!r}")
        return pb.JsonReply(json=json.dumps(incident))

    def DumpStacks(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        self._auth(request.token, context)
        which = request.id or "all"
        try:
            ranks = None if which == "all" else [int(x) for x in which.split(",")]
        except ValueError:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"expected a rank number or 'all', got {which!r}")
        result = self.c.dump_stacks(ranks, request.native, request.job)
        if result is None:
            in_job = f" in job {request.job!r}" if request.job else ""
            _abort(context, grpc.StatusCode.NOT_FOUND, f"no registered rank {which}{in_job}")
        return pb.JsonReply(json=json.dumps(result))

    def ImportDumps(self, request: pb.ImportRequest, context: grpc.ServicerContext) -> pb.JsonReply:
        self._auth(request.token, context)
        try:
            result = self.c.import_payload(request.dumps, request.job)
        except dumps.DumpError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ImportBusy as exc:
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        if result is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"no job {request.job!r} to import the dumps into")
        return pb.JsonReply(json=json.dumps(result))


#: Handlers that wait (long polls, stack dumps), analyse (imports) or build large JSON replies: on
#: the coordinator's asyncio server they run in a thread pool, everything else on the event loop.
BLOCKING = frozenset({"AgentPoll", "DumpStacks", "GetStatus", "ListIncidents", "GetIncident", "ImportDumps"})
