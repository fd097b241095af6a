"""``hangwatch analyze`` on real NCCL-ring dumps: the fixtures captured on an H100
(``tests/fixtures/nccl``, see its README), copied with the modification time a dump keeps."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hangwatch.postmortem import dumps, replay

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"


def _copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    latest = max(dumps.latest_time(e) for e in dumps.parse(src.read_bytes(), str(src), 0, 0.0).entries)
    os.utime(dst, (latest + 1.0, latest + 1.0))  # written a second after its last entry


def test_the_watchdog_s_dump_on_timeout_is_read_with_its_states_and_frames(tmp_path: Path) -> None:
    _copy(FIXTURES / "timeout_dumps" / "fr_timeout_rank_0", tmp_path / "fr_timeout_rank_0")
    folder = dumps.load(tmp_path)
    dump = folder.dumps[0]
    assert (dump.format, dump.ring, dump.frames, dump.version) == ("pickle", "nccl", True, "2.10")
    events, frames, p2p = replay._records(dump)
    calls = {e.seq: e for e in events if hasattr(e, "seq")}
    assert calls[1].exit_time is not None and calls[2].exit_time is None  # completed; the one that timed out
    assert calls[1].exit_time == 1795410724274007288 / 1e9  # when the device completed it, from the ring
    assert calls[2].call_site == "capture_nccl_fixtures.py:500 in probe_timeout" and calls[2].step == -1
    assert frames[("0", 2)][0].startswith("all_reduce (") and p2p == 0
    # one rank: no peer to have failed it, so no story is made up
    analysis = replay.analyze(folder, stuck_after=1.0)
    assert analysis.incidents == [] and analysis.world_size == 1 and analysis.missing == []


def test_two_ranks_that_made_the_same_nccl_calls_raise_nothing(tmp_path: Path) -> None:
    for rank in (0, 1):
        _copy(FIXTURES / "nccl_ring_timing0.pkl", tmp_path / f"nccl_trace_rank_{rank}")
    folder = dumps.load(tmp_path, "nccl_trace_rank_")
    analysis = replay.analyze(folder, stuck_after=1.0)
    assert sorted(folder.dumps) == [0, 1] and folder.dumps[0].ring == "nccl"
    assert analysis.incidents == [], [i.summary for i in analysis.incidents]
    assert len({e["process_group"][0] for e in folder.dumps[0].entries}) == 2  # two groups, both read
