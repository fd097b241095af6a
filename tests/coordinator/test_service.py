"""The coordinator's gRPC edge with real servers on port 0 and the rank's real transport:
registration, batches, authentication, bad input, restart persistence, metrics and webhooks."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import grpc
import pytest

from hangwatch import records as r
from hangwatch.agent import shipped
from hangwatch.client.transport import Transport
from hangwatch.columns import CallEncoder
from hangwatch.coordinator.daemon import ConfigError, Coordinator, CoordinatorOptions
from hangwatch.coordinator.servicer import MAX_EVENTS_PER_BATCH
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from tests import factories
from tests.conftest import wait_for


def identity(rank: int, world: int = 2) -> r.RankIdentity:
    return r.RankIdentity("job", rank, world, "host-a", 10_000 + rank, session=uuid.uuid4().hex)


def call(
    rank: int, seq: int, shape: tuple[int, ...], op: str = "all_reduce", call_id: int | None = None
) -> r.CallRecord:
    return factories.call(
        rank,
        seq,
        op,
        call_id=seq,
        shape=shape,
        reduce_op="sum",
        call_site=f"train.py:{10 + rank}",
        enter_time=time.time(),
    )


def send(t: Transport, ident: r.RankIdentity, events: list[r.RankEvent]) -> pb.ReportReply:
    return t.report(ident, 1, events, 0, 0)


def test_shape_mismatch_over_the_wire_within_a_second(coordinator_factory: Callable[..., Coordinator]) -> None:
    c = coordinator_factory(embedded_agent=False)
    t = Transport(f"127.0.0.1:{c.port}", None)
    ids = [identity(0), identity(1)]
    for ident in ids:
        t.register(ident)
    send(t, ids[0], [call(0, 1, (1, 5))])
    sent = time.time()
    send(t, ids[1], [call(1, 1, (1, 2, 5))])
    incidents = wait_for(lambda: c.incidents_json(), 5, 0.05, "an incident")
    assert time.time() - sent < 1.0  # mismatches within a second of the last involved call
    inc = incidents[0]
    assert inc["kind"] == "shape_mismatch"
    assert "[1, 5]" in inc["summary"] and "[1, 2, 5]" in inc["summary"]
    assert inc["culprit_ranks"] in ([0], [1])
    assert inc["stack_notes"]  # no agent: says why stacks are missing instead of failing


def test_wrong_token_is_refused_without_state_change(coordinator_factory: Callable[..., Coordinator]) -> None:
    c = coordinator_factory(token="s3cret", embedded_agent=False)
    bad = Transport(f"127.0.0.1:{c.port}", "nope")
    with pytest.raises(grpc.RpcError) as err:
        bad.register(identity(0))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in (err.value.details() or "")
    assert c.job.ranks == {}
    good = Transport(f"127.0.0.1:{c.port}", "s3cret")
    good.register(identity(0))
    assert list(c.job.ranks) == [0]


def test_invalid_and_unknown_input(coordinator_factory: Callable[..., Coordinator]) -> None:
    c = coordinator_factory(embedded_agent=False)
    t = Transport(f"127.0.0.1:{c.port}", None)
    with pytest.raises(grpc.RpcError) as err:
        t.register(r.RankIdentity("job", 5, 2, "h", 1, session="x"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a batch from a session that never registered: told to register, nothing applied
    reply = send(t, identity(0), [call(0, 1, (4,))])
    assert reply.reregister
    assert c.job.records_received == 0
    # malformed events are dropped and counted, the good ones kept
    ident = identity(0)
    t.register(ident)
    channel = grpc.insecure_channel(f"127.0.0.1:{c.port}")
    stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
    batch = pb.ReportBatch(job_id="job", rank=0, session=ident.session, sent_time=time.time())
    batch.events.add()  # empty event
    bad_dims = batch.events.add()
    bad_dims.call.op = "all_reduce"
    bad_dims.call.inputs.add().shape.extend([1] * 64)
    good = batch.events.add()
    good.call.op = "all_reduce"
    good.call.call_id = 7
    good.call.seq = 1
    ack = stub.Report(batch, timeout=5)
    assert ack.accepted == 1
    assert c.rejected.get("malformed") == 2
    channel.close()


def test_a_batch_of_more_steps_than_a_batch_may_carry_is_refused(coordinator: Coordinator) -> None:
    """Steps in columns (a node agent's) count as the events they stand for."""
    ident = identity(0)
    Transport(f"127.0.0.1:{coordinator.port}", None).register(ident)
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
    n = MAX_EVENTS_PER_BATCH + 1
    batch = pb.ReportBatch(job_id="job", rank=0, session=ident.session, sent_time=time.time())
    batch.step_number.extend(range(n))
    batch.step_time.extend([time.time()] * n)
    with pytest.raises(grpc.RpcError) as err:
        stub.Report(batch, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert coordinator.rejected.get("oversized") == 1
    del batch.step_number[1:], batch.step_time[1:]
    assert stub.Report(batch, timeout=5).accepted == 1  # one step: taken
    # each of a cycle's signatures counts too: the decoder looks each up
    batch.calls.run_signature.extend([1] * n)
    with pytest.raises(grpc.RpcError) as err:
        stub.Report(batch, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_restart_keeps_incidents(coordinator_factory: Callable[..., Coordinator], tmp_path: Any) -> None:
    c = coordinator_factory(embedded_agent=False)
    t = Transport(f"127.0.0.1:{c.port}", None)
    ids = [identity(0), identity(1)]
    for ident in ids:
        t.register(ident)
    send(t, ids[0], [call(0, 1, (3,), op="all_reduce")])
    send(t, ids[1], [call(1, 1, (3,), op="broadcast")])
    first = wait_for(lambda: c.incidents_json(), 5, 0.05, "an incident")[0]
    c.stop(grace=0.1)
    again = coordinator_factory(embedded_agent=False)
    stored = again.incidents_json()
    assert [i["id"] for i in stored] == [first["id"]]
    assert stored[0]["kind"] == "op_mismatch"
    # a rank that talked to the old coordinator is asked to register again
    t2 = Transport(f"127.0.0.1:{again.port}", None)
    assert send(t2, ids[0], []).reregister


def test_non_loopback_bind_needs_token(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="token"):
        Coordinator(CoordinatorOptions(host="0.0.0.0", port=0, data_dir=str(tmp_path)))


def test_metrics_and_webhook(coordinator_factory: Callable[..., Coordinator]) -> None:
    received: list[dict[str, Any]] = []
    attempts: list[int] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            attempts.append(1)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if len(attempts) == 1:
                self.send_response(503)  # first attempt fails: the alerter must retry
                self.end_headers()
                return
            received.append(json.loads(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        c = coordinator_factory(
            embedded_agent=False,
            metrics_port=_free_port(),
            alert_webhook=f"http://127.0.0.1:{server.server_address[1]}/hook",
        )
        t = Transport(f"127.0.0.1:{c.port}", None)
        ids = [identity(0), identity(1)]
        for ident in ids:
            t.register(ident)
        send(t, ids[0], [call(0, 1, (3,))])
        send(t, ids[1], [call(1, 1, (4,))])
        wait_for(lambda: received, 10, 0.05, "the webhook")
        assert received[0]["kind"] == "shape_mismatch"
        assert received[0]["text"].startswith("hangwatch shape_mismatch")
        assert c.metrics is not None
        text = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics.port}/metrics", timeout=5).read().decode()
        assert 'hangwatch_incidents_total{kind="shape_mismatch"} 1' in text
        assert "hangwatch_records_received_total 2" in text
        assert 'hangwatch_ranks{job="job",state="waiting"} 2' in text  # both inside all_reduce
    finally:
        server.shutdown()


def test_health_check(coordinator_factory: Callable[..., Coordinator]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    c = coordinator_factory(embedded_agent=False)
    with grpc.insecure_channel(f"127.0.0.1:{c.port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_rpc_refuses_a_wrong_token(coordinator_factory: Callable[..., Coordinator]) -> None:
    c = coordinator_factory(token="s3cret", embedded_agent=False)
    requests = {
        "Register": pb.RegisterRequest(token="bad", identity=pb.RankIdentity(rank=0, world_size=1, session="x")),
        "Report": pb.ReportBatch(token="bad", rank=0, session="x"),
        "ReportMany": pb.RelayBatch(token="bad", reports=[pb.ReportBatch(token="s3cret", rank=0, session="x")]),
        "RegisterAgent": pb.AgentRegisterRequest(token="bad", agent=pb.AgentIdentity(host="h")),
        "AgentPoll": pb.AgentPollRequest(token="bad", agent_id="x"),
        "GetStatus": pb.QueryRequest(token="bad"),
        "ListIncidents": pb.QueryRequest(token="bad"),
        "GetIncident": pb.QueryRequest(token="bad", id="inc-0001"),
        "DumpStacks": pb.QueryRequest(token="bad", id="all"),
        "ImportDumps": pb.ImportRequest(token="bad", dumps=b"x"),
    }
    assert set(requests) == {m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods}
    with grpc.insecure_channel(f"127.0.0.1:{c.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        for method, request in requests.items():
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, method)(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
    assert c.rejected.get("auth") == len(requests)
    assert c.job.ranks == {} and c.hub.remote == {}


def test_an_event_the_coordinator_cannot_apply_does_not_block_the_rank(
    coordinator_factory: Callable[..., Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = coordinator_factory(embedded_agent=False)
    t = Transport(f"127.0.0.1:{c.port}", None)
    ident = identity(0)
    t.register(ident)
    real_apply = c.job.apply
    calls = {"n": 0}

    def flaky_apply(state: Any, event: Any, now: float) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise IndexError("a bug in the detection core")
        real_apply(state, event, now)

    monkeypatch.setattr(c.job, "apply", flaky_apply)
    ack = send(t, ident, [call(0, 1, (4,)), call(0, 2, (4,))])
    assert ack.accepted == 1 and not ack.reregister  # the batch is not refused: no resend loop
    assert c.rejected.get("internal") == 1
    assert send(t, ident, [call(0, 3, (4,))]).accepted == 1


def test_relayed_batches_are_applied_as_their_ranks_sent_them(coordinator_factory: Callable[..., Coordinator]) -> None:
    c = coordinator_factory(token="s3cret", embedded_agent=False)
    t = Transport(f"127.0.0.1:{c.port}", "s3cret")
    ids = [identity(0), identity(1)]
    reg = t.register(ids[0])
    assert reg.report_interval_s == 0.2  # a small job reports every 0.2 s
    t.register(ids[1])
    reports = []
    for rank, shape in ((0, (1, 5)), (1, (1, 2, 5))):
        batch = pb.ReportBatch(rank=rank, session=ids[rank].session, sent_time=time.time())
        CallEncoder().encode([call(rank, 1, shape)], batch)  # calls in columns, as ranks send them
        reports.append(batch)
    stranger = pb.ReportBatch(rank=1, session="never-registered")
    with grpc.insecure_channel(f"127.0.0.1:{c.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.ReportMany(
            pb.RelayBatch(token="s3cret", relay_host="node-7", reports=[*reports, stranger]), timeout=5
        )
        assert [(x.accepted, x.reregister) for x in reply.replies] == [(1, False), (1, False), (0, True)]
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportMany(pb.RelayBatch(token="s3cret", reports=[stranger] * 5000), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    inc = wait_for(lambda: c.incidents_json(), 5, 0.05, "an incident")[0]
    assert inc["kind"] == "shape_mismatch"
    assert c.job.ranks[0].relay == "node-7"


def test_report_interval_grows_with_the_job_and_stays_inside_the_freeze_window() -> None:
    from hangwatch import config
    from hangwatch.coordinator.daemon import report_interval_for

    assert [report_interval_for(n) for n in (8, 204, 512, 1024, 2048, 65536)] == [0.2, 0.2, 0.5, 1.0, 2.0, 2.0]
    # direct ranks make at most ~1,000 RPCs a second up to 2,048 ranks
    assert all(n / report_interval_for(n) <= 1024 for n in range(205, 2049))
    assert report_interval_for(1 << 20) < config.DEFAULT_SILENCE_AFTER_S / 2  # heartbeats well inside it


def test_node_agents_read_a_larger_job_s_steady_ranks_further_apart(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    """``RegisterReply.steady_read_s``: above 8,192 ranks, a steady rank's ring is read further
    apart than it reports (5 s at most); below, not said. An option sets it for every job."""
    from hangwatch.coordinator.options import MAX_STEADY_READ_S, steady_read_for

    assert [steady_read_for(n) for n in (8, 2048, 8192, 16384, 20480, 1 << 20)] == [0.2, 2.0, 2.0, 4.0, 5.0, 5.0]
    assert MAX_STEADY_READ_S == shipped.MAX_PACE_S  # what an agent takes at most
    c = coordinator_factory(embedded_agent=False)
    assert c.accept_registration(factories.identity(0, 16384), "agent").steady_read_s == 4.0
    assert c.accept_registration(factories.identity(0, 4, job_id="small"), "agent").steady_read_s == 0.0
    forced = coordinator_factory(embedded_agent=False, steady_read_s=3.0)
    reply = forced.accept_registration(factories.identity(0, 4), "agent")
    assert (reply.report_interval_s, reply.steady_read_s) == (0.2, 3.0)
    for bad in (-1.0, 6.0, float("nan")):
        with pytest.raises(ConfigError):
            coordinator_factory(embedded_agent=False, steady_read_s=bad)


def test_a_sessions_signature_table_lasts_as_long_as_its_session(coordinator: Coordinator) -> None:
    """A table is let go of (its bytes given back) when its rank's process registers anew, and
    when a new run of the job ends every session of the last: found without a walk of every
    session at each registration."""
    enc = CallEncoder()
    for k in range(4):
        coordinator.register_rank(factories.identity(k, 4))
        batch = pb.ReportBatch(rank=k, session=f"session-{k}", sent_time=time.time())
        enc.reset()
        enc.encode([factories.call(k, 1, exit_time=factories.T0 + 0.1)], batch)
        coordinator.accept_report(batch)
    tables = {k: coordinator.decoder_for(f"session-{k}") for k in range(4)}
    assert all(t is not None and t.bytes > 0 for t in tables.values())

    coordinator.register_rank(factories.identity(1, 4, session="session-1b"))  # rank 1's process restarted
    assert coordinator.decoder_for("session-1") is None and tables[1] is not None and tables[1].bytes == 0
    assert coordinator.decoder_for("session-1b") is not None
    assert all(coordinator.decoder_for(f"session-{k}") is tables[k] for k in (0, 2, 3))

    coordinator.register_rank(factories.identity(0, 4, session="run2-0", attempt=1))  # the launcher restarted the job
    assert [coordinator.decoder_for(s) for s in ("session-0", "session-1b", "session-2", "session-3")] == [None] * 4
    assert all(t is not None and t.bytes == 0 for t in tables.values())
    assert coordinator.decoder_for("run2-0") is not None
