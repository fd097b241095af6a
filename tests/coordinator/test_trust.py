"""What a client may claim: agents authenticate as agents, and the coordinator's own host is its
embedded agent's. A real coordinator on port 0, called over gRPC as a hostile client would."""

from __future__ import annotations

import json
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


def test_non_finite_times_are_refused_and_status_stays_json(coordinator_factory: Callable[..., Coordinator]) -> None:
    c = coordinator_factory(embedded_agent=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{c.port}")
    stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
    stub.Register(_register(""), timeout=5)
    batch = pb.ReportBatch(session="s0direct", rank=0, sent_time=time.time())
    for t in (float("nan"), float("inf")):
        wire.call_to_pb(factories.call(0, 1, enter_time=t), batch.events.add().call)
    batch.events.add().step.CopyFrom(pb.Step(step=3, time=float("nan")))
    stub.Report(batch, timeout=5)
    assert c.job.ranks[0].history == {} and c.job.ranks[0].step == 0
    assert c.rejected.get("malformed") == 3
    json.loads(json.dumps(c.status(), allow_nan=False))  # valid JSON: no NaN anywhere
    channel.close()


def test_control_characters_never_reach_a_terminal() -> None:
    """An op name or call site with ANSI escapes (a fake coloured line in ``report``)."""
    msg = pb.Call(op="all_reduce\x1b[31m", call_site="train.py:1 in f\x1b[2J\nFAKE LINE", error="line 1\nline 2\x07")
    call = wire.call_from_pb(0, msg)
    assert "\x1b" not in call.op + call.call_site and "\n" not in call.call_site
    assert call.error == "line 1\nline 2\ufffd"  # a traceback keeps its lines


def test_metrics_need_the_token_when_one_is_set(coordinator_factory: Callable[..., Coordinator]) -> None:
    import urllib.error
    import urllib.request

    from tests.coordinator.test_service import _free_port

    c = coordinator_factory(token=JOB, metrics_port=_free_port(), embedded_agent=False)
    assert c.metrics is not None
    url = f"http://127.0.0.1:{c.metrics.port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=5)
    assert refused.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {JOB}"})
    assert "hangwatch_incidents_open" in urllib.request.urlopen(request, timeout=5).read().decode()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_loopback_is_a_loopback(coordinator_factory: Callable[..., Coordinator], host: str) -> None:
    c = coordinator_factory(host=host, embedded_agent=False)  # no token needed: loopback
    assert c.addr == f"[::1]:{c.port}"
    channel = grpc.insecure_channel(c.addr)
    stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
    assert json.loads(stub.GetStatus(pb.QueryRequest(), timeout=5).json)["job"]["registered"] == 0
    channel.close()


def test_a_remote_agent_s_refusal_to_abort_comes_back_to_whoever_asked(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    """The abort command goes out with an agent's poll; its answer (signalled pids, refused
    ranks and why) comes back with the next poll and reaches the abort's caller."""
    c = coordinator_factory(embedded_agent=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{c.port}")
    stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
    agent_id = stub.RegisterAgent(pb.AgentRegisterRequest(agent=pb.AgentIdentity(host="node-7", pid=1)), timeout=5)
    outcome: list[tuple[list[int], dict[int, str]]] = []
    target = r.Target(0, 4242, 1.0)
    c.hub.abort([target], {0: "node-7"}, on_result=lambda pids, refused: outcome.append((pids, refused)))
    reply = stub.AgentPoll(pb.AgentPollRequest(agent_id=agent_id.agent_id, wait_s=1.0), timeout=5)
    (command,) = reply.commands
    assert command.WhichOneof("body") == "abort"
    answer = pb.CommandResult(id=command.id, refused={0: "pid 4242 never linked to this node's agent"})
    stub.AgentPoll(pb.AgentPollRequest(agent_id=agent_id.agent_id, results=[answer], wait_s=0.0), timeout=5)
    assert outcome == [([], {0: "pid 4242 never linked to this node's agent"})]
    channel.close()


def test_a_process_status_lands_on_its_own_job_s_rank_not_on_a_pid_twin(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    """Two pods of one image on a node: both ranks are pid 42 in their own namespaces."""
    c = coordinator_factory(embedded_agent=False)
    a = r.RankIdentity("A", 0, 1, "node1", 42, start_time=1000.0, session="a", launch="10.0.0.1:1")
    b = r.RankIdentity("B", 0, 1, "node1", 42, start_time=1050.0, session="b", launch="10.0.0.2:1")
    for ident in (a, b):
        c.register_rank(ident, via="agent")
    c.apply_process_statuses("node1", [r.ProcessStatus(42, r.ProcState.DEAD, 1100.0, start_time=1000.0)])
    job_a, job_b = c.jobs.find("A")[0], c.jobs.find("B")[0]
    assert not job_a.ranks[0].alive and job_b.ranks[0].alive
