"""A node agent that goes away mid-job (a crash, a DaemonSet rolling update) must not make its
ranks look frozen, lose their records, or send them twice.

A real coordinator (no embedded agent), a real ``hangwatch agent`` process serving rank links,
and a real 2-rank gloo job linked to it. The agent is SIGKILLed: within ``FALLBACK_AFTER_S`` the
ranks ship their own records (``via`` direct), long past the coordinator's 5 s of silence no
incident opens and the ranks' calls keep arriving; a new agent on the same socket takes the
ranks back (``via`` agent) without sending the coordinator a call twice; the job ends cleanly.
A job that starts before its node's agent (a DaemonSet pod still pulling its image) links to it
once it is up, the same way.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hangwatch import config
from hangwatch.client.sender import FALLBACK_AFTER_S, RELINK_EVERY_S
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job, wait_for

pytestmark = pytest.mark.slow

LOOP = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
t = torch.ones(4)
start = time.time()
SECONDS = float(os.environ.get("LOOP_SECONDS", "30"))
while True:
    dist.all_reduce(t)
    time.sleep(0.02)
    # the ranks agree on when to stop (each deciding alone by its own clock is a real mismatch:
    # one rank in the final barrier, the other in one more all_reduce)
    done = torch.tensor([float(time.time() - start >= SECONDS)])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    if done.item():
        break
dist.barrier()
dist.destroy_process_group()
"""


def _via(c: Coordinator) -> dict[int, str]:
    with c.lock:
        return {rank: st.via for rank, st in c.job.ranks.items()}


def _last_seq(c: Coordinator, rank: int) -> int:
    with c.lock:
        last = c.job.ranks[rank].last_call
        return last.seq if last is not None else 0


@pytest.mark.timeout(150)
def test_ranks_outlive_their_agent_and_come_back_to_the_next(
    coordinator_factory: Callable[..., Coordinator],
    torchrun: Callable[..., Job],
    agents: Callable[[str, int], subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    c = coordinator_factory(embedded_agent=False)
    first = agents("node-a", c.port)
    wait_for(lambda: (tmp_path / "node-a.sock").exists(), 30, 0.1, "the agent's rank socket")
    job = torchrun(
        LOOP,
        addr=f"127.0.0.1:{c.port}",
        env={config.ENV_AGENT_SOCKET: str(tmp_path / "node-a.sock"), "HANGWATCH_NODE_NAME": "node-a"},
        name="loop",
    )
    wait_for(lambda: _via(c) == {0: "agent", 1: "agent"}, 60, 0.1, "both ranks linked to the agent")
    wait_for(lambda: _last_seq(c, 0) > 40, 30, 0.1, "calls through the agent")

    first.send_signal(signal.SIGKILL)
    first.wait(10)
    killed = time.monotonic()
    seq_at_kill = _last_seq(c, 0)
    wait_for(lambda: _via(c) == {0: "direct", 1: "direct"}, FALLBACK_AFTER_S + 10, 0.1, "the ranks shipping alone")
    assert time.monotonic() - killed < FALLBACK_AFTER_S + 5
    time.sleep(max(0.0, 8.0 - (time.monotonic() - killed)))  # well past 5 s of silence
    assert c.incidents_json() == [], [i["summary"] for i in c.incidents_json()]
    assert _last_seq(c, 0) > seq_at_kill + 40, "the ranks' calls stopped arriving"

    agents("node-a", c.port)  # the agent is back (a restarted pod): the ranks link to it again
    wait_for(lambda: _via(c) == {0: "agent", 1: "agent"}, RELINK_EVERY_S + 15, 0.2, "both ranks linked again")
    assert job.wait(90) == 0, job.output()[-3000:]
    wait_for(lambda: all(st.end is not None for st in c.job.ranks.values()), 15, 0.2, "both ranks' ends")
    assert c.incidents_json() == [], [i["summary"] for i in c.incidents_json()]
    with c.lock:
        for rank, st in c.job.ranks.items():
            seqs = collections.Counter(call.seq for hist in st.history.values() for call in hist)
            twice = [seq for seq, n in seqs.items() if n > 1]
            assert twice == [], f"rank {rank}: calls held twice: {twice[:10]}"
            assert c.job.duplicates == 0


def _held_twice(c: Coordinator) -> dict[int, list[int]]:
    with c.lock:
        out = {}
        for rank, st in c.job.ranks.items():
            seqs = collections.Counter(call.seq for hist in st.history.values() for call in hist)
            out[rank] = [seq for seq, n in seqs.items() if n > 1][:10]
        return out


@pytest.mark.timeout(120)
def test_ranks_that_start_before_their_agent_link_to_it_once_it_is_up(
    coordinator_factory: Callable[..., Coordinator],
    torchrun: Callable[..., Job],
    agents: Callable[[str, int], subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    """Before, a rank that found no agent at start shipped its own records for good (it only
    tried again after losing a link): its node's agent never read its ring, and it could never
    be dumped or aborted (only agent-proven ranks are)."""
    c = coordinator_factory(embedded_agent=False)
    job = torchrun(
        LOOP,
        addr=f"127.0.0.1:{c.port}",
        env={
            config.ENV_AGENT_SOCKET: str(tmp_path / "node-a.sock"),
            "HANGWATCH_NODE_NAME": "node-a",
            "LOOP_SECONDS": "20",
        },
        name="early",
    )
    wait_for(lambda: _via(c) == {0: "direct", 1: "direct"}, 60, 0.1, "both ranks shipping alone")
    wait_for(lambda: _last_seq(c, 0) > 20, 30, 0.1, "calls shipped directly")
    agents("node-a", c.port)
    up = time.monotonic()
    wait_for(
        lambda: _via(c) == {0: "agent", 1: "agent"}, RELINK_EVERY_S + 15, 0.2, "both ranks linked to the late agent"
    )
    assert time.monotonic() - up < RELINK_EVERY_S + 10
    with c.lock:
        assert all(st.proven for st in c.job.ranks.values()), "linked ranks are proven by their agent"
    assert job.wait(90) == 0, job.output()[-3000:]
    wait_for(lambda: all(st.end is not None for st in c.job.ranks.values()), 15, 0.2, "both ranks' ends")
    assert c.incidents_json() == [], [i["summary"] for i in c.incidents_json()]
    assert _held_twice(c) == {0: [], 1: []}
    assert c.job.duplicates == 0
