"""The remote agent loop against a small real gRPC coordinator that follows the proto's contract."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from hangwatch.agent.core import NodeAgentCore
from hangwatch.agent.daemon import run_agent
from hangwatch.agent.pyspy import find_pyspy, ptrace_diagnosis
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from hangwatch.testing import free_port

from .conftest import Spawn, target, wait_until

TOKEN = "s3cret"
SLEEPER = "import threading, time\nprint('ready', flush=True)\ntime.sleep(60)\n"


class FakeCoordinator(pb_grpc.CoordinatorServicer):
    """Records what agents send; holds polls up to ``wait_s`` unless a command is queued."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.registrations: list[pb.AgentRegisterRequest] = []
        self.polls: list[pb.AgentPollRequest] = []
        self.known: set[str] = set()
        self.watch: list[pb.Target] = []
        self.commands: list[pb.Command] = []

    def RegisterAgent(self, request: pb.AgentRegisterRequest, context: grpc.ServicerContext) -> pb.AgentRegisterReply:
        if request.token != TOKEN:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        with self.cond:
            self.registrations.append(request)
            agent_id = f"agent-{len(self.registrations)}"
            self.known.add(agent_id)
        return pb.AgentRegisterReply(agent_id=agent_id, coordinator_id="fake")

    def AgentPoll(self, request: pb.AgentPollRequest, context: grpc.ServicerContext) -> pb.AgentPollReply:
        with self.cond:
            self.polls.append(request)
            if request.token != TOKEN or request.agent_id not in self.known:
                return pb.AgentPollReply(reregister=True)
            self.cond.wait_for(lambda: bool(self.commands), timeout=min(request.wait_s, 1.0))
            commands, self.commands = self.commands, []
            return pb.AgentPollReply(watch=self.watch, commands=commands)

    def results(self) -> dict[int, pb.CommandResult]:
        with self.cond:
            return {r.id: r for p in self.polls for r in p.results}


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


@pytest.mark.skipif(find_pyspy() is None, reason="py-spy not installed")
def test_agent_waits_for_coordinator_then_serves_it(
    spawn: Spawn, stop: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="hangwatch.agent.daemon")
    rank = target(spawn(SLEEPER, "rank1"), rank=1)
    port = free_port()
    core = NodeAgentCore(host="node-b")
    core.proofs.add(rank.pid, os.getuid(), rank.start_time, rank.link)  # as its link to the agent would
    agent = threading.Thread(
        target=run_agent,
        args=(f"127.0.0.1:{port}",),
        kwargs={"token": TOKEN, "stop": stop, "poll_wait_s": 0.3, "core": core},
    )
    agent.start()
    wait_until(lambda: any("retrying" in r.getMessage() for r in caplog.records))  # coordinator down

    fake = FakeCoordinator()
    fake.watch = [pb.Target(rank=1, pid=rank.pid, start_time=rank.start_time, link=rank.link)]
    fake.commands = [pb.Command(id=7, dump=pb.DumpCommand(targets=fake.watch, native=False, timeout_s=5.0))]
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CoordinatorServicer_to_server(fake, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        wait_until(lambda: 7 in fake.results(), timeout=15.0)
        reg = fake.registrations[0]
        assert (reg.agent.host, reg.agent.embedded) == ("node-b", False)
        assert (reg.agent.can_ptrace, reg.agent.ptrace_note) == ptrace_diagnosis()
        (stack,) = fake.results()[7].stacks
        assert (stack.rank, stack.pid, stack.error) == (1, rank.pid, "")
        assert stack.threads[0].name == "MainThread" and stack.threads[0].frames[0].line == 3
        statuses = [s for p in fake.polls for s in p.processes]
        assert any(s.pid == rank.pid and s.state == "sleeping" for s in statuses)

        with fake.cond:
            fake.known.clear()  # the coordinator forgot the agent (e.g. restarted)
        wait_until(lambda: len(fake.registrations) == 2)
        wait_until(lambda: fake.polls[-1].agent_id == "agent-2")
        stop.set()
        agent.join(timeout=5.0)
        assert not agent.is_alive()
    finally:
        stop.set()
        server.stop(0)
