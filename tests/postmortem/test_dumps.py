"""Reading a folder of Flight Recorder dumps: what is refused and why, which file stands for a rank.

The dumps' contents are tested on real ones (``tests/e2e/test_postmortem.py``); here the inputs
are the bad ones a folder can hold (hostile pickles, truncated files, foreign JSON, huge files)
and the names torch and users give dump files.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from hangwatch.postmortem import dumps, replay
from tests.postmortem.factories import fr_dump, fr_entry


def _dump(entries: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return fr_dump(entries or [], **{"pg_status": {"0": {"last_enqueued_collective": 1}}, **extra})


def _entry(seq: int, frames: bool = False) -> dict[str, Any]:
    return fr_entry(seq, 1_795_000_000_000_000_000 + seq, line=42 if frames else None)


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_names_code_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump(extra=_Boom(marker))))
    folder = dumps.load(tmp_path)
    assert folder.dumps == {} and not marker.exists()
    (why,) = folder.refused.values()
    assert "names posix.system" in why and "plain data" in why


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (pickle.dumps(_dump())[:20], "not a pickle torch wrote"),
        (b"{not json", "not valid JSON"),
        (json.dumps({"some": "other tool's file"}).encode(), "no list of entries"),
        (pickle.dumps([1, 2, 3]), "no list of entries"),
        (b"", "not a pickle torch wrote"),
    ],
)
def test_what_is_not_a_dump_is_refused_with_why_and_the_rest_is_read(tmp_path: Path, data: bytes, why: str) -> None:
    (tmp_path / "nccl_trace_rank_1").write_bytes(data)
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump([_entry(1)])))
    folder = dumps.load(tmp_path)
    assert sorted(folder.dumps) == [0]
    assert why in folder.refused[str(tmp_path / "nccl_trace_rank_1")]


def test_a_file_too_big_to_be_a_dump_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dumps, "MAX_DUMP_BYTES", 100)
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"{" + b" " * 200 + b"}")
    folder = dumps.load(tmp_path)
    assert "bigger than any Flight Recorder dump" in folder.refused[str(tmp_path / "nccl_trace_rank_0")]


@pytest.mark.parametrize(
    ("name", "prefix", "rank"),
    [
        ("nccl_trace_rank_3", "", 3),
        ("nccl_trace_rank_12", "nccl_trace_rank_", 12),
        ("fr_7.json", "", 7),
        ("dump-rank5.pkl", "", 5),
        ("nccl_trace_rank_3.tmp", "", None),  # a dump being written
        ("notes.txt", "", None),
        ("nccl_trace_rank_3", "other_", None),
    ],
)
def test_the_rank_is_the_number_a_name_ends_with(name: str, prefix: str, rank: int | None) -> None:
    assert dumps.rank_of(name, prefix) == rank


def test_of_two_dumps_of_a_rank_the_one_with_frames_is_used_and_the_other_listed(tmp_path: Path) -> None:
    (tmp_path / "r0.json").write_text(json.dumps(_dump([_entry(1), _entry(2)])))
    (tmp_path / "r0.pkl").write_bytes(pickle.dumps(_dump([_entry(1, frames=True)])))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r1").write_bytes(b"ignored: a folder's own folders are not read")
    folder = dumps.load(tmp_path)
    assert sorted(folder.dumps) == [0]
    assert folder.dumps[0].format == "pickle" and folder.dumps[0].frames
    assert folder.duplicates == {0: [str(tmp_path / "r0.json")]}


def test_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(dumps.DumpError, match="not a folder"):
        dumps.load(tmp_path / "nowhere")


def test_no_readable_dump_is_an_analysis_that_says_so(tmp_path: Path) -> None:
    analysis = replay.analyze(dumps.load(tmp_path))
    assert analysis.incidents == [] and analysis.notes == ["no dump could be read"]


def test_json_status_written_as_text_is_read_as_numbers() -> None:
    raw = json.dumps(_dump(pg_status={"0": {"last_completed_collective": "3", "bad": "x"}})).encode()
    dump = dumps.parse(raw, "r0.json", 0, 0.0)
    assert dump.pg_status == {"0": {"last_completed_collective": 3}}


def test_a_rank_s_two_rings_are_one_dump_and_a_group_both_number_is_kept_apart(tmp_path: Path) -> None:
    """``"cpu:gloo,cuda:nccl"``: one group id "0" in both rings, each numbering its own calls."""
    nccl = [{**_entry(1), "profiling_name": "nccl:all_reduce"}, {**_entry(2), "profiling_name": "nccl:broadcast"}]
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump(nccl, comm_lib_version="2.28.9")))
    (tmp_path / "fr_cpu_rank_0").write_bytes(pickle.dumps(_dump([_entry(1)])))
    folder = dumps.load(tmp_path)
    dump = folder.dumps[0]
    assert dump.ring == "cpu+nccl" and folder.duplicates == {}
    seen = sorted((e["process_group"][0], e["collective_seq_id"]) for e in dump.entries)
    assert seen == [("0", 1), ("0", 2), ("0 (cpu ring)", 1)]
    assert sorted(e["_key"] for e in dump.entries) == seen  # what analysis reads agrees


def test_a_long_ring_keeps_every_call_site_and_only_its_tail_s_frames() -> None:
    """Frames are most of a dump's size: older entries keep their call site, the tail its frames."""
    entries = [_entry(seq, frames=True) for seq in range(1, 301)]
    entries[0]["frames"] = [{"filename": "/home/me/eval.py", "line": 7, "name": "evaluate"}]
    dump = dumps.parse(pickle.dumps(_dump(entries)), "r0", 0, 0.0)
    assert dump.frames and len(dump.entries) == 300
    assert [("frames" in e) for e in dump.entries] == [False] * (300 - dumps.KEEP_FRAMES) + [True] * dumps.KEEP_FRAMES
    assert dump.entries[0]["call_site"] == "eval.py:7 in evaluate"
    assert {e["call_site"] for e in dump.entries[1:]} == {"train.py:42 in step"}


def test_a_rank_number_no_job_has_is_refused_not_counted(tmp_path: Path) -> None:
    """A file named for rank 99,999,999,999 would make every rank below it "missing"."""
    (tmp_path / "nccl_trace_rank_99999999999").write_bytes(pickle.dumps(_dump([_entry(1)])))
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump([_entry(1)])))
    folder = dumps.load(tmp_path)
    assert sorted(folder.dumps) == [0]
    assert "beyond the 1048576 ranks" in folder.refused[str(tmp_path / "nccl_trace_rank_99999999999")]
    analysis = replay.analyze(folder, world_size=10**12)  # a mistyped --world-size: bounded too
    assert analysis.world_size == dumps.MAX_RANKS and "1-1048575" in analysis.notes[0]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'{"entries": [], "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "not a Flight Recorder dump torch wrote"),
        (pickle.dumps(_dump([_entry(1)] * 300_000)), "more than any Flight Recorder ring keeps"),
    ],
)
def test_a_dump_too_deep_or_too_long_is_refused_not_a_traceback(tmp_path: Path, data: bytes, why: str) -> None:
    (tmp_path / "nccl_trace_rank_1").write_bytes(data)
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump([_entry(1)])))
    folder = dumps.load(tmp_path)
    assert sorted(folder.dumps) == [0] and why in folder.refused[str(tmp_path / "nccl_trace_rank_1")]


def test_an_entry_of_foreign_types_is_passed_over_and_the_rest_analysed(tmp_path: Path) -> None:
    bad = {**_entry(2), "process_group": 5, "collective_seq_id": "x", "input_sizes": "?"}
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump([_entry(1), bad])))
    folder = dumps.load(tmp_path)
    assert folder.refused == {} and len(folder.dumps[0].entries) == 2
    replay.analyze(folder)  # no exception


def test_a_pickle_whose_memo_names_one_list_everywhere_is_refused_at_once(tmp_path: Path) -> None:
    """A pickle's memo lets a few bytes name one object many times over: 100 x 100 x 100 sizes
    from a pickle of under 2 KB. Every reader that visits the entries pays for the tree, not the
    file (16 KB of such a pickle took 6 s); it is refused before anything visits it."""
    leaf = [[4]] * 100
    bomb = [[leaf] * 100] * 100
    data = pickle.dumps(_dump([{**_entry(1), "input_sizes": bomb}]))
    assert len(data) < 4096
    (tmp_path / "nccl_trace_rank_1").write_bytes(data)
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump([_entry(1)])))
    started = time.monotonic()
    folder = dumps.load(tmp_path)
    assert time.monotonic() - started < 2.0
    assert sorted(folder.dumps) == [0] and "shared parts" in folder.refused[str(tmp_path / "nccl_trace_rank_1")]


def test_json_of_more_objects_than_its_size_allows_is_refused_unparsed(tmp_path: Path) -> None:
    """16 MiB of ``{}`` made 5.6 million dicts (100 MiB of them took analyze to 2.6 GB)."""
    (tmp_path / "nccl_trace_rank_1").write_bytes(b'{"entries": [' + b"{}," * ((16 << 20) // 3) + b"{}]}")
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump([_entry(1)])))
    tracemalloc.start()
    try:
        folder = dumps.load(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(folder.dumps) == [0] and "objects in" in folder.refused[str(tmp_path / "nccl_trace_rank_1")]
    assert peak < 64 << 20, peak


def test_a_folder_s_links_to_what_never_ends_are_refused_without_waiting(tmp_path: Path) -> None:
    """A dump that is a link to ``/proc/kmsg`` (reads block until the kernel logs), or a FIFO
    (its open blocks until a writer comes): ``analyze`` hung on them."""
    os.symlink("/proc/kmsg", tmp_path / "nccl_trace_rank_1")
    os.mkfifo(tmp_path / "nccl_trace_rank_2")
    os.symlink("/dev/zero", tmp_path / "nccl_trace_rank_3")
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump([_entry(1)])))
    started = time.monotonic()
    folder = dumps.load(tmp_path)
    assert time.monotonic() - started < 2.0
    assert sorted(folder.dumps) == [0]  # the FIFO and the device are not files: passed over
    why = folder.refused[str(tmp_path / "nccl_trace_rank_1")]
    assert "empty file" in why or "unreadable" in why, why  # /proc says it is empty: never read


def test_analyze_prints_no_control_character_from_a_dump(tmp_path: Path) -> None:
    """Names in a dump reach the terminal in ``analyze``'s report: an escape sequence there could
    move the cursor or rewrite a line (the live CLI replaces them at ingest)."""
    evil = {**_entry(1), "profiling_name": "gloo:all_reduce\x1b[2J\x07", "process_group": ("0", "pg\x1b[31m")}
    for rank in (0, 1):
        entries = [_entry(1), {**evil, "collective_seq_id": 2, "retired": False}] if rank == 0 else [_entry(1)]
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(_dump(entries)))
    (tmp_path / "nccl_trace_rank_\x1b[1m7").write_bytes(b"junk")
    done = subprocess.run(
        [sys.executable, "-m", "hangwatch.cli.main", "analyze", str(tmp_path), "--stuck-after", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "all_reduce" in done.stdout and "\ufffd" in done.stdout + done.stderr
    assert not any(c in done.stdout + done.stderr for c in "\x1b\x07\r"), (done.stdout, done.stderr)
