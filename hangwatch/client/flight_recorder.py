"""Flight Recorder read from inside the rank, for ranks that ship their own records.

Where a node agent reads the rank's ring, it also reads Flight Recorder from outside the process
(``hangwatch.agent.flightrecorder``), and this module is not used. Where none runs (a rank
pointed at a remote coordinator), the sender thread reads the ring every ``interval_s`` through
torch's ``_dump_fr_trace_json`` and turns entries no Python call covered into records
(:mod:`hangwatch.flight_entries`), with the recorder's own call ids. The bootstrap sets
``TORCH_FR_BUFFER_SIZE`` before any process group exists. A dump of a 256-entry ring costs a
few milliseconds on the sender thread.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from hangwatch import config
from hangwatch.client.recorder import Recorder
from hangwatch.flight_entries import EntryTracker

log = logging.getLogger("hangwatch.client")


def _dump_function() -> Any:
    try:
        import torch

        return getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    except Exception:
        return None


#: ``_dump_fr_trace_json(include_collectives, include_stack_traces)``: the ring as JSON text or bytes.
DumpFunction = Callable[[bool, bool], Any]


class _RecorderCoverage:
    """The seqs the recorder's Python calls covered (read from the sender thread while the
    calling thread appends: the deque is copied, which is atomic)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def covers(self, group: str, seq: int) -> bool:
        started = self.recorder.in_progress.get(group)
        if started is not None and seq >= started:
            return True
        seqs = self.recorder.python_seqs.get(group, ())
        return any(lo <= seq <= hi for lo, hi in reversed(tuple(seqs)))

    def newest(self, group: str) -> int:
        seqs = self.recorder.python_seqs.get(group)
        return seqs[-1][1] if seqs else 0


class FlightRecorderPoller:
    """Reads the ring through ``dump`` (default: torch's ``_dump_fr_trace_json``; None when this
    torch has none, which disables the poller). Tests pass a function returning a saved dump."""

    def __init__(
        self,
        recorder: Recorder,
        interval_s: float = config.FR_POLL_INTERVAL_S,
        dump: DumpFunction | None = None,
    ) -> None:
        self.recorder = recorder
        self.interval_s = interval_s
        self._dump = dump if dump is not None else _dump_function()
        self._last_poll = 0.0
        self._coverage = _RecorderCoverage(recorder)
        self._tracker = EntryTracker(recorder.rank, lambda group, seq: next(recorder._ids))
        self.enabled = self._dump is not None

    @property
    def skipped(self) -> int:
        """Entries that could not be read (a newer torch's schema, a corrupt ring)."""
        return self._tracker.skipped

    def skip_existing(self) -> None:
        """Report only entries recorded from now on (the rank's agent, gone, read the rest)."""
        try:
            entries = json.loads(self._dump(True, False)).get("entries", [])
        except Exception:
            return
        if isinstance(entries, list):
            self._tracker.skip_existing(entries)

    def due(self, now: float) -> bool:
        return self.enabled and now - self._last_poll >= self.interval_s

    def poll(self) -> None:
        self._last_poll = time.monotonic()  # the sender's clock: a step of the wall clock must not stop polls
        try:
            entries = json.loads(self._dump(True, False)).get("entries", [])
        except Exception as exc:
            log.debug("hangwatch: flight recorder unavailable: %s", exc)
            self.enabled = False
            return
        if not isinstance(entries, list):
            return
        for event in self._tracker.update(entries, self._coverage, self.recorder.step, time.time()):
            self.recorder.sink.put(event)
