"""A node agent folds its ranks' cycles before it sends them (``hangwatch.sendfold``): a rank's
FSDP steps go as one column entry across steps, the batch marked ``folded``, and the coordinator's
real decoder makes every call the rank wrote of it. A real rank process, ring, link and shipper
(``tests.agent.test_shipper``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch import records as r
from hangwatch.agent.rings import RingServer
from hangwatch.agent.shipper import Shipper
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.signatures import CallDecoder
from hangwatch.testing import wait_for
from tests.agent.test_shipper import Intake, shipping

LAYERS = 8
STEPS = 6

_RANK = textwrap.dedent(
    f"""
    import sys, time
    from hangwatch import link, records as r
    from hangwatch.client.ringsink import RingSink
    sink = RingSink(4096, rank=0)
    hello = {{"job_id": "j", "rank": 0, "world_size": 2, "session": "s0", "pid": 1, "local_rank": 0}}
    assert link.connect(sys.argv[1], hello, [sink.fd]) is not None
    i = 0
    for step in range({STEPS}):
        sink.put(r.StepEvent(0, step, time.time()))
        for k in range({2 * LAYERS}):  # each layer's gather forward, its scatter backward
            i += 1
            layer, forward = k % {LAYERS}, k < {LAYERS}
            shard = (r.TensorMeta((4096 + 512 * layer,), "bfloat16"),)
            whole = (r.TensorMeta((4 * (4096 + 512 * layer),), "bfloat16"),)
            op = "all_gather_into_tensor" if forward else "reduce_scatter_tensor"
            t = time.time()
            sink.put(r.CallRecord(0, i, op, "0", i, shard, whole, None if forward else "sum", step=step,
                                  call_site="fsdp.py:%d in layer" % (100 + k), enter_time=t, exit_time=t + 1e-4))
    print("ready", flush=True)
    time.sleep(60)
    """
)


class Folding(Intake):
    """A coordinator that takes runs across steps, its decoders folding as the coordinator's do."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[pb.ReportBatch] = []

    def accept_registration(self, identity: r.RankIdentity, via: str = "direct") -> Any:
        reply = super().accept_registration(identity, via)
        self.decoders[identity.session] = CallDecoder(fold=True)
        reply.takes_runs = reply.takes_cycles = reply.takes_steps = True
        return reply

    def accept_report(self, request: pb.ReportBatch, relay: str = "") -> pb.ReportReply:
        self.requests.append(request)
        return super().accept_report(request, relay)


@pytest.fixture
def folding(tmp_path: Path) -> Iterator[tuple[RingServer, Shipper, Intake]]:
    yield from shipping(tmp_path, Folding())


@pytest.mark.timeout(60)
def test_a_rank_s_fsdp_steps_go_folded_across_steps_and_arrive_as_written(folding: Any) -> None:
    server, shipper, intake = folding
    child = subprocess.Popen([sys.executable, "-c", _RANK, server.path], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        n = STEPS * 2 * LAYERS

        def arrived() -> bool:
            shipper.tick()
            calls = [c for ev in intake.events.get(0, []) for c in _calls(ev)]
            return len(calls) == n

        wait_for(arrived, 20, 0.05, "the rank's calls")
    finally:
        child.kill()
        child.wait()
    calls = [c for ev in intake.events[0] for c in _calls(ev)]
    assert [(c.call_id, c.seq) for c in calls] == [(i, i) for i in range(1, n + 1)]
    assert [c.step for c in calls] == [i // (2 * LAYERS) for i in range(n)]
    assert [c.call_site for c in calls[: 2 * LAYERS]] == [f"fsdp.py:{100 + k} in layer" for k in range(2 * LAYERS)]
    assert all(req.folded for req in intake.requests if len(req.calls.signature))
    crossing = [req for req in intake.requests if any(req.calls.run_per_step)]
    assert crossing, "no batch carried a run across steps"
    runs = [ev for ev in intake.events[0] if isinstance(ev, r.CallRun)]
    assert any(run.per_step == 2 * LAYERS and run.last_step > run.step for run in runs)
    # every step arrived, once, in order, however it travelled (as an event, or in columns)
    steps = [s for ev in intake.events[0] for s in _steps(ev)]
    assert steps == list(range(STEPS))
    assert any(req.step_number for req in intake.requests), "no batch carried its steps in columns"


def _calls(ev: r.RankEvent) -> list[r.CallRecord]:
    return ev.calls() if isinstance(ev, r.CallRun) else [ev] if isinstance(ev, r.CallRecord) else []


def _steps(ev: r.RankEvent) -> list[int]:
    return list(ev.steps) if isinstance(ev, r.Steps) else [ev.step] if isinstance(ev, r.StepEvent) else []
