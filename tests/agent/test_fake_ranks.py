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
from typing import Any

import psutil
import pytest

from hangwatch import records as r
from hangwatch.client.transport import Transport
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job, wait_for
from tests import factories

pytestmark = pytest.mark.slow

SLEEPER = [
    sys.executable,
    "-c",
    "import time\ndef secret_function_name():\n    time.sleep(120)\nsecret_function_name()",
]


def _heartbeats(t: Transport, idents: list[r.RankIdentity]) -> tuple[threading.Event, threading.Thread]:
    """The fake ranks keep "reporting", as busy live ranks would, until the event is set."""
    stop = threading.Event()

    def beat() -> None:
        n = 1
        while not stop.wait(0.3):
            n += 1
            for ident in idents:
                t.report(ident, n, [], 0, 0)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    return stop, beating


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
    stop, beating = _heartbeats(t, idents)
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


VICTIM = """
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(600):  # a healthy rank of another job, linked to the node's agent (so proven)
    dist.all_reduce(t)
    time.sleep(0.05)
"""


def test_a_claim_of_another_jobs_proven_rank_is_still_a_claim(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job]
) -> None:
    """A real rank of job A links to the embedded agent and is proven. A client registers job
    B, whose "rank 0" carries that rank's pid and start time, and makes job B hang. The agent
    proved the pid, but not for job B's rank: job B's abort and dump must not touch it."""
    c = coordinator_factory(stuck_after=2.0, abort_on_hang=True)
    job = torchrun(VICTIM, addr=f"127.0.0.1:{c.port}", nproc=1, name="victim")

    def proven_victim() -> r.RankIdentity | None:
        with c.lock:
            for st in c.jobs.ranks():
                if st.proven:
                    return st.identity
        return None

    real = wait_for(proven_victim, 60, 0.1, "job A's rank linked and proven")
    t = Transport(f"127.0.0.1:{c.port}", None)
    waiter = subprocess.Popen(["sleep", "120"])  # job B's "rank 1": some live process
    fake = [
        r.RankIdentity("b", 0, 2, real.host, real.pid, start_time=real.start_time, session="b0"),
        r.RankIdentity(
            "b", 1, 2, real.host, waiter.pid, start_time=psutil.Process(waiter.pid).create_time(), session="b1"
        ),
    ]
    for ident in fake:
        t.register(ident)
    t.report(fake[1], 1, [factories.call(1, 1, call_id=1, enter_time=time.time())], 0, 0)
    stop, beating = _heartbeats(t, fake)
    try:
        inc = wait_for(lambda: next((i for i in c.incidents_json() if i["job"] == "b"), None), 15, 0.1, "job B's hang")
        assert inc["culprit_ranks"] == [0]
        told = wait_for(
            lambda: (c.incident_json(inc["id"]) or {})["details"].get("abort"), 20, 0.1, "job B's abort outcome"
        )
        assert told["signalled_pids"] == [], told
        assert "0" in told["refused"], told
        time.sleep(2.0)  # a SIGTERM would have landed by now
        assert job.proc.poll() is None, "job A's rank was killed by job B's abort"
        notes = (c.incident_json(inc["id"]) or {})["stack_notes"]
        assert "0" in notes and (c.incident_json(inc["id"]) or {})["stacks"] == {}, notes
        assert all(i["job"] == "b" for i in c.incidents_json()), "job A raised an incident"
    finally:
        stop.set()
        beating.join(5)
        t.close()
        job.kill()
        waiter.kill()
        waiter.wait(5)


ATTACKER = """
import sys, time
from hangwatch import link
from hangwatch import records as r
from hangwatch.client.transport import Transport
from hangwatch.ring import RingWriter
addr, path, host, pid, started = sys.argv[1:6]
claim = r.RankIdentity("b", 0, 2, host, int(pid), start_time=float(started), session="S")
Transport(addr, None).register(claim)  # job B's rank 0 is the victim: a claim
ring = RingWriter(capacity=4096, blob_bytes=4096, rank=0)
hello = {"job_id": "b", "rank": 0, "world_size": 2, "session": "S", "pid": int(pid)}
sock = link.connect(path, hello, [ring.fd])  # then link itself with the same session
print("linked" if sock is not None else "refused", flush=True)
time.sleep(120)
"""


def test_a_claim_and_a_link_of_one_session_prove_the_linked_process_not_the_claimed_one(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job]
) -> None:
    """The critical attack: a direct registration names job A's proven rank as job B's rank 0
    under session S, and the attacker then links to the agent itself with session S. Before,
    the claim was marked proven: job B's dump returned the victim's stack and its abort
    SIGTERMed the victim. Now the rank is the attacker's own process, and only it is touched."""
    c = coordinator_factory(stuck_after=2.0, abort_on_hang=True)
    job = torchrun(VICTIM, addr=f"127.0.0.1:{c.port}", nproc=1, name="victim")

    def proven_victim() -> r.RankIdentity | None:
        with c.lock:
            return next((st.identity for st in c.jobs.ranks() if st.proven), None)

    real = wait_for(proven_victim, 60, 0.1, "job A's rank linked and proven")
    assert c.rings is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    args = [f"127.0.0.1:{c.port}", c.rings.path, real.host, str(real.pid), repr(real.start_time)]
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, *args], stdout=subprocess.PIPE, text=True, env=env)
    t = Transport(f"127.0.0.1:{c.port}", None)
    waiter = subprocess.Popen(["sleep", "120"])  # job B's "rank 1": some live process
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "linked"
        one = r.RankIdentity(
            "b", 1, 2, real.host, waiter.pid, start_time=psutil.Process(waiter.pid).create_time(), session="b1"
        )
        t.register(one)
        t.report(one, 1, [factories.call(1, 1, call_id=1, enter_time=time.time())], 0, 0)
        stop, beating = _heartbeats(t, [one])

        def rank0() -> r.RankIdentity | None:
            with c.lock:
                job_b = next((j for j in c.jobs.by_key.values() if j.job_id == "b"), None)
                st = job_b.ranks.get(0) if job_b is not None else None
                return st.identity if st is not None and st.proven else None

        assert wait_for(rank0, 15, 0.1, "job B's rank 0 proven").pid == attacker.pid
        inc = wait_for(lambda: next((i for i in c.incidents_json() if i["job"] == "b"), None), 15, 0.1, "job B's hang")
        assert inc["culprit_ranks"] == [0]

        def outcome() -> dict[str, Any] | None:
            told = (c.incident_json(inc["id"]) or {})["details"].get("abort")
            # rank 1's refusal is written first; rank 0's outcome comes from the agent after
            return told if told and (told["signalled_pids"] or "0" in told["refused"]) else None

        told = wait_for(outcome, 20, 0.1, "job B's abort outcome")
        assert told["signalled_pids"] == [attacker.pid], told  # its own process, and only it
        time.sleep(2.0)  # a SIGTERM to the victim would have landed by now
        assert job.proc.poll() is None, "job A's rank was killed by job B's abort"
        assert "all_reduce" not in str((c.incident_json(inc["id"]) or {})["stacks"])  # not the victim's stack
        assert all(i["job"] == "b" for i in c.incidents_json()), "job A raised an incident"
        stop.set()
        beating.join(5)
    finally:
        t.close()
        job.kill()
        for proc in (waiter, attacker):
            proc.kill()
            proc.wait(5)
