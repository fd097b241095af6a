"""The remote node agent: long-polls the coordinator, reports process health, runs its commands.

One unary ``AgentPoll`` per round carries the changed process statuses and the results of
finished commands up, and brings the watch list and new commands down. Commands run in worker
threads so polling goes on meanwhile. Coordinator errors are logged, never raised: the loop
reconnects with capped exponential backoff until ``stop`` is set.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

import hangwatch
from hangwatch import tls, wire
from hangwatch.agent.core import NodeAgentCore
from hangwatch.agent.pyspy import ptrace_diagnosis
from hangwatch.agent.rings import RingServer
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos.hangwatch_pb2_grpc import CoordinatorStub
from hangwatch.records import ProcessStatus, Target
from hangwatch.wire import process_status_to_pb, stack_dump_to_pb

log = logging.getLogger(__name__)

#: Deadline of RegisterAgent, and of AgentPoll beyond the time the coordinator may hold it.
RPC_TIMEOUT_S = 5.0
BACKOFF_INITIAL_S = 0.25
BACKOFF_MAX_S = 10.0
#: Floor between two polls when a coordinator answers at once with nothing to do.
MIN_POLL_INTERVAL_S = 0.1
DEFAULT_DUMP_TIMEOUT_S = 10.0
DEFAULT_GRACE_S = 10.0


def _describe(e: grpc.RpcError) -> str:
    call: object = e  # errors from stubs are also grpc.Call, which the stubs cannot express
    if isinstance(call, grpc.Call):
        return f"{call.code().name}: {call.details()}"
    return repr(e)


def _targets(msgs: Iterable[pb.Target]) -> list[Target]:
    return [Target(t.rank, t.pid, t.start_time, t.pid_namespace, t.link) for t in msgs]


class _RemoteIntake:
    """The coordinator's intake as a remote agent's shipper reaches it: over gRPC. A process
    seen gone goes up with the agent's next poll (at most one long-poll wait later)."""

    def __init__(self, stub: CoordinatorStub, agent: _Agent) -> None:
        self.stub = stub
        self.agent = agent

    def accept_registration(self, identity: Any, via: str = "direct") -> pb.RegisterReply:
        req = pb.RegisterRequest(token=self.agent.token, via=via)
        wire.identity_to_pb(identity, req.identity)
        try:
            reply: pb.RegisterReply = self.stub.Register(req, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            call: object = e  # errors from stubs are also grpc.Call, which the stubs cannot express
            if isinstance(call, grpc.Call) and call.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(call.details()) from None
            raise
        return reply

    def accept_report(self, request: pb.ReportBatch, relay: str = "") -> pb.ReportReply:
        return self.accept_reports([request])[0]

    def accept_reports(self, requests: list[pb.ReportBatch]) -> list[pb.ReportReply]:
        """Sent as relayed batches, so the coordinator knows which agent carries the ranks; a
        reply missing is "register again"."""
        relayed = pb.RelayBatch(token=self.agent.token, relay_host=self.agent.core.host, reports=requests)
        reply: pb.RelayReply = self.stub.ReportMany(relayed, timeout=RPC_TIMEOUT_S)
        replies = list(reply.replies)
        return replies + [pb.ReportReply(reregister=True) for _ in range(len(requests) - len(replies))]

    def apply_process_statuses(self, host: str, statuses: list[ProcessStatus]) -> None:
        with self.agent._lock:
            self.agent.gone.extend(statuses)


class _Agent:
    def __init__(self, core: NodeAgentCore, token: str) -> None:
        self.core = core
        self.token = token
        self.gone: list[ProcessStatus] = []  # ranks whose link closed, for the next poll
        self._results: list[pb.CommandResult] = []
        self._lock = threading.Lock()
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hangwatch-agent-cmd")

    def register(self, stub: CoordinatorStub) -> str:
        can_ptrace, note = ptrace_diagnosis()
        identity = pb.AgentIdentity(
            host=self.core.host,
            pid=os.getpid(),
            version=hangwatch.__version__,
            embedded=False,
            can_ptrace=can_ptrace,
            ptrace_note=note,
        )
        reply = stub.RegisterAgent(pb.AgentRegisterRequest(token=self.token, agent=identity), timeout=RPC_TIMEOUT_S)
        log.info("registered with the coordinator as agent %s", reply.agent_id)
        return str(reply.agent_id)

    def poll(self, stub: CoordinatorStub, agent_id: str, full: bool, wait_s: float) -> pb.AgentPollReply:
        with self._lock:
            results, self._results = self._results, []
            gone, self.gone = self.gone, []
        req = pb.AgentPollRequest(token=self.token, agent_id=agent_id, results=results, wait_s=wait_s)
        for status in [*gone, *self.core.poll(full=full)]:
            process_status_to_pb(status, req.processes.add())
        try:
            reply: pb.AgentPollReply = stub.AgentPoll(req, timeout=wait_s + RPC_TIMEOUT_S)
        except grpc.RpcError:
            with self._lock:  # deliver them with the next poll
                self._results[:0] = results
                self.gone[:0] = gone
            raise
        return reply

    def execute(self, cmd: pb.Command) -> None:
        result = pb.CommandResult(id=cmd.id)
        which = cmd.WhichOneof("body")
        try:
            if which == "dump":
                d = cmd.dump
                timeout = d.timeout_s or DEFAULT_DUMP_TIMEOUT_S
                for rank, dump in self.core.dump(_targets(d.targets), d.native, timeout).items():
                    stack_dump_to_pb(dump, rank, result.stacks.add())
            elif which == "abort":
                a = cmd.abort
                signalled, refused = self.core.abort_outcome(_targets(a.targets), a.grace_s or DEFAULT_GRACE_S)
                result.aborted_pids.extend(signalled)
                for rank, why in refused.items():
                    result.refused[rank] = why
            else:
                result.error = f"unsupported command {which!r}"
        except Exception as e:  # a command must never take the agent down
            log.exception("command %d (%s) failed", cmd.id, which)
            result.error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._results.append(result)


def run_agent(
    coordinator: str,
    *,
    token: str | None,
    stop: threading.Event,
    poll_wait_s: float = 2.0,
    core: NodeAgentCore | None = None,
    rank_socket: str | None = None,
    rank_socket_mode: int = 0o600,
) -> None:
    """Serve the coordinator at ``host:port`` until ``stop`` is set (within about ``poll_wait_s``).

    With ``rank_socket``, this node's ranks link to the agent there (a socket of mode
    ``rank_socket_mode``) and it ships their rings (:mod:`hangwatch.agent.shipper`) over the
    same channel."""
    agent = _Agent(core or NodeAgentCore(), token or "")
    backoff_ms = int(BACKOFF_MAX_S * 1000)
    options = [
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),  # else up to 120 s once the server is back
    ]
    channel = tls.channel(coordinator, options)
    stub = CoordinatorStub(channel)  # type: ignore[no-untyped-call]
    rings = _start_rank_links(rank_socket, stub, agent, stop, rank_socket_mode) if rank_socket else None
    agent_id = ""
    full = True
    delay = BACKOFF_INITIAL_S
    failures = 0
    try:
        while not stop.is_set():
            began = time.monotonic()
            try:
                if not agent_id:
                    agent_id = agent.register(stub)
                    full = True
                reply = agent.poll(stub, agent_id, full, poll_wait_s)
            except grpc.RpcError as e:
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "coordinator %s: %s (retrying)", coordinator, _describe(e))
                full = True
                stop.wait(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            if failures:
                log.info("coordinator %s reachable again after %d failed calls", coordinator, failures)
            failures, delay, full = 0, BACKOFF_INITIAL_S, False
            if reply.reregister:
                agent_id = ""
                continue
            agent.core.set_targets(_targets(reply.watch))
            for cmd in reply.commands:
                agent.workers.submit(agent.execute, cmd)
            if not reply.commands:
                stop.wait(max(0.0, MIN_POLL_INTERVAL_S - (time.monotonic() - began)))
    finally:
        if rings is not None:
            rings.stop()
        agent.workers.shutdown(wait=False, cancel_futures=True)
        channel.close()


def _start_rank_links(
    path: str, stub: CoordinatorStub, agent: _Agent, stop: threading.Event, mode: int = 0o600
) -> RingServer | None:
    """This node's ranks link to the agent on ``path``; a thread ships their rings."""
    from hangwatch.agent.shipper import Shipper

    try:
        server = RingServer(path, mode=mode, proofs=agent.core.proofs)
        server.start()
    except OSError as e:
        log.warning("no rank links on %s (%s): ranks will ship their own records", path, e)
        return None
    shipper = Shipper(server, _RemoteIntake(stub, agent), agent.core.host, agent.core.inspector)

    threading.Thread(target=shipper.run, args=(stop,), name="hangwatch-rings", daemon=True).start()
    log.info("rank links on %s", path)
    return server
