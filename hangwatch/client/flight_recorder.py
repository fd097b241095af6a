"""Collectives issued from C++ (DDP's gradient all-reduce) seen through PyTorch's Flight Recorder.

The bootstrap sets ``TORCH_FR_BUFFER_SIZE`` before any process group exists; the sender thread
then reads the ring every ``interval_s`` and emits records for collectives that no Python call
covered, numbered by the process group's own collective sequence id so they line up with
Python-issued calls. A dump of a 256-entry ring costs a few milliseconds on the sender thread.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from hangwatch import config
from hangwatch import records as r
from hangwatch.catalogue import FR_OP_NAMES
from hangwatch.client.ops import FR_DTYPES
from hangwatch.client.recorder import Recorder

log = logging.getLogger("hangwatch.client")


def _dump_function() -> Any:
    try:
        import torch

        return getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    except Exception:
        return None


#: ``_dump_fr_trace_json(include_collectives, include_stack_traces)``: the ring as JSON text or bytes.
DumpFunction = Callable[[bool, bool], Any]


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
        self._seen: dict[str, int] = {}  # group -> highest collective seq handled
        self._open: dict[tuple[str, int], r.CallRecord] = {}  # emitted, not yet seen retired
        self.enabled = self._dump is not None

    def due(self, now: float) -> bool:
        return self.enabled and now - self._last_poll >= self.interval_s

    #: Entries that could not be read (a newer torch's schema, a corrupt ring), counted and skipped.
    skipped = 0

    def poll(self) -> None:
        self._last_poll = time.time()
        try:
            entries = json.loads(self._dump(True, False)).get("entries", [])
        except Exception as exc:
            log.debug("hangwatch: flight recorder unavailable: %s", exc)
            self.enabled = False
            return
        newest: dict[str, int] = {}
        for entry in entries if isinstance(entries, list) else ():
            try:
                self._handle(entry, newest)
            except (AttributeError, TypeError, ValueError, IndexError):
                self.skipped += 1  # one malformed entry: skip it, keep the others and the poller
        # Collectives on a group complete in order: an older open record is done once a newer
        # collective exists on the same group (Flight Recorder keeps works alive past completion).
        for key, record in list(self._open.items()):
            group, seq = key
            python_max = self._python_max(group)
            if newest.get(group, 0) > seq or python_max > seq:
                self._close(key, record)

    def _python_max(self, group: str) -> int:
        seqs = self.recorder.python_seqs.get(group)
        return seqs[-1][1] if seqs else 0

    def _covered(self, group: str, seq: int) -> bool:
        started = self.recorder.in_progress.get(group)
        if started is not None and seq >= started:
            return True
        seqs = self.recorder.python_seqs.get(group)
        if not seqs:
            return False
        # a snapshot: the calling thread appends to this deque while we look (copying is atomic)
        return any(lo <= seq <= hi for lo, hi in reversed(tuple(seqs)))

    def _close(self, key: tuple[str, int], record: r.CallRecord) -> None:
        del self._open[key]
        self.recorder.sink.put(r.CallExit(self.recorder.rank, record.call_id, time.time(), None, 1))

    def _handle(self, entry: dict[str, Any], newest: dict[str, int]) -> None:
        seq = int(entry.get("collective_seq_id") or 0)
        if seq <= 0:
            return
        pg = entry.get("process_group") or ["", ""]
        group = str(pg[0])
        newest[group] = max(newest.get(group, 0), seq)
        key = (group, seq)
        if seq <= self._seen.get(group, 0):
            record = self._open.get(key)
            if record is not None and entry.get("retired"):
                self._close(key, record)
            return
        self._seen[group] = seq
        if self._covered(group, seq):
            return
        name = str(entry.get("profiling_name", ""))
        op = FR_OP_NAMES.get(name.split(":", 1)[-1], name.split(":", 1)[-1] or "unknown")
        dtypes = [FR_DTYPES.get(d, str(d).lower()) for d in entry.get("input_dtypes", [])]
        inputs = tuple(
            r.TensorMeta(tuple(int(x) for x in shape), dtypes[i] if i < len(dtypes) else "", "")
            for i, shape in enumerate(entry.get("input_sizes", []))
        )
        created = float(entry.get("time_created_ns", 0)) / 1e9 or time.time()
        record = r.CallRecord(
            rank=self.recorder.rank,
            call_id=next(self.recorder._ids),
            op=op,
            group=group,
            seq=seq,
            inputs=inputs,  # outputs are flattened by Flight Recorder: not comparable, not sent
            step=self.recorder.step,
            call_site=f"issued from C++ ({name})",
            enter_time=created,
            source="flight_recorder",
        )
        self.recorder.sink.put(record)
        if entry.get("retired"):
            self.recorder.sink.put(r.CallExit(self.recorder.rank, record.call_id, time.time(), None, 1))
        else:
            self._open[key] = record
