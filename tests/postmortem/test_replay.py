"""The analysis of long rings: only each group's tail is fed to the detectors, unless an older
collective disagrees across ranks (a mismatch that did not hang, on NCCL silently wrong)."""

from __future__ import annotations

import json
import pickle
import time
from typing import Any

from hangwatch.postmortem import dumps, replay

T = 1_795_000_000.0


def _folder(seqs: int, odd: dict[int, dict[str, Any]] | None = None) -> dumps.Folder:
    folder = dumps.Folder()
    for rank in range(3):
        entries = []
        for seq in range(1, seqs + 1):
            e = {
                "collective_seq_id": seq,
                "process_group": ("0", "default_pg"),
                "profiling_name": "nccl:all_reduce",
                "input_sizes": [[4]],
                "input_dtypes": ["Float"],
                "retired": True,
                "state": "completed",
                "time_created_ns": int((T + seq * 0.01) * 1e9),
            }
            e.update((odd or {}).get(seq, {}) if rank == 2 else {})
            entries.append(e)
        doc = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": entries}
        folder.dumps[rank] = dumps.parse(pickle.dumps(doc), f"r{rank}", rank, T + seqs)
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
        "1": {"ranks": "[-5, 1000000000000, 1, true]"},
    }
    for e in folder.dumps[1].entries[-1:]:
        e.update(process_group=("1", ""), collective_seq_id=1, retired=False, _key=("1", 1))
    started = time.monotonic()
    analysis = replay.analyze(folder, stuck_after=0.01)
    assert time.monotonic() - started < 30
    assert analysis.world_size == 1_000_000
    assert all(0 <= rk < 1_000_000 for inc in analysis.incidents for rk in inc.culprit_ranks + inc.waiting_ranks)
