"""``hangwatch report``'s text: what the diagnosis found beyond the summary is shown too."""

from __future__ import annotations

import io
from typing import Any

from hangwatch.cli.render import render_report


def _incident(**details: Any) -> dict[str, Any]:
    return {
        "id": "inc-0001", "kind": "stuck_collective", "severity": "error", "status": "open", "summary": "s",
        "hint": "h", "culprit_ranks": [1], "waiting_ranks": [0], "op": "all_reduce", "group": "0", "seq": 10,
        "step": 4, "onset_time": 1000.0, "detected_time": 1005.0, "details": details,
    }  # fmt: skip


def test_the_report_shows_the_skip_the_gpu_side_the_repeats_and_the_aftermath() -> None:
    out = io.StringIO()
    render_report(
        _incident(
            skipped={"rank": 1, "op": "all_reduce", "call_site": "train.py:44 in train", "step": 4, "seq": 10},
            host={"0": "train.py:57 in train_step"},
            timeout_at=1600.0,
            gpus="rank 0's GPU 0 at 100 %",
            repeats={"count": 7, "last_seq": 8, "last_step": 8},
            aftermath={"summary": "rank 0 then died: its process was killed by SIGABRT (signal 6)"},
        ),
        out,
    )
    text = out.getvalue()
    assert "skipped call: rank 1 never made all_reduce at train.py:44 in train (step 4, seq 10)" in text
    assert "rank 0: train.py:57 in train_step" in text and "torch's own timeout fires at" in text
    assert "GPUs: rank 0's GPU 0 at 100 %" in text
    assert "repeated: 7 more time(s) since, the latest at seq 8 (step 8)" in text
    assert "aftermath (what this caused): rank 0 then died" in text


def test_a_plain_incident_shows_none_of_it() -> None:
    out = io.StringIO()
    render_report(_incident(), out)
    assert "skipped call" not in out.getvalue() and "aftermath" not in out.getvalue()


def test_status_tells_who_is_joining_and_a_coordinator_behind() -> None:
    from hangwatch.cli.render import render_status

    status = {
        "job": {
            "id": "j", "registered": 0, "world_size": 3, "stuck_after": 60, "behind_s": 2.4, "time": 1000.0,
            "joining": {
                "0": {"phase": "init", "pid": 1, "host": "a", "since": 990.0, "where": ""},
                "1": {"phase": "starting", "pid": 2, "host": "a", "since": 980.0,
                      "where": "download_dataset at train.py:12"},
                "2": {"phase": "init", "pid": 3, "host": "b", "since": 991.0, "where": ""},
            },
        },
        "ranks": [],
        "incidents": [],
    }  # fmt: skip
    out = io.StringIO()
    render_status(status, out)
    text = out.getvalue()
    assert (
        "joining: ranks 0, 2 in init_process_group; rank 1 not in init_process_group yet "
        "(download_dataset at train.py:12)\n"
    ) in text
    assert "coordinator: 2.4 s behind its batches (saturated)" in text


def test_the_report_shows_who_waited_for_whom() -> None:
    out = io.StringIO()
    graph = {
        "waits": [{"group": "0", "seq": 10, "op": "all_reduce", "ranks": [0], "waits_for": [1]}],
        "hangs": [{"ranks": [1], "stand": "busy", "upstream": [0]}],
        "hosts": {"node-a": [0, 1]},
    }
    render_report(_incident(graph=graph), out)
    assert "who waited for whom (report --graph; --format dot to draw it):\n" in out.getvalue()
    assert "  rank 0 (node-a) waits in all_reduce (group 0, seq 10) for rank 1 (node-a)\n" in out.getvalue()
