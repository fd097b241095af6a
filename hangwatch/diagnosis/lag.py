"""How far behind the coordinator itself runs: its lateness is never evidence against a rank.

``Lag``: two measures of the coordinator's own queue, each a median of recent samples, the
larger taken:

- ``state``: how long each batch waited for the job state once the coordinator had it (the lock
  every batch and every detection tick takes);
- ``loop``: how late the event loop that runs the ingest handlers comes to a timer it set
  (``coordinator.server``): the requests queued ahead of it, the core being spent.

(A batch's delay past its rank's clock offset cannot tell: the offset is the smallest delay seen,
which a coordinator saturated from the start has in it.) While ``behind`` is high, silences and
absences as long as it are the coordinator's, not the ranks', and the detectors allow for it
(``Context.behind``).

``Heard``: how late a job's ranks are heard, wherever the delay arises (the coordinator's loop,
gRPC's queue, a relay, a stall of the detectors holding the state). Its frontier is when most
of the job's live ranks last sent (``RankState.last_sent``, on the coordinator's clock): a rank
alone going silent leaves it where it is, a coordinator hearing everyone late holds it back.
The frontier's distance from now, past the least it has been lately, is lateness no rank
caused. Median waits miss a stall of seconds; this does not.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Iterable

#: Recent samples kept per measure.
SAMPLES = 1024
#: How far back a sample counts.
WINDOW_S = 5.0
#: Fewer recent samples than this say nothing.
MIN_SAMPLES = 8
#: Behind by more than this, the coordinator says so (``status``, metrics).
BEHIND_S = 1.0


#: The frontier is the rank this far from the last when the live ranks' last words are sorted
#: (one tenth of them: a few silent ranks never hold it back; in a job of under ten, the latest).
FRONTIER_SHARE = 10
#: How far back the least distance from the frontier counts.
BASE_WINDOW_S = 60.0
#: The most of that distance taken as a healthy job's: ranks send every 0.2 to 2 s and relays
#: hold batches up to 1 s, so a healthy frontier trails now by well under this.
BASE_MAX_S = 2.0


class Heard:
    """How late a job's ranks are heard, past the least that has been lately (``late``)."""

    def __init__(self) -> None:
        self.gaps: collections.deque[tuple[float, float]] = collections.deque()  # (when, now - frontier)
        self._at = -1.0
        self._late = 0.0
        self.worst = 0.0

    def late(self, now: float, sent: Callable[[], Iterable[float]]) -> float:
        """Seconds the job's ranks are heard late, from their last words' times ``sent()`` (one
        a live rank, 0: none yet). Worked out once a second at most."""
        if now - self._at < 1.0 and now >= self._at:
            return self._late
        self._at = now
        told = sorted(t for t in sent() if t > 0)
        if not told:
            self._late = 0.0
            return 0.0
        gap = max(0.0, now - told[len(told) - 1 - len(told) // FRONTIER_SHARE])
        gaps = self.gaps
        while gaps and now - gaps[0][0] > BASE_WINDOW_S:
            gaps.popleft()
        while gaps and gaps[-1][1] >= gap:  # a rising minimum: the least of the window first
            gaps.pop()
        gaps.append((now, gap))
        self._late = max(0.0, gap - min(gaps[0][1], BASE_MAX_S))
        self.worst = max(self.worst, self._late)
        return self._late


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
