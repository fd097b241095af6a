"""The story table's look-alikes (``tests/e2e/test_story.py``): each row's healthy program, a few
side by side on one coordinator, must raise nothing. A file of their own, so that the suite's two
workers run them beside the table's faults."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job
from tests.e2e.test_fault_classes import _brief
from tests.e2e.test_story import STORIES, Story

pytestmark = pytest.mark.slow

#: Look-alikes run side by side, this many at once (more on 2 cores starves the ranks' heartbeats).
AT_ONCE = 4
BATCHES = [STORIES[i : i + AT_ONCE] for i in range(0, len(STORIES), AT_ONCE)]


@pytest.mark.parametrize("batch", BATCHES, ids=[f"{b[0].name}..." for b in BATCHES])
def test_no_look_alike_raises_anything(
    batch: list[Story], coordinator: Coordinator, torchrun: Callable[..., Job], framework: dict[str, str]
) -> None:
    """Each row's healthy look-alike, a few side by side on one coordinator: none raises anything."""
    jobs = [
        torchrun(
            story.lookalike,
            addr=f"127.0.0.1:{coordinator.port}",
            nproc=story.nproc,
            name=f"{story.name}_healthy",
            env={**framework, "HANGWATCH_JOB_ID": f"{story.name}_healthy"},
        )
        for story in batch
    ]
    for job in jobs:
        assert job.wait(180) == 0, job.output()[-2000:]
    time.sleep(3)
    assert coordinator.incidents_json() == [], _brief(coordinator.incidents_json())
