"""Fuzzing the coordinator's servicers over real gRPC: raw bytes, and well-formed but adversarial
batches. The coordinator must answer every message with a clear status (never INTERNAL/UNKNOWN),
stay up, keep its memory bounded, and keep diagnosing the real job afterwards.

Inputs that once broke something live in ``fuzz_corpus/`` and are replayed on every run.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatch import records as r
from hangwatch.client.transport import Transport
from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions
from hangwatch.diagnosis.state import MAX_GROUPS
from hangwatch.protos import hangwatch_pb2 as pb

#: Hundreds of examples or thousands of batches per test: left out of ``make unit``, run by ``make test``.
pytestmark = pytest.mark.soak

CORPUS = Path(__file__).parent / "fuzz_corpus"
METHODS = (
    "Register",
    "Report",
    "ReportMany",
    "RegisterAgent",
    "AgentPoll",
    "GetStatus",
    "ListIncidents",
    "GetIncident",
)
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    c = Coordinator(CoordinatorOptions(port=0, data_dir=str(tmp_path_factory.mktemp("fuzz")), embedded_agent=False))
    c.start()
    yield c
    c.stop(0.2)


@pytest.fixture(scope="module")
def raw(server: Coordinator) -> Iterator[Callable[[str, bytes], grpc.StatusCode]]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")

    def call(method: str, payload: bytes) -> grpc.StatusCode:
        rpc = channel.unary_unary(
            f"/hangwatch.v1.Coordinator/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        try:
            rpc(payload, timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return, attr-defined]

    yield call
    channel.close()


def _still_diagnoses(c: Coordinator) -> None:
    t = Transport(f"127.0.0.1:{c.port}", None)
    ids = [r.RankIdentity("real", rk, 2, "h", 5000 + rk, session=uuid.uuid4().hex) for rk in (0, 1)]
    for ident in ids:
        t.register(ident)
    seq = 10_000 + int(time.time() * 1000) % 1_000_000
    for rk, shape in ((0, (2, 3)), (1, (3, 2))):
        call = r.CallRecord(
            rank=rk,
            call_id=seq,
            op="all_reduce",
            group="0",
            seq=seq,
            inputs=(r.TensorMeta(shape, "float32"),),
            enter_time=time.time(),
        )
        t.report(ids[rk], 1, [call], 0, 0)
    deadline = time.time() + 5
    while time.time() < deadline:
        if any(i["kind"] == "shape_mismatch" and i["seq"] == seq for i in c.incidents_json()):
            return
        time.sleep(0.05)
    raise AssertionError("the coordinator stopped diagnosing after fuzzing")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=2048))
def test_raw_bytes_get_a_clear_status(
    server: Coordinator, raw: Callable[[str, bytes], grpc.StatusCode], method: str, payload: bytes
) -> None:
    assert raw(method, payload) in ACCEPTABLE


def test_corpus_replays(server: Coordinator, raw: Callable[[str, bytes], grpc.StatusCode]) -> None:
    for path in sorted(CORPUS.glob("*.bin")):
        method = path.stem.split("-", 1)[0]
        assert raw(method, path.read_bytes()) in ACCEPTABLE, path.name
    _still_diagnoses(server)


tensors = st.builds(
    lambda shape, dtype: pb.TensorMeta(shape=shape, dtype=dtype),
    st.lists(st.integers(min_value=-(2**62), max_value=2**62), max_size=24),
    st.text(max_size=12),
)
calls = st.builds(
    lambda op, group, seq, ins, step, call_id, t: pb.Event(
        call=pb.Call(op=op, group=group, seq=seq, inputs=ins, step=step, call_id=call_id, enter_time=t)
    ),
    st.sampled_from(["all_reduce", "broadcast", "send", "recv", "", "\x00weird", "barrier"]),
    st.text(max_size=6),
    st.integers(min_value=0, max_value=2**64 - 1),
    st.lists(tensors, max_size=4),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=0, max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
)
others = st.one_of(
    st.builds(
        lambda c, t: pb.Event(done=pb.CallDone(call_id=c, exit_time=t)),
        st.integers(min_value=0, max_value=2**64 - 1),
        st.floats(),
    ),
    st.builds(
        lambda k, n: pb.Event(group=pb.GroupChange(kind=k, group=pb.Group(name=n, ranks=[0, 1]))),
        st.sampled_from(["created", "destroyed", "bogus"]),
        st.text(max_size=4),
    ),
    st.builds(lambda k: pb.Event(end=pb.End(kind=k)), st.sampled_from(["exception", "clean_exit", "nope"])),
    st.just(pb.Event()),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(st.one_of(calls, others), max_size=40), rank=st.integers(min_value=0, max_value=3))
def test_adversarial_batches_from_a_registered_rank(server: Coordinator, events: list[pb.Event], rank: int) -> None:
    t = Transport(f"127.0.0.1:{server.port}", None)
    ident = r.RankIdentity("fuzz", rank, 4, "h", 9000 + rank, session=uuid.uuid4().hex)
    t.register(ident)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc

        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        batch = pb.ReportBatch(rank=rank, session=ident.session, sent_time=time.time(), events=events)
        try:
            stub.Report(batch, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in ACCEPTABLE, exc  # type: ignore[attr-defined]
    finally:
        channel.close()
    status = server.status()  # the state stays renderable
    assert status["job"]["registered"] >= 1


numbers = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=30)
times = st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=30)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    signatures=st.lists(st.tuples(st.integers(min_value=0, max_value=2**32 - 1), calls), max_size=6),
    sig=numbers,
    seq=numbers,
    enter=times,
    exit_=times,
    relayed=st.booleans(),
)
def test_adversarial_interned_calls(
    server: Coordinator,
    signatures: list[tuple[int, pb.Event]],
    sig: list[int],
    seq: list[int],
    enter: list[float],
    exit_: list[float],
    relayed: bool,
) -> None:
    """Signatures that are malformed or redefined, columns of different lengths, ids never
    defined, NaN and infinite times: a clear status, and the coordinator keeps diagnosing."""
    t = Transport(f"127.0.0.1:{server.port}", None)
    ident = r.RankIdentity("fuzz", 1, 4, "h", 9001, session=uuid.uuid4().hex)
    t.register(ident)
    batch = pb.ReportBatch(rank=1, session=ident.session, sent_time=time.time())
    for sid, event in signatures:
        batch.signatures.add(id=sid, call=event.call)
    n = len(sig)
    batch.calls.signature.extend(sig)
    batch.calls.call_id.extend(range(n))
    batch.calls.seq.extend(seq)
    batch.calls.step.extend([0] * n)
    batch.calls.enter_time.extend(enter)
    batch.calls.exit_time.extend(exit_)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc

        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        try:
            if relayed:
                stub.ReportMany(pb.RelayBatch(relay_host="fuzz-node", reports=[batch, batch]), timeout=10)
            else:
                stub.Report(batch, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in ACCEPTABLE, exc  # type: ignore[attr-defined]
    finally:
        channel.close()
    assert server.status()["job"]["registered"] >= 1


def test_many_tiny_groups_stay_bounded(server: Coordinator) -> None:
    t = Transport(f"127.0.0.1:{server.port}", None, timeout_s=30)  # a loaded 2-core CI box is slow
    ident = r.RankIdentity("flood", 0, 2, "h", 7777, session=uuid.uuid4().hex)
    t.register(ident)
    for start in range(0, 20_000, 2_000):
        events: list[r.RankEvent] = [
            r.CallRecord(rank=0, call_id=i, op="all_reduce", group=f"g{i}", seq=1, enter_time=time.time())
            for i in range(start, start + 2_000)
        ]
        t.report(ident, 1, events, 0, 0)
    assert server.status()["job"]["registered"] >= 1
    assert len(server.job.slots) <= MAX_GROUPS  # bounded, whatever the flood
    _still_diagnoses(server)
