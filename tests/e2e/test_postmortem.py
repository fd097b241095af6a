"""``hangwatch analyze`` on real Flight Recorder dumps of real gloo jobs hangwatch was not attached
to (issue 17): each rank dumps its ring from a thread a few seconds in, as a user's own
``_dump_fr_trace`` would (gloo has no dump on timeout), and the job ends. Every fault is
diagnosed as the coordinator would live; the healthy jobs that look most like them (dumps taken
with calls in flight, ranks dumping seconds apart, subgroups that only some ranks use) raise
nothing.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hangwatch.postmortem import dumps, replay
from hangwatch.testing import BIN, Job

INIT = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
world = dist.get_world_size()
import threading
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

def _dump():
    time.sleep(float(os.environ["DUMP_AT"]) + float(os.environ.get("DUMP_SKEW", "0")) * rank)
    json_dump = os.environ.get("DUMP_FORMAT") == "json"
    data = _dump_fr_trace_json(True, False) if json_dump else _dump_fr_trace(True, True, False)
    name = os.path.join(os.environ["DUMP_DIR"], f"nccl_trace_rank_{rank}" + (".json" if json_dump else ""))
    with open(name + ".tmp", "wb") as f:
        f.write(data)
    os.replace(name + ".tmp", name)
    # the others dump too before this rank's exit breaks their connections
    time.sleep(3 + float(os.environ.get("DUMP_SKEW", "0")) * world)
    os._exit(0)

threading.Thread(target=_dump, daemon=True).start()
t = torch.ones(4)
"""

#: Every program ends waiting for its dump (the dump thread ends the process).
END = """
time.sleep(120)
"""

Incidents = list[dict[str, Any]]


def _run(
    torchrun: Callable[..., Job],
    tmp_path: Path,
    body: str,
    *,
    nproc: int = 3,
    dump_at: float = 8.0,
    fmt: str = "pickle",
    skew: float = 0.0,
    name: str = "job",
) -> Path:
    out = tmp_path / f"{name}-dumps"
    out.mkdir()
    env = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "DUMP_DIR": str(out),
        "DUMP_AT": str(dump_at),
        "DUMP_FORMAT": fmt,
        "DUMP_SKEW": str(skew),
    }
    job = torchrun(INIT + body + END, addr=None, nproc=nproc, env=env, name=name)
    try:
        job.proc.wait(60 + dump_at + skew * nproc)
    except subprocess.TimeoutExpired:
        job.kill()
    return out


#: The hang threshold every analysis here uses, faults and healthy look-alikes alike: the faults'
#: waits reach it (dumps 8 s in), the healthy jobs' calls in flight (and the stall of a rank
#: writing its dump) stay under it.
STUCK_AFTER = 5.0


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
def test_a_skipped_all_reduce_is_named_from_the_dumps(torchrun: Callable[..., Job], tmp_path: Path, fmt: str) -> None:
    folder = _run(torchrun, tmp_path, SKIPPED, fmt=fmt, name=f"skipped_{fmt}")
    analysis = _analyze(folder)
    incs = analysis.incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    (inc,) = incs
    assert inc["culprit_ranks"] == [1] and inc["waiting_ranks"] == [0, 2], _brief(incs)
    assert (inc["op"], inc["group"], inc["seq"]) == ("all_reduce", "0", 10)
    assert "in step" not in inc["summary"]  # a dump keeps no step: none is made up
    post = inc["details"]["postmortem"]
    assert post["missing_ranks"] == [] and sorted(post["dumps"]) == ["0", "1", "2"]
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


def test_an_op_mismatch_is_named_from_the_dumps(torchrun: Callable[..., Job], tmp_path: Path) -> None:
    folder = _run(torchrun, tmp_path, OP_MISMATCH, name="op_mismatch")
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


def test_a_shape_mismatch_is_named_from_the_dumps(torchrun: Callable[..., Job], tmp_path: Path) -> None:
    folder = _run(torchrun, tmp_path, SHAPE_MISMATCH, name="shape_mismatch")
    analysis = _analyze(folder)
    incs = analysis.incidents_json()
    assert incs and incs[0]["kind"] == "shape_mismatch", (_brief(incs), analysis.missing)
    assert incs[0]["culprit_ranks"] == [0], _brief(incs)


FROZEN = """
for step in range(6):
    dist.all_reduce(t)
    if rank == 2 and step == 3:
        sum(range(10**11))                  # rank 2 freezes holding the GIL: it writes no dump
"""


def test_a_rank_that_wrote_no_dump_is_missing_and_named(torchrun: Callable[..., Job], tmp_path: Path) -> None:
    """The highest rank's dump is missing, so only the job's size (given, as a user who knows it
    would) says it exists; its absence is said, and it is the rank the others wait for."""
    folder = _run(torchrun, tmp_path, FROZEN, name="frozen")
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


def test_a_hang_on_a_subgroup_names_its_member(torchrun: Callable[..., Job], tmp_path: Path) -> None:
    folder = _run(torchrun, tmp_path, SUBGROUP_HANG, name="subgroup")
    incs = _analyze(folder).incidents_json()
    assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)
    inc = incs[0]
    assert inc["group"] != "0" and inc["culprit_ranks"] == [2] and inc["waiting_ranks"] == [0], _brief(incs)


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


@pytest.mark.parametrize("skew", [0.0, 1.5])
def test_dumps_of_a_busy_healthy_job_raise_nothing(torchrun: Callable[..., Job], tmp_path: Path, skew: float) -> None:
    """Dumps written mid-run, with calls in flight on some ranks, and (skew) seconds apart: a
    call in flight in an early dump is not a hang because later dumps show the job moved on."""
    folder = _run(torchrun, tmp_path, HEALTHY_BUSY, skew=skew, name=f"busy_{skew}".replace(".", "_"))
    analysis = _analyze(folder)
    assert analysis.ranks == [0, 1, 2] and analysis.missing == []
    assert analysis.incidents_json() == [], _brief(analysis.incidents_json())


HEALTHY_DONE = """
for step in range(20):
    dist.all_reduce(t)
    if rank == 0:
        dist.broadcast(t, src=0)            # not a mismatch: everyone broadcasts below
    else:
        dist.broadcast(t, src=0)
dist.barrier()
"""


def test_dumps_of_a_finished_healthy_job_raise_nothing(torchrun: Callable[..., Job], tmp_path: Path) -> None:
    folder = _run(torchrun, tmp_path, HEALTHY_DONE, name="done")
    analysis = _analyze(folder)
    assert analysis.incidents_json() == [], _brief(analysis.incidents_json())


# --------------------------------------------------------------------------------------------
# the command


def test_the_command_prints_the_report_and_the_json_contract(torchrun: Callable[..., Job], tmp_path: Path) -> None:
    folder = _run(torchrun, tmp_path, SKIPPED, name="cli")
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
    assert incs[0]["details"]["postmortem"]["missing_ranks"] == [3]
    assert "no dump of rank 3 (of 4)" in out.stderr
