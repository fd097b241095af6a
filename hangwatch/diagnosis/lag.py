"""How far behind the coordinator itself runs: its lateness is never evidence against a rank.

Two measures, each a median of recent samples, the larger taken:

- ``state``: how long each batch waited for the job state once the coordinator had it (the lock
  every batch and every detection tick takes);
- ``loop``: how late the event loop that runs the ingest handlers comes to a timer it set
  (``coordinator.server``): the requests queued ahead of it, the core being spent.

(A batch's delay past its rank's clock offset cannot tell: the offset is the smallest delay seen,
which a coordinator saturated from the start has in it.) While ``behind`` is high, silences and
absences as long as it are the coordinator's, not the ranks', and the detectors allow for it
(``Context.behind``).
"""

from __future__ import annotations

import collections
import statistics

#: Recent samples kept per measure.
SAMPLES = 1024
#: How far back a sample counts.
WINDOW_S = 5.0
#: Fewer recent samples than this say nothing.
MIN_SAMPLES = 8
#: Behind by more than this, the coordinator says so (``status``, metrics).
BEHIND_S = 1.0


class Lag:
    """The coordinator's recent waits, by measure, and what they say of its own lateness."""

    def __init__(self) -> None:
        self.samples: dict[str, collections.deque[tuple[float, float]]] = {}
        self._at = -1.0
        self._behind = 0.0
        self.worst = 0.0  # the most it has been behind (a gauge's high-water mark)

    def observe(self, now: float, seconds: float, measure: str = "state") -> None:
        found = self.samples.get(measure)
        if found is None:
            found = self.samples[measure] = collections.deque(maxlen=SAMPLES)
        found.append((now, max(0.0, seconds)))

    def behind(self, now: float) -> float:
        """Seconds the coordinator runs behind, the larger of its measures' recent medians (0:
        too few samples to tell). Worked out once a second at most."""
        if now - self._at < 1.0 and now >= self._at:
            return self._behind
        medians = [0.0]
        for samples in self.samples.values():
            recent = [seconds for at, seconds in samples if now - at <= WINDOW_S]
            if len(recent) >= MIN_SAMPLES:
                medians.append(statistics.median(recent))
        self._at = now
        self._behind = max(medians)
        self.worst = max(self.worst, self._behind)
        return self._behind
