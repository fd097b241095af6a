"""The analysis of long rings: only each group's tail is fed to the detectors, unless an older
collective disagrees across ranks (a mismatch that did not hang, on NCCL silently wrong)."""

from __future__ import annotations

import json
import pickle
import time
from typing import Any

from hangwatch.postmortem import dumps, replay
from tests.postmortem.factories import fr_dump, fr_entry

T = 1_795_000_000.0


def _folder(seqs: int, odd: dict[int, dict[str, Any]] | None = None) -> dumps.Folder:
    folder = dumps.Folder()
    for rank in range(3):
        entries = []
        for seq in range(1, seqs + 1):
            e = fr_entry(seq, int((T + seq * 0.01) * 1e9), name="nccl:all_reduce", state="completed")
            e.update((odd or {}).get(seq, {}) if rank == 2 else {})
            entries.append(e)
        folder.dumps[rank] = dumps.parse(pickle.dumps(fr_dump(entries)), f"r{rank}", rank, T + seqs)
    return folder


def test_an_old_mismatch_below_the_tail_is_still_found() -> None:
    folder = _folder(1000, {10: {"input_dtypes": ["Long"]}})
    assert replay._tails(folder) == {"0": 0}  # the whole group goes to the rules
    incs = replay.analyze(folder, stuck_after=5.0).incidents
    assert [(i.kind.value, i.seq, i.culprit_ranks) for i in incs] == [("dtype_mismatch", 10, [2])]


def test_a_long_healthy_ring_is_cut_to_its_tail_and_raises_nothing() -> None:
    folder = _folder(1000)
    assert replay._tails(folder) == {"0": 1000 - replay.TAIL}
    assert replay.analyze(folder, stuck_after=5.0).incidents == []


def test_nccl_s_all_to_all_of_one_tensor_is_all_to_all_single_not_a_short_list() -> None:
    """NCCL's ring names ``all_to_all_single`` "all_to_all" (tests/fixtures/nccl/README.md): one
    tensor on each of 3 ranks is not a list one tensor short of the group."""
    folder = _folder(20, {})
    for dump in folder.dumps.values():
        for e in dump.entries:
            e.update(profiling_name="nccl:all_to_all", input_sizes=[[24]])
    events, _, _ = replay._records(folder.dumps[0])
    assert {e.op for e in events} == {"all_to_all_single"}  # type: ignore[attr-defined]
    assert replay.analyze(folder, stuck_after=5.0).incidents == []


def test_a_group_config_of_impossible_ranks_is_bounded() -> None:
    """A dump whose ``pg_config`` claims a million ranks, and ranks no job has: the analysis stays
    fast (no scan of a million ranks per rank) and names only ranks a job can have."""
    folder = _folder(20)
    folder.dumps[0].pg_config = {
        "0": {"ranks": json.dumps(list(range(1_000_000)))},
        "1": {"ranks": "[-5, 1000000000000, 0, true]"},
    }
    for e in folder.dumps[1].entries[-1:]:
        e.update(process_group=("1", ""), collective_seq_id=1, retired=False, _key=("1", 1))
    started = time.monotonic()
    analysis = replay.analyze(folder, stuck_after=0.01)
    assert time.monotonic() - started < 30
    assert analysis.world_size == 1_000_000
    assert replay._groups(folder, analysis.world_size)["1"] == (0, 1)  # -5, 10**12 and true left out


def test_uneven_all_to_all_single_splits_the_ring_does_not_keep_are_no_mismatch() -> None:
    """MoE-style ``all_to_all_single`` with split sizes: each rank sends a different number of
    elements, and Flight Recorder keeps no split sizes to compare: no incident (a false shape
    mismatch before, on dumps and live for C++-issued calls alike)."""
    folder = _folder(20)
    for rank, dump in folder.dumps.items():
        for e in dump.entries:
            e.update(profiling_name="nccl:all_to_all", input_sizes=[[6 + 3 * rank]])
    assert replay.analyze(folder, stuck_after=5.0).incidents == []


def test_times_no_clock_gives_are_unknown_and_the_json_stays_json() -> None:
    folder = _folder(20, {20: {"retired": False}})
    for e in folder.dumps[2].entries:
        e["time_created_ns"] = float("nan")
    raw = {
        "version": "2.10",
        "entries": [{**e, "time_created_ns": 10**40} for e in folder.dumps[1].entries],
    }
    folder.dumps[1] = dumps.parse(pickle.dumps(raw), "r1", 1, T + 100)
    folder.dumps[2] = dumps.parse(
        pickle.dumps({"version": "2.10", "entries": folder.dumps[2].entries}), "r2", 2, T + 100
    )
    analysis = replay.analyze(folder, stuck_after=5.0)
    json.dumps(analysis.incidents_json(), allow_nan=False)  # no NaN, no inf
    assert all("time_created_ns" not in e for e in folder.dumps[1].entries)


def test_a_dump_left_from_another_run_is_pointed_out() -> None:
    folder = _folder(20)
    for dump in folder.dumps.values():
        dump.pg_config = {"": {"ranks": "[0, 1, 2]"}}
    stale = dumps.parse(pickle.dumps({"version": "2.10", "entries": []}), "r3", 3, T - 3600)
    folder.dumps[3] = stale
    notes = replay.analyze(folder, stuck_after=5.0).notes
    assert any("say the job has 3 ranks, yet there are dumps of rank(s) 3" in n for n in notes), notes
    assert any("rank(s) 3 were written more than 600 s apart" in n for n in notes), notes
