"""Flight Recorder entries and dumps in torch's format (version 2.10), for the tests of what is
done with them: the dumps' contents themselves are tested real (``tests/e2e/test_postmortem.py``,
``tests/fixtures/nccl``)."""

from __future__ import annotations

from typing import Any


def fr_entry(
    seq: int,
    created_ns: int,
    *,
    name: str = "gloo:all_reduce",
    retired: bool = True,
    state: str | None = None,
    line: int | None = None,
) -> dict[str, Any]:
    """A 4-float collective of the default group, numbered ``seq``; ``line``: issued from
    ``train.py:<line> in step`` (stack frames recorded)."""
    entry: dict[str, Any] = {
        "collective_seq_id": seq,
        "process_group": ("0", "default_pg"),
        "profiling_name": name,
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "retired": retired,
        "time_created_ns": created_ns,
    }
    if state is not None:
        entry["state"] = state
    if line is not None:
        entry["frames"] = [{"filename": "/home/me/train.py", "line": line, "name": "step"}]
    return entry


def fr_dump(entries: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A dump's document around ``entries``."""
    return {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": entries, **extra}
