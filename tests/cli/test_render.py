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
