"""A large job's node agents read their steady ranks' rings seconds apart and say them alive
between (``RegisterReply.steady_read_s``). Forced on small jobs here, at the longest an agent
takes: the story table's rows are told as at any pace, and their healthy look-alikes raise
nothing (no rank said alive only is taken for frozen, or for absent from a collective)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.coordinator.options import MAX_STEADY_READ_S
from hangwatch.testing import Job
from tests.e2e import test_story, test_story_lookalikes
from tests.e2e.test_story import HOLDS_UP_ANOTHER, LEFT_THE_LOOP, RANK0_METRIC, Story

pytestmark = pytest.mark.slow

ROWS = [LEFT_THE_LOOP, HOLDS_UP_ANOTHER, RANK0_METRIC]


@pytest.fixture
def coordinator(coordinator_factory: Callable[..., Coordinator]) -> Coordinator:
    return coordinator_factory(stuck_after=3.0, steady_read_s=MAX_STEADY_READ_S)


@pytest.mark.parametrize("story", ROWS, ids=[s.name for s in ROWS])
def test_a_story_is_told_as_at_any_pace(
    story: Story, coordinator: Coordinator, torchrun: Callable[..., Job], framework: dict[str, str]
) -> None:
    assert coordinator.steady_read == MAX_STEADY_READ_S
    test_story.test_the_story_told(story, coordinator, torchrun, framework)


def test_their_look_alikes_raise_nothing(
    coordinator: Coordinator, torchrun: Callable[..., Job], framework: dict[str, str]
) -> None:
    test_story_lookalikes.test_no_look_alike_raises_anything(ROWS, coordinator, torchrun, framework)
