"""Detectors: one fault family per module, each a function ``(JobState, Context) -> [Finding]``.

The contract:

* A detector reads the ``JobState`` and never writes it (nor its ranks, slots or calls): every
  change to a job happens in ``state`` (``JobState``).
* What a detector remembers between ticks to stay incremental (at 1,024 ranks recomputing
  everything every tick is too slow) lives in its cache, ``ctx.cache.<detector>``: a
  ``DetectorCache`` the engine owns (one per engine) and passes in every tick's ``Context``. Each
  cache class is defined next to its detector (``mismatch.MismatchCache``, ``p2p.P2PCache``);
  a fresh cache means "recompute everything once".
* What changed since the last tick comes in ``ctx.changes`` (``JobState.take_changes``, drained
  by the engine once per tick); a detector recomputes only what depends on it.
* The per-tick sets ``ctx.claimed`` and ``ctx.mismatched`` ((group, seq) slots) are the only
  other things a detector may add to: they pass precedence on to later detectors of the tick.

Order matters only for precedence: the engine runs them in ``all_detectors`` order and a slot
already claimed (e.g. diagnosed as a mismatch) is not diagnosed again as a hang. Incident keys
are built with ``incidents.incident_key`` from structured fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hangwatch import config
from hangwatch.diagnosis.incidents import Finding
from hangwatch.diagnosis.state import Changes, JobState

if TYPE_CHECKING:
    from hangwatch.diagnosis.detectors.mismatch import MismatchCache
    from hangwatch.diagnosis.detectors.p2p import P2PCache
    from hangwatch.diagnosis.explain import Stories

#: A slot: (group, seq).
SlotId = tuple[str, int]


@dataclass
class DetectorCache:
    """Everything the detectors remember between ticks; owned by the engine (see the contract)."""

    mismatch: MismatchCache
    p2p: P2PCache
    stories: Stories


def new_cache() -> DetectorCache:
    from hangwatch.diagnosis.detectors.mismatch import MismatchCache
    from hangwatch.diagnosis.detectors.p2p import P2PCache
    from hangwatch.diagnosis.explain import Stories

    return DetectorCache(MismatchCache(), P2PCache(), Stories())


@dataclass
class Context:
    now: float
    #: seconds a collective may wait before it is a hang, or how to work them out: a job's
    #: adaptive threshold sorts its recent waits (70 us a tick, cold), and most ticks have no
    #: collective open long enough to ask (``stuck_after``)
    stuck_after_s: float | Callable[[], float]
    silence_after: float  # seconds without a heartbeat before a live rank is frozen
    claimed: set[SlotId] = field(default_factory=set)  # slots already explained by an incident
    mismatched: set[SlotId] = field(default_factory=set)  # slots where ranks called different things
    #: ranks in an open hang incident (stuck, early exit, transport stall) -> its key: a death of
    #: one of them afterwards (NCCL's watchdog aborting at its timeout) is that hang's aftermath
    hangs: dict[int, str] = field(default_factory=dict)
    #: the slots of open hang incidents -> (their key, unscoped; the ranks they tell waiting): a
    #: claimed slot where others wait is diagnosed again, in the same incident
    told: dict[SlotId, tuple[str, frozenset[int]]] = field(default_factory=dict)
    changes: Changes = field(default_factory=Changes)  # what changed since the last tick
    #: seconds ranks may wait in ``init_process_group`` for the others (``config.DEFAULT_INIT_AFTER``)
    init_after: float = config.DEFAULT_INIT_AFTER
    #: seconds the coordinator itself runs behind (``diagnosis.lag``): silences this long are its own
    behind: float = 0.0
    cache: DetectorCache = field(default_factory=new_cache)  # the engine's; fresh: recompute all

    @property
    def stuck_after(self) -> float:
        """Seconds a collective may wait before it is a hang (worked out on first use)."""
        value = self.stuck_after_s
        if callable(value):
            value = self.stuck_after_s = value()
        return value


Detector = Callable[[JobState, Context], list[Finding]]


def all_detectors() -> list[Detector]:
    """The detectors, with the model they ask loaded now: not on a job's first tick, where its
    import is paid inside the job's time."""
    from hangwatch.diagnosis import explain  # noqa: F401
    from hangwatch.diagnosis.detectors import ends, frozen, joins, mismatch, p2p, straggler, stuck

    return [mismatch.detect, p2p.detect, ends.detect, frozen.detect, joins.detect, stuck.detect, straggler.detect]
