"""Detectors: one fault family per module, each a function ``(JobState, Context) -> [Finding]``.

They read the coordinator's state and never change it; the engine decides what becomes an
incident. Order matters only for precedence: the engine runs them in ``ALL`` order and a key
already claimed (e.g. a slot diagnosed as a mismatch) is not diagnosed again as a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hangwatch.coordinator.incidents import Finding
from hangwatch.coordinator.state import JobState


@dataclass
class Context:
    now: float
    stuck_after: float  # seconds a collective may wait before it is a hang
    silence_after: float  # seconds without a heartbeat before a live rank is frozen
    claimed: set[str] = field(default_factory=set)  # slot keys already explained by an incident
    mismatched: set[str] = field(default_factory=set)  # slot keys where ranks called different things


Detector = Callable[[JobState, Context], list[Finding]]


def slot_key(group: str, seq: int) -> str:
    return f"{group}:{seq}"


def all_detectors() -> list[Detector]:
    from hangwatch.coordinator.detectors import ends, frozen, mismatch, p2p, straggler, stuck

    return [mismatch.detect, p2p.detect, ends.detect, frozen.detect, stuck.detect, straggler.detect]
