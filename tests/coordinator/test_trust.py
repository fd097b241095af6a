"""What a client may claim: agents authenticate as agents, and the coordinator's own host is its
embedded agent's. A real coordinator on port 0, called over gRPC as a hostile client would."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from hangwatch import records as r
from hangwatch import wire
from hangwatch.client.transport import Transport
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from tests import factories
from tests.factories import identity

JOB, AGENT = "job-token", "agent-token"


@pytest.fixture
def stub_for(coordinator_factory: Callable[..., Coordinator]) -> Iterator[Callable[..., pb_grpc.CoordinatorStub]]:
    channels: list[grpc.Channel] = []

    def make(**options: object) -> pb_grpc.CoordinatorStub:
        c = coordinator_factory(**options)
        channel = grpc.insecure_channel(f"127.0.0.1:{c.port}")
        channels.append(channel)
        return pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]

    yield make
    for channel in channels:
        channel.close()


def _code(call: Callable[[], object]) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return,attr-defined]
    return None


def _register(token: str, via: str = "direct", rank: int = 0) -> pb.RegisterRequest:
    req = pb.RegisterRequest(token=token, via=via)
    wire.identity_to_pb(identity(rank, 2, session=f"s{rank}{via}"), req.identity)
    return req


def test_agent_calls_need_the_agent_credential_that_ranks_do_not_hold(
    stub_for: Callable[..., pb_grpc.CoordinatorStub],
) -> None:
    stub = stub_for(token=JOB, agent_token=AGENT, embedded_agent=False)
    agent = pb.AgentIdentity(host="node-7", pid=1)
    denied = grpc.StatusCode.UNAUTHENTICATED
    # a rank's token cannot register an agent, poll as one, relay, or vouch for a rank's proof
    assert _code(lambda: stub.RegisterAgent(pb.AgentRegisterRequest(token=JOB, agent=agent), timeout=5)) == denied
    assert _code(lambda: stub.AgentPoll(pb.AgentPollRequest(token=JOB, agent_id="x"), timeout=5)) == denied
    assert _code(lambda: stub.ReportMany(pb.RelayBatch(token=JOB, relay_host="node-7"), timeout=5)) == denied
    assert _code(lambda: stub.Register(_register(JOB, via="agent"), timeout=5)) == denied
    # what ranks do still works with their token; the agent's credential does all of it
    assert _code(lambda: stub.Register(_register(JOB, rank=1), timeout=5)) is None
    assert _code(lambda: stub.RegisterAgent(pb.AgentRegisterRequest(token=AGENT, agent=agent), timeout=5)) is None
    assert _code(lambda: stub.Register(_register(AGENT, via="agent"), timeout=5)) is None
    assert _code(lambda: stub.GetStatus(pb.QueryRequest(token=JOB), timeout=5)) is None


def test_the_coordinator_s_own_host_cannot_be_taken_by_a_remote_agent(
    stub_for: Callable[..., pb_grpc.CoordinatorStub],
) -> None:
    stub = stub_for(token=JOB)
    own = pb.AgentIdentity(host=socket.gethostname(), pid=1)
    code = _code(lambda: stub.RegisterAgent(pb.AgentRegisterRequest(token=JOB, agent=own), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    other = pb.AgentIdentity(host="node-7", pid=1)
    assert _code(lambda: stub.RegisterAgent(pb.AgentRegisterRequest(token=JOB, agent=other), timeout=5)) is None


def test_huge_strings_are_cut_at_ingest_and_counted(coordinator_factory: Callable[..., Coordinator]) -> None:
    """A call site of 8 MiB (and an op name of 1 MiB) in every batch: each record keeps a bounded
    cut of it with a marker, and the cut is counted in status."""
    c = coordinator_factory(embedded_agent=False)
    t = Transport(f"127.0.0.1:{c.port}", None)
    ident = r.RankIdentity("job", 0, 1, "host-a", 4242, session="big")
    t.register(ident)
    huge = "x" * (8 * 1024 * 1024)
    for seq in range(1, 4):
        record = factories.call(0, seq, "all_reduce", call_id=seq, call_site=huge, enter_time=time.time())
        t.report(ident, seq, [record], 0, 0)
    history = c.job.ranks[0].history["0"]
    assert len(history) == 3
    assert all(len(call.call_site) == wire.MAX_SITE + len(wire.TRUNCATED) for call in history)
    assert history[0].call_site.endswith(wire.TRUNCATED)
    assert c.status()["job"]["rejected"]["truncated"] >= 3
    t.close()
