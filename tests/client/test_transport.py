"""``Transport`` (the rank's gRPC client) against real in-process gRPC servers on port 0.

Seam faked: the server side only. Most tests run a small :class:`FakeCoordinator` servicer (a
subclass of the generated ``CoordinatorServicer``) that records requests and their metadata and
can stall or fail on demand; one runs the real coordinator (``Coordinator`` with a token) to check
the token handshake end to end. The channel, stubs, deadlines and the batch encoding are real, and
batches are read back with the coordinator's real ``CallDecoder``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from hangwatch import records as r
from hangwatch.client.ringsink import RingSink
from hangwatch.client.transport import Transport
from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from hangwatch.ring import Batch, RingReader
from hangwatch.signatures import CallDecoder
from hangwatch.testing import BlackHole, free_port
from tests.client.fakes import identity


class FakeCoordinator(pb_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.registers: list[tuple[pb.RegisterRequest, dict[str, Any]]] = []
        self.reports: list[tuple[pb.ReportBatch, dict[str, Any]]] = []
        self.stall_s = 0.0
        self.fail: grpc.StatusCode | None = None
        self.release = threading.Event()

    def _serve(self, context: grpc.ServicerContext) -> None:
        if self.stall_s:
            self.release.wait(self.stall_s)
        if self.fail is not None:
            context.abort(self.fail, "told to fail")

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        self.registers.append((request, dict(context.invocation_metadata())))
        self._serve(context)
        return pb.RegisterReply(coordinator_id="fake-1", server_time=time.time(), report_interval_s=0.5)

    def Report(self, request: pb.ReportBatch, context: grpc.ServicerContext) -> pb.ReportReply:
        self.reports.append((request, dict(context.invocation_metadata())))
        self._serve(context)
        return pb.ReportReply(accepted=len(request.events) + 2 * len(request.calls.call_id))


class Server:
    def __init__(self, servicer: FakeCoordinator, port: int = 0) -> None:
        self.servicer = servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_CoordinatorServicer_to_server(servicer, self.server)  # type: ignore[no-untyped-call]
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.addr = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.servicer.release.set()
        self.server.stop(grace=None)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server(FakeCoordinator())
    yield s
    s.stop()


def _call(call_id: int, seq: int, shape: tuple[int, ...] = (4,)) -> r.CallRecord:
    return r.CallRecord(
        rank=0,
        call_id=call_id,
        op="all_reduce",
        group="0",
        seq=seq,
        inputs=(r.TensorMeta(shape, "float32", "cpu"),),
        reduce_op="sum",
        call_site="train.py:10 in step",
        enter_time=1.5,
    )


def test_register_sends_the_token_and_identity_in_the_request(server: Server) -> None:
    t = Transport(server.addr, "s3cret")
    reply = t.register(identity(rank=3))
    t.close()
    assert (reply.coordinator_id, reply.report_interval_s) == ("fake-1", 0.5)
    ((req, metadata),) = server.servicer.registers
    assert req.token == "s3cret"
    assert (req.identity.job_id, req.identity.rank, req.identity.host, req.identity.session) == (
        "job",
        3,
        "node",
        "s1",
    )
    # the token travels in the message (checked by every handler), not as call metadata
    assert "s3cret" not in metadata.values()


def test_report_encodes_a_batch_the_coordinator_decodes(server: Server) -> None:
    t = Transport(server.addr, None)
    t.register(identity())
    sink = RingSink(64)
    for e in (_call(1, 1), r.CallExit(0, 1, 2.5), r.StepEvent(0, 7, 3.0)):
        sink.put(e)
    ring = RingReader(sink.fd).poll()
    reply = t.report(
        identity(), 5, [], queued=11, dropped=2, where="a.py:1 in f", where_user="b.py:2 in g", urgent=True, ring=ring
    )
    assert reply.accepted == 3
    ((batch, _),) = server.servicer.reports
    assert batch.token == ""  # no token configured: sent empty
    assert (batch.job_id, batch.rank, batch.session, batch.batch_seq) == ("job", 0, "s1", 5)
    assert (batch.queued, batch.dropped, batch.where, batch.where_user, batch.urgent) == (
        11,
        2,
        "a.py:1 in f",
        "b.py:2 in g",
        True,
    )
    assert abs(batch.sent_time - time.time()) < 5
    decoded, _, _ = CallDecoder().decode(0, batch)
    call = next(e for e in decoded if isinstance(e, r.CallRecord))
    assert (call.op, call.seq, call.inputs, call.exit_time, call.call_site) == (
        "all_reduce",
        1,
        (r.TensorMeta((4,), "float32", "cpu"),),
        2.5,
        "train.py:10 in step",
    )
    assert r.StepEvent(0, 7, 3.0) in decoded


def test_signatures_are_sent_once_per_registration(server: Server) -> None:
    t = Transport(server.addr, "tok")
    sink = RingSink(64)
    reader = RingReader(sink.fd)

    def ring_of(call: r.CallRecord) -> Batch:
        sink.put(call)
        return reader.poll()

    t.register(identity())
    t.report(identity(), 1, [], 0, 0, ring=ring_of(_call(1, 1)))
    t.report(identity(), 2, [], 0, 0, ring=ring_of(_call(2, 2)))
    t.register(identity())  # the coordinator restarted: its table of our signatures is gone
    t.report(identity(), 3, [], 0, 0, ring=ring_of(_call(3, 3)))
    batches = [b for b, _ in server.servicer.reports]
    assert [len(b.signatures) for b in batches] == [1, 0, 1]
    assert [list(b.calls.call_id) for b in batches] == [[1], [2], [3]]


def test_a_slow_coordinator_runs_into_the_deadline(server: Server) -> None:
    server.servicer.stall_s = 2.0
    t = Transport(server.addr, None, timeout_s=0.1)
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        t.register(identity())
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - began < 0.6
    t.close()


def test_a_black_holed_coordinator_runs_into_the_deadline() -> None:
    with BlackHole() as hole:
        t = Transport(hole.addr, None, timeout_s=0.1)
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            t.report(identity(), 1, [], 0, 0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - began < 0.6
        t.close()


def test_nothing_listening_is_unavailable_and_a_new_channel_finds_the_coordinator_later() -> None:
    port = free_port()
    t = Transport(f"127.0.0.1:{port}", None, timeout_s=0.5)
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        t.register(identity())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - began < 0.6  # refused at once, not after a wait
    t.close()  # what the sender does on any failure
    server = Server(FakeCoordinator(), port)
    try:
        assert t.register(identity()).coordinator_id == "fake-1"
    finally:
        t.close()
        server.stop()


def test_a_server_error_surfaces_with_its_code(server: Server) -> None:
    server.servicer.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
    t = Transport(server.addr, None)
    with pytest.raises(grpc.RpcError) as err:
        t.report(identity(), 1, [], 0, 0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    t.close()


def test_close_is_idempotent_and_the_channel_is_lazy(server: Server) -> None:
    t = Transport(server.addr, None)
    t.close()
    assert t._channel is None  # nothing connects before the first call
    t.register(identity())
    assert t._channel is not None
    t.close()
    t.close()
    assert t._channel is None and t._stub is None


def test_the_real_coordinator_refuses_a_wrong_token_and_accepts_the_right_one(tmp_path: Path) -> None:
    c = Coordinator(
        CoordinatorOptions(host="127.0.0.1", port=0, data_dir=str(tmp_path), token="s3cret", embedded_agent=False)
    )
    c.start()
    try:
        wrong = Transport(c.addr, "nope", timeout_s=2.0)
        with pytest.raises(grpc.RpcError) as err:
            wrong.register(identity())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wrong.close()
        right = Transport(c.addr, "s3cret", timeout_s=2.0)
        reply = right.register(identity())
        assert reply.coordinator_id
        ack = right.report(identity(), 1, [_call(1, 1), r.CallExit(0, 1, 2.5)], 0, 0)
        assert not ack.reregister and ack.accepted == 2
        right.close()
        assert [st.identity.rank for st in c.job.ranks.values()] == [0]
    finally:
        c.stop(grace=0.2)
