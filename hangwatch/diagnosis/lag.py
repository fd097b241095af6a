"""How far behind the coordinator itself runs: its lateness is never evidence against a rank.

Each batch applied tells how much longer than its rank's best it took to arrive (its delay past
the rank's clock offset, ``RankState.observe_clock``): the network, a relay, and the wait in the
coordinator's own queue. One rank's slow link shows on that rank alone; a coordinator that
cannot keep up shows on every rank at once. ``behind`` is the median of the recent batches'
excess delays: while it is high, silences and absences as long as it are the coordinator's,
not the ranks', and the detectors allow for it (``Context.behind``).
"""

from __future__ import annotations

import collections
import statistics

#: Recent batches looked at, over all jobs.
SAMPLES = 1024
#: How far back a sample counts.
WINDOW_S = 5.0
#: Fewer recent samples than this say nothing.
MIN_SAMPLES = 8
#: Behind by more than this, the coordinator says so (``status``, metrics).
BEHIND_S = 1.0


class Lag:
    """The coordinator's recent excess delays, and what they say of its own lateness."""

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=SAMPLES)
        self._at = -1.0
        self._behind = 0.0
        self.worst = 0.0  # the most it has been behind (a gauge's high-water mark)

    def observe(self, now: float, excess: float) -> None:
        self.samples.append((now, max(0.0, excess)))

    def behind(self, now: float) -> float:
        """Seconds the batches applied lately waited past their ranks' best, at the median
        (0: too few to tell). Worked out once a second at most."""
        if now - self._at < 1.0 and now >= self._at:
            return self._behind
        recent = [excess for at, excess in self.samples if now - at <= WINDOW_S]
        self._at = now
        self._behind = statistics.median(recent) if len(recent) >= MIN_SAMPLES else 0.0
        self.worst = max(self.worst, self._behind)
        return self._behind
