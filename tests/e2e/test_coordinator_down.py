"""The job never waits for hangwatch: no coordinator listening at all, and a coordinator SIGKILLed
(or frozen with SIGSTOP: connections stay open, nothing answers) mid-job (issue 7). Real 2-rank
torchrun/gloo DDP jobs with the hook attached through the environment; each rank reports its own
step times and its hook's counters.

What is asserted is structural, never a speed ratio: the job exits 0 with no traceback, no step
(including one that issues calls of a new signature right after the coordinator died, which the
hook would flush before issuing) takes a second, and the hook kept what it could not send in its
bounded ring or overwrote and counted it, while its sender thread counted the failed attempts.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hangwatch.testing import Job, free_port, start_coordinator_cli, wait_for

pytestmark = pytest.mark.slow

#: A blocking connect or RPC on the training thread would cost a gRPC deadline (2 s) or a novel-call
#: flush timeout (0.5 s) per call; a healthy step here is a few milliseconds.
MAX_STEP_S = 1.0
QUEUE = 128

TRAIN = """
import json
from hangwatch.client import session as hw

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
out_dir = os.environ["OUT_DIR"]
killed_file = os.environ.get("KILLED_FILE", "")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
hook = hw.current()
times = []
at_kill = None  # hook counters when the coordinator was seen gone
after_kill = 0
step = 0
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    t0 = time.perf_counter()
    opt.zero_grad()
    model(torch.randn(16, 32)).sum().backward()
    opt.step()
    connected = float(hook is not None and (hook.sender.batches_sent > 0 or hook.link is not None))
    flags = torch.tensor([1.0 if killed_file and os.path.exists(killed_file) else 0.0, -connected])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # [anyone saw the kill, -(everyone connected)]
    if killed_file and flags[1].item() == -1.0 and step >= 50 and rank == 0 and at_kill is None:
        open(os.path.join(out_dir, "ready"), "w").close()
    if flags[0].item() == 1.0 and at_kill is None:
        at_kill = {"step": step, "batches_sent": hook.sender.batches_sent, "registered": hook.sender.registered,
                   "via": hook.via}
        # calls of new signatures: the hook flushes such a record before issuing the call
        dist.broadcast(torch.zeros(3, 7), src=0)
        dist.all_gather(list(torch.zeros(2, 5).unbind(0)), torch.ones(5))
        dist.all_reduce(torch.ones(11, dtype=torch.float64))
    times.append(time.perf_counter() - t0)
    step += 1
    if at_kill is not None:
        after_kill += 1
    if (not killed_file and step >= int(os.environ["STEPS"])) or after_kill >= int(os.environ["STEPS"]):
        break
    time.sleep(0.01)
result = {
    "rank": rank,
    "steps": step,
    "after_kill": after_kill,
    "max_step_s": max(times),
    "median_step_s": sorted(times)[len(times) // 2],
    "attached": hook is not None,
    "at_kill": at_kill,
}
if hook is not None:
    result.update(
        send_failures=hook.sender.send_failures,
        batches_sent=hook.sender.batches_sent,
        registered=hook.sender.registered,
        flush_novel=hook.recorder.flush_novel,
        via=hook.via,
        link_losses=hook.sender.link_losses,
        queued=hook.sender.ring_counts()[0],
        dropped=hook.sender.ring_counts()[1],
        capacity=hook.sink.capacity,
    )
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


def _results(out: Path, job: Job) -> list[dict[str, Any]]:
    found = sorted(out.glob("rank*.json"))
    assert len(found) == 2, f"ranks that finished: {[p.name for p in found]}; log:\n{job.output()[-3000:]}"
    return [json.loads(p.read_text()) for p in found]


def _never_waited(job: Job, results: list[dict[str, Any]], agent: bool = False) -> None:
    output = job.output()
    assert "Traceback" not in output, output[-3000:]
    assert "hangwatch: internal error" not in output, output[-3000:]
    assert output.count("unreachable") <= 2, "one warning per rank, not one per retry"
    for res in results:
        assert res["attached"], "the hook did not attach: this test would prove nothing"
        assert res["max_step_s"] < MAX_STEP_S, res  # nothing on the training thread waited for the network
        assert res["capacity"] == QUEUE
        assert res["queued"] <= QUEUE, res
        if not agent:
            assert res["send_failures"] >= 1, res  # the sender thread met the failure and counted it
            assert res["registered"] is False, res
            assert res["queued"] + res["dropped"] > 0, res  # what could not be sent is kept (bounded) or dropped


def test_no_coordinator_listening(tmp_path: Path, torchrun: Callable[..., Job]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {"OUT_DIR": str(out), "STEPS": "300", "HANGWATCH_QUEUE_SIZE": str(QUEUE)}
    job = torchrun(TRAIN, addr=addr, env=env, name="absent")
    assert job.wait(90) == 0, job.output()[-3000:]
    results = _results(out, job)
    _never_waited(job, results)
    for res in results:
        assert res["steps"] == 300
        assert res["batches_sent"] == 0, res
        assert res["dropped"] > 0, res  # 300 steps of records into a ring of 128: the oldest overwritten
        assert res["queued"] == QUEUE, res  # never read: nothing is sent before registration


@pytest.mark.parametrize("path", ["agent", "direct"])
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_coordinator_dies_mid_job(tmp_path: Path, torchrun: Callable[..., Job], how: str, path: str) -> None:
    """SIGKILL: connections are refused at once. SIGSTOP: they stay open and every RPC runs into its
    deadline on the sender thread, while the training thread issues calls of new signatures (which
    it flushes first, waiting at most NOVEL_FLUSH_TIMEOUT_S once, then never again)."""
    out = tmp_path / "out"
    out.mkdir()
    killed = tmp_path / "killed"
    addr, coordinator = start_coordinator_cli(tmp_path / "data", stuck_after=3.0, cwd=tmp_path)
    try:
        env = {"OUT_DIR": str(out), "KILLED_FILE": str(killed), "STEPS": "200", "HANGWATCH_QUEUE_SIZE": str(QUEUE)}
        if path == "direct":  # no agent socket to be found: the ranks ship their own rings
            env["HANGWATCH_AGENT_SOCKET"] = str(tmp_path / "no-agent.sock")
        job = torchrun(TRAIN, addr=addr, env=env, name=f"{how}_{path}")
        wait_for(lambda: (out / "ready").exists() or job.proc.poll() is not None, 60, 0.1, "both ranks connected")
        assert job.proc.poll() is None, job.output()[-3000:]
        if how == "sigkill":
            coordinator.send_signal(signal.SIGKILL)
            coordinator.wait(10)
        else:
            coordinator.send_signal(signal.SIGSTOP)
        killed.touch()
        started = time.monotonic()
        assert job.wait(60) == 0, job.output()[-3000:]
        assert time.monotonic() - started < 30
    finally:
        if coordinator.poll() is None:
            coordinator.kill()  # also ends a stopped process
            coordinator.wait(10)
    results = _results(out, job)
    _never_waited(job, results, agent=path == "agent")
    for res in results:
        at_kill = res["at_kill"]
        assert at_kill is not None and res["after_kill"] == 200, res
        assert res["via"] == at_kill["via"] == path or (path == "agent" and how == "sigkill"), res
        assert at_kill["step"] >= 50, res  # it trained connected first
        if path == "agent":
            # its agent died with the coordinator (SIGKILL): the link closed and the rank keeps
            # trying to link again, off the training thread; SIGSTOP: nothing closes, nothing waits
            assert res["link_losses"] == (1 if how == "sigkill" else 0), res
            continue
        assert at_kill["batches_sent"] > 0, res
        assert res["batches_sent"] == at_kill["batches_sent"], res  # and nothing got through after
        if how == "sigstop" and at_kill["registered"]:
            assert res["flush_novel"] is False, res  # a flush timed out: the hook stopped flushing
