"""``hangwatch analyze`` on real Flight Recorder dumps of real gloo jobs hangwatch was not attached
to (issue 17): each rank dumps its ring from a thread a few seconds in, as a user's own
``_dump_fr_trace`` would (gloo has no dump on timeout), and the job ends. Every fault is
diagnosed as the coordinator would live; the healthy jobs that look most like them (dumps taken
with calls in flight, ranks dumping seconds apart, subgroups that only some ranks use) raise
nothing.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.postmortem import dumps, replay
from hangwatch.testing import BIN, fr_dump_job

#: The hang threshold every analysis here uses, faults and healthy look-alikes alike: the faults'
#: waits reach it (dumps 8 s in), the healthy jobs' calls in flight (and the stall of a rank
#: writing its dump) stay under it.
STUCK_AFTER = 5.0

Incidents = list[dict[str, Any]]


def _analyze(folder: Path, **kwargs: Any) -> replay.Analysis:
    return replay.analyze(dumps.load(folder), stuck_after=STUCK_AFTER, **kwargs)


def _brief(incs: Incidents) -> str:
    return "; ".join(f"{i['kind']} {i['culprit_ranks']}: {i['summary']}" for i in incs) or "none"


# --------------------------------------------------------------------------------------------
# faults


SKIPPED = """
for step in range(5):
    dist.all_reduce(t)                      # the loss
    if not (rank == 1 and step == 3):       # rank 1 skips its metric sync once
        dist.all_reduce(t)
"""


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_a_skipped_all_reduce_is_named_from_the_dumps(jobs: Jobs, fmt: str) -> None:
    folder = jobs[f"skipped_{fmt}"]
    analysis = _analyze(folder)
    incs = analysis.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    (inc,) = incs
    assert inc["culprit_ranks"] == [1] and inc["waiting_ranks"] == [0, 2], _brief(incs)
    assert (inc["op"], inc["group"], inc["seq"]) == ("all_reduce", "0", 10)
    assert "in step" not in inc["summary"]  # a dump keeps no step: none is made up
    post = inc["details"]["postmortem"]
    assert post["missing_ranks"] == "" and sorted(post["dumps"]) == ["0", "1", "2"]
    if fmt == "pickle":  # the stack frames torch recorded name the line: the skip can be seen
        assert "rank 1 skipped all_reduce at skipped_pickle.py:" in inc["summary"], inc["summary"]
        assert "(seq 8)" in inc["summary"]
        assert "issuing all_reduce (group 0, seq 10)" in inc["stacks"]["0"]
        assert "not where it is now" in inc["stacks"]["1"]
    else:  # no frames: every call looks alike, so no skip is claimed, only what is known
        assert "skipped" not in inc["summary"] and "C++" not in inc["summary"], inc["summary"]
        assert "rank 1 is outside any collective" in inc["summary"]
        assert inc["stacks"] == {}
        assert any("no stack frames" in note for note in analysis.notes)


OP_MISMATCH = """
for step in range(3):
    dist.all_reduce(t)
if rank == 2:
    dist.broadcast(t, src=0)                # the bug: rank 2 alone broadcasts
else:
    dist.all_reduce(t)
"""


def test_an_op_mismatch_is_named_from_the_dumps(jobs: Jobs) -> None:
    folder = jobs["op_mismatch"]
    incs = _analyze(folder).incidents_json()
    assert incs and incs[0]["kind"] == "op_mismatch", _brief(incs)
    assert incs[0]["culprit_ranks"] == [2] and incs[0]["seq"] == 4, _brief(incs)
    assert "broadcast" in incs[0]["summary"] and "all_reduce" in incs[0]["summary"]


SHAPE_MISMATCH = """
for step in range(3):
    dist.all_reduce(t)
weights = torch.ones(4 if rank == 0 else 8)  # the bug: rank 0 built a smaller model
dist.broadcast(weights, src=0)              # it is sent; the others wait for the rest
"""


def test_a_shape_mismatch_is_named_from_the_dumps(jobs: Jobs) -> None:
    folder = jobs["shape_mismatch"]
    analysis = _analyze(folder)
    incs = analysis.incidents_json()
    assert incs and incs[0]["kind"] == "shape_mismatch", (_brief(incs), analysis.missing)
    assert incs[0]["culprit_ranks"] == [0], _brief(incs)


FROZEN = """
for step in range(6):
    dist.all_reduce(t)
    if rank == 2 and step == 3:
        import ctypes                       # rank 2 freezes in native code holding the GIL (no
        ctypes.PyDLL(None).sleep(300)       # CPU spent): its dump thread never runs
"""


def test_a_rank_that_wrote_no_dump_is_missing_and_named(jobs: Jobs) -> None:
    """The highest rank's dump is missing, so only the job's size (given, as a user who knows it
    would) says it exists; its absence is said, and it is the rank the others wait for."""
    folder = jobs["frozen"]
    analysis = _analyze(folder, world_size=3)
    assert analysis.missing == [2] and analysis.ranks == [0, 1]
    assert any("no dump of rank 2" in note for note in analysis.notes)
    incs = analysis.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    assert incs[0]["culprit_ranks"] == [2] and incs[0]["waiting_ranks"] == [0, 1], _brief(incs)
    assert incs[0]["stack_notes"]["2"] == "no dump of this rank"
    assert "rank(s) 2 wrote no Flight Recorder dump" in incs[0]["summary"], incs[0]["summary"]
    assert "HANGWATCH_ADDR" not in incs[0]["hint"]


SUBGROUP_HANG = """
pair = dist.new_group([0, 2])
for step in range(3):
    dist.all_reduce(t)
    if rank in (0, 2):
        dist.all_reduce(t, group=pair)
if rank == 0:
    dist.all_reduce(t, group=pair)          # rank 2 never makes this one
"""


def test_a_hang_on_a_subgroup_names_its_member(jobs: Jobs) -> None:
    folder = jobs["subgroup"]
    incs = _analyze(folder).incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    inc = incs[0]
    assert inc["group"] != "0" and inc["culprit_ranks"] == [2] and inc["waiting_ranks"] == [0], _brief(incs)


P2P_HANG = """
for step in range(3):
    dist.all_reduce(t)
if rank == 1:
    dist.recv(t, src=0)                     # a pipeline stage waits for activations never sent
"""


def test_a_p2p_hang_gloo_does_not_record_is_not_made_up(jobs: Jobs) -> None:
    analysis = _analyze(jobs["p2p"])
    assert analysis.incidents_json() == [], _brief(analysis.incidents_json())
    assert any("records no send or recv" in note for note in analysis.notes), analysis.notes


# --------------------------------------------------------------------------------------------
# healthy jobs that look like faults


HEALTHY_BUSY = """
pair = dist.new_group([0, 2])
deadline = time.time() + 30
step = 0
while time.time() < deadline:               # still training when the dumps are taken
    dist.all_reduce(t)
    if rank in (0, 2) and step % 3 == 0:
        dist.all_reduce(t, group=pair)      # a subgroup only some ranks are in
    if rank == 0 and step % 10 == 0:
        time.sleep(0.05)                    # rank 0 logs now and then: the others wait on it
    step += 1
"""


def test_dumps_of_a_busy_healthy_job_raise_nothing(jobs: Jobs) -> None:
    """Dumps written mid-run, with calls in flight on some ranks, 1.5 s apart from one rank to the
    next: a call in flight in an early dump is not a hang because later dumps show the job moved
    on, nor is a subgroup only some ranks are in, nor rank 0's pauses."""
    folder = jobs["busy"]
    analysis = _analyze(folder)
    assert analysis.ranks == [0, 1, 2] and analysis.missing == []
    assert analysis.incidents_json() == [], _brief(analysis.incidents_json())


# --------------------------------------------------------------------------------------------
# the jobs: run before the module's tests, three at a time (they mostly wait for their dumps)

Jobs = dict[str, Path]

RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "skipped_pickle": (SKIPPED, {}),
    "skipped_json": (SKIPPED, {"fmt": "json"}),
    "op_mismatch": (OP_MISMATCH, {}),
    "shape_mismatch": (SHAPE_MISMATCH, {}),
    "frozen": (FROZEN, {}),
    "subgroup": (SUBGROUP_HANG, {}),
    "p2p": (P2P_HANG, {}),
    # a ring of 500: writing a dump with stack frames stops the rank while torch symbolizes them
    # (2 s for 2,000 entries here idle, over 5 s under the suite's load: the others wait on it,
    # as real as any stall), so the threshold would measure the dump, not the job
    "busy": (HEALTHY_BUSY, {"skew": 1.5, "ring": 500}),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    root = tmp_path_factory.mktemp("postmortem")

    def run(name: str) -> Path:
        body, kwargs = RUNS[name]
        return fr_dump_job(body, root, name=name.replace(".", "_"), **kwargs)

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(RUNS, pool.map(run, RUNS), strict=True))


# --------------------------------------------------------------------------------------------
# the command


def test_the_command_prints_the_report_and_the_json_contract(jobs: Jobs, tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    shutil.copytree(jobs["skipped_pickle"], folder)
    (folder / "nccl_trace_rank_7").write_bytes(b"\x80\x04garbage")
    cmd = [str(BIN / "hangwatch"), "analyze", str(folder), "--stuck-after", str(STUCK_AFTER)]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "Flight Recorder dumps of 3 ranks of 3: 0-2; pickle (cpu ring, with stack frames)" in text.stdout
    assert "nccl_trace_rank_7: skipped: not a pickle torch wrote" in text.stderr, text.stderr  # not a rank
    assert "Stuck collective" in text.stdout and "culprit ranks  1" in text.stdout, text.stdout
    assert "step           unknown" in text.stdout
    out = subprocess.run([*cmd, "--json", "--world-size", "4"], capture_output=True, text=True, timeout=60)
    incs = json.loads(out.stdout)
    assert [i["kind"] for i in incs] == ["stuck_collective"] and incs[0]["culprit_ranks"] == [1]  # not 3
    assert incs[0]["summary"].endswith("; no dump of rank 3: unknown"), incs[0]["summary"]
    assert incs[0]["details"]["postmortem"]["missing_ranks"] == "3"
    assert "no dump of rank 3 (of 4)" in out.stderr


def test_a_live_job_s_dumps_imported_join_the_incident_it_raised(coordinator: Coordinator, tmp_path: Path) -> None:
    """The same fault in a job hangwatch watches live: its diagnosis and the dumps' meet in one
    incident (``hangwatch analyze --import``), not two."""
    folder = fr_dump_job(SKIPPED, tmp_path, name="live", addr=f"127.0.0.1:{coordinator.port}")
    live = [i for i in coordinator.incidents_json() if i["kind"] == "stuck_collective"]
    assert [i["culprit_ranks"] for i in live] == [[1]], _brief(coordinator.incidents_json())
    cmd = [str(BIN / "hangwatch"), "analyze", str(folder), "--import", "--addr", f"127.0.0.1:{coordinator.port}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"{live[0]['id']}: the dumps' entries attached" in done.stdout, done.stdout
    assert "found in the dumps only" not in done.stdout
    inc = coordinator.incident_json(live[0]["id"])
    assert inc is not None
    fr = inc["details"]["flight_recorder"]
    assert fr["agrees"] is True, (fr["diagnosis"], inc["summary"])
    assert {rk: e["reached"] for rk, e in fr["ranks"].items()} == {"0": True, "1": False, "2": True}
    assert [i["id"] for i in coordinator.incidents_json() if i["kind"] == "stuck_collective"] == [live[0]["id"]]
