"""The attack the trust issue found first: a client registers "ranks" that carry the pids (and
start times, which anyone reads from /proc) of unrelated processes, then makes them look hung,
against a coordinator with --abort-on-hang. Before proofs, the agent dumped those processes'
stacks into the incident and killed them 5 s later. Real coordinator, real embedded agent, real
processes: one of the same user and, where the test runs as root, one of another user."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from hangwatch import records as r
from hangwatch.client.transport import Transport
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import wait_for
from tests import factories

pytestmark = pytest.mark.slow

SLEEPER = [
    sys.executable,
    "-c",
    "import time\ndef secret_function_name():\n    time.sleep(120)\nsecret_function_name()",
]


@pytest.fixture
def victims() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "120"]), subprocess.Popen(SLEEPER)]
    if os.geteuid() == 0:  # a process of another user too: nobody (a root process is the first)
        procs.append(subprocess.Popen(["sleep", "120"], user=65534, group=65534))
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(10)


def test_a_fake_rank_is_neither_dumped_nor_killed(
    coordinator_factory: Callable[..., Coordinator], victims: list[subprocess.Popen[bytes]]
) -> None:
    c = coordinator_factory(stuck_after=2.0, abort_on_hang=True)
    world = len(victims)
    t = Transport(f"127.0.0.1:{c.port}", None)
    idents = []
    for rank, proc in enumerate(victims):
        started = psutil.Process(proc.pid).create_time()
        ident = r.RankIdentity(
            "attack", rank, world, os.uname().nodename, proc.pid, start_time=started, session=f"f{rank}"
        )
        t.register(ident)
        idents.append(ident)
    # "rank 0" waits in all_reduce; the other "ranks" never come: a hang
    t.report(idents[0], 1, [factories.call(0, 1, call_id=1, enter_time=time.time())], 0, 0)
    stop = threading.Event()

    def heartbeats() -> None:  # the fake ranks keep "reporting", as busy live ranks would
        n = 1
        while not stop.wait(0.3):
            n += 1
            for ident in idents:
                t.report(ident, n, [], 0, 0)

    beating = threading.Thread(target=heartbeats, daemon=True)
    beating.start()
    inc = wait_for(lambda: next(iter(c.incidents_json()), None), 15, 0.1, "the fake hang's incident")
    assert len(c.incidents_json()) == 1, c.incidents_json()
    assert inc["kind"] == "stuck_collective" and inc["culprit_ranks"] == list(range(1, world))
    wait_for(lambda: c.incident_json(inc["id"])["stack_notes"], 15, 0.1, "the agent's answer")  # type: ignore[index]
    wait_for(lambda: c.job.aborted_at is not None, 20, 0.1, "--abort-on-hang to act")
    time.sleep(2.0)  # the agent's SIGTERM would have landed by now
    for proc in victims:
        assert proc.poll() is None, "an unrelated process was killed"
    stored = c.incident_json(inc["id"])
    assert stored is not None and stored["stacks"] == {}
    assert "secret_function_name" not in str(stored)
    for rank in range(1, world):
        assert "own claim" in stored["stack_notes"][str(rank)], stored["stack_notes"]
    # and the abort the agent refused is told in the incident, rank by rank
    told = wait_for(lambda: (c.incident_json(inc["id"]) or {})["details"].get("abort"), 15, 0.1, "the abort's outcome")
    assert told["signalled_pids"] == [] and sorted(told["refused"]) == [str(rk) for rk in range(world)]
    assert all("own claim" in why for why in told["refused"].values())
    stop.set()
    beating.join(5)
    t.close()
