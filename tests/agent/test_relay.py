"""The node agent as a relay, with a real coordinator and a real relay server on port 0, and ranks
speaking through the rank's real transport: batches are gathered into fewer upstream calls, the
coordinator's replies reach the ranks unchanged (a restart included), and a coordinator that is
down or a relay that is full costs a rank a prompt error, never a wait without bound."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest

from hangwatch import records as r
from hangwatch.agent.relay import Relay, RelayServer
from hangwatch.client.transport import Transport
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from tests.conftest import wait_for

TOKEN = "s3cret"


def ident(rank: int, world: int = 4) -> r.RankIdentity:
    return r.RankIdentity("job", rank, world, "node-a", 20_000 + rank, session=uuid.uuid4().hex)


def calls(rank: int, first: int, n: int, shape: tuple[int, ...] = (8,)) -> list[r.RankEvent]:
    out: list[r.RankEvent] = []
    for seq in range(first, first + n):
        out.append(
            r.CallRecord(
                rank=rank,
                call_id=seq,
                op="all_reduce",
                group="0",
                seq=seq,
                inputs=(r.TensorMeta(shape, "float32"),),
                reduce_op="sum",
                call_site="train.py:12 in step",
                enter_time=time.time(),
            )
        )
        out.append(r.CallExit(rank, seq, time.time() + 0.001))
    return out


@pytest.fixture
def relays() -> Iterator[Callable[..., RelayServer]]:
    started: list[RelayServer] = []

    def make(coordinator_port: int, **kwargs: object) -> RelayServer:
        relay = Relay(f"127.0.0.1:{coordinator_port}", TOKEN, "node-a", **kwargs)  # type: ignore[arg-type]
        server = RelayServer(relay, TOKEN)
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def test_ranks_batches_reach_the_coordinator_in_fewer_calls(
    coordinator_factory: Callable[..., Coordinator], relays: Callable[..., RelayServer]
) -> None:
    c = coordinator_factory(token=TOKEN, embedded_agent=False)
    relay = relays(c.port, interval_s=0.2)
    ranks = [ident(k) for k in range(4)]
    transports = [Transport(relay.addr, TOKEN) for _ in ranks]
    for t, i in zip(transports, ranks, strict=True):
        assert t.register(i).coordinator_id == c.coordinator_id  # forwarded as is
    replies: list[pb.ReportReply] = []

    def rank_loop(k: int) -> None:
        for b in range(5):
            replies.append(transports[k].report(ranks[k], b + 1, calls(k, 1 + 3 * b, 3), 0, 0))

    threads = [threading.Thread(target=rank_loop, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert len(replies) == 20 and all(x.accepted == 6 and not x.reregister for x in replies)
    assert relay.relay.forwarded_reports == 20
    assert relay.relay.upstream_calls < 20  # gathered: several ranks' batches per call
    for k in range(4):
        assert [c.seq for c in c.job.ranks[k].history["0"]] == list(range(1, 16))
        assert c.job.ranks[k].relay == "node-a"
    # the CLI's queries pass through too
    with grpc.insecure_channel(relay.addr) as channel:
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        status = json.loads(stub.GetStatus(pb.QueryRequest(token=TOKEN), timeout=5).json)
        assert len(status["ranks"]) == 4
        with pytest.raises(grpc.RpcError) as err:
            stub.AgentPoll(pb.AgentPollRequest(token=TOKEN), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_mismatch_through_the_relay_is_diagnosed(
    coordinator_factory: Callable[..., Coordinator], relays: Callable[..., RelayServer]
) -> None:
    c = coordinator_factory(token=TOKEN, embedded_agent=False)
    relay = relays(c.port)
    ranks = [ident(k, 2) for k in range(2)]
    t = Transport(relay.addr, TOKEN)
    for k, shape in ((0, (1, 5)), (1, (1, 2, 5))):
        t.register(ranks[k])
        t.report(ranks[k], 1, calls(k, 1, 1, shape)[:1], 0, 0)
    inc = wait_for(lambda: c.incidents_json(), 5, 0.05, "an incident")[0]
    assert inc["kind"] == "shape_mismatch"


def test_coordinator_restart_reaches_the_rank_through_the_relay(
    coordinator_factory: Callable[..., Coordinator], relays: Callable[..., RelayServer]
) -> None:
    first = coordinator_factory(token=TOKEN, embedded_agent=False)
    port = first.port
    relay = relays(port)
    me = ident(0, 1)
    t = Transport(relay.addr, TOKEN)
    t.register(me)
    assert t.report(me, 1, calls(0, 1, 2), 0, 0).accepted == 4
    first.stop(grace=0.2)
    second = coordinator_factory(token=TOKEN, embedded_agent=False, port=port)
    events = calls(0, 3, 2)
    ack = wait_for(lambda: _try(lambda: t.report(me, 2, events, 0, 0)), 15, 0.2, "the restarted coordinator")
    assert ack.reregister  # the new coordinator does not know the session: the rank hears it
    assert t.register(me).coordinator_id == second.coordinator_id
    assert t.report(me, 2, events, 0, 0).accepted == 4  # the same batch, signatures sent again
    assert [c.seq for c in second.job.ranks[0].history["0"]] == [3, 4]


def test_down_coordinator_wrong_token_and_full_relay_fail_fast(
    coordinator_factory: Callable[..., Coordinator], relays: Callable[..., RelayServer]
) -> None:
    c = coordinator_factory(token=TOKEN, embedded_agent=False)
    relay = relays(c.port)
    me = ident(0, 1)
    t = Transport(relay.addr, TOKEN)
    t.register(me)
    with pytest.raises(grpc.RpcError) as err:
        Transport(relay.addr, "wrong").report(me, 1, calls(0, 1, 1), 0, 0)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert relay.relay.upstream_calls == 0  # refused at the relay: nothing went upstream
    c.stop(grace=0.2)
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        t.report(me, 1, calls(0, 1, 1), 0, 0)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert time.monotonic() - began < t.timeout_s + 1  # bounded by the rank's own deadline
    full = relays(c.port, max_pending=0)
    with pytest.raises(grpc.RpcError) as err:
        Transport(full.addr, TOKEN).report(me, 1, calls(0, 1, 1), 0, 0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert full.relay.refused_full == 1


def _try(fn: Callable[[], pb.ReportReply]) -> pb.ReportReply | None:
    try:
        return fn()
    except grpc.RpcError:
        return None


def test_urgent_batches_skip_the_gathering(
    coordinator_factory: Callable[..., Coordinator], relays: Callable[..., RelayServer]
) -> None:
    """A rank flushing a call of a new kind waits for the reply: the relay must not hold it for
    its gathering interval (here 5 s, against the rank's 0.5 s flush timeout)."""
    c = coordinator_factory(token=TOKEN, embedded_agent=False)
    relay = relays(c.port, interval_s=5.0)
    me = ident(0, 1)
    t = Transport(relay.addr, TOKEN, timeout_s=10.0)
    t.register(me)
    t.report(me, 1, calls(0, 1, 1), 0, 0)  # the first call goes at once; the next would gather
    began = time.monotonic()
    assert t.report(me, 2, calls(0, 2, 1), 0, 0, urgent=True).accepted == 2
    assert time.monotonic() - began < 2.5
    assert relay.relay.upstream_calls == 2


def test_a_dumps_import_through_the_relay_reaches_the_coordinator(
    coordinator_factory: Callable[..., Coordinator], relays: Callable[..., RelayServer]
) -> None:
    """``hangwatch analyze --import`` from a node whose ranks point at their relay."""
    from hangwatch.cli.client import CoordinatorUnreachable, import_dumps
    from hangwatch.postmortem import dumps, packed

    c = coordinator_factory(token=TOKEN, embedded_agent=False)
    relay = relays(c.port)
    empty = packed.pack(dumps.Folder())[0]
    with pytest.raises(CoordinatorUnreachable, match=r"via relay: .*no job 'nope'"):
        import_dumps(relay.addr, empty, token=TOKEN, job="nope")
    Transport(relay.addr, TOKEN).register(ident(0))
    result = import_dumps(relay.addr, empty, token=TOKEN)
    assert (result["job"], result["attached"], result["added"]) == ("job", [], [])
