"""The node agent reads a rank's Flight Recorder rings through the rank's worker server.

Both rings: the CPU one (gloo and other CPU backends, ``fr_trace_json``) and, in CUDA builds, the
NCCL one (``dump_nccl_trace_json``); a handler the build lacks answers 404 and that ring is
absent. The server runs on a C++ thread inside the rank (``hangwatch.client.workerserver``), so
this works while the rank is frozen with its GIL held. One query, bounded, is
``hangwatch.agent.frquery``; this module decides when each rank is read.

A full 2,000-entry NCCL ring is about 1 MB of JSON and tens of ms a round trip; its active entries
a fraction of that: read those often and the whole ring only when a diagnosis needs it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hangwatch import config
from hangwatch import records as r
from hangwatch.agent.frquery import (
    RING_HANDLERS,
    cpu_status,
    enqueued,
    entries_of,
    newest_record,
    progress_of,
    read_rings,
    rings_of_dump,
)

log = logging.getLogger("hangwatch.agent")

WHOLE_READ_EVERY_S = 10.0

#: Asked with the seqs (first, last) each group enqueued since the last whole read: does a whole
#: read have anything to find? (the shipper answers from the Python calls it read out of the ring)
Needed = Callable[[dict[str, tuple[int, int]]], bool]


@dataclass(frozen=True)
class Fetched:
    """One read of a rank's rings: when it was asked for, its entries, and where the NCCL
    ring's groups stand on the device (empty without a NCCL ring; ``time`` set, ``rank`` -1)."""

    time: float
    entries: list[Any]
    progress: list[r.GroupProgress] = field(default_factory=list)
    #: every ring asked for was read (a ring that failed leaves its collectives untold: such a
    #: read says nothing of when C++'s collectives were last seen)
    complete: bool = True
    #: the CPU ring's groups' ``(last_enqueued, last_completed)`` counters (:func:`cpu_status`;
    #: empty where the CPU ring was not read)
    status: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _Watched:
    path: str
    pid: int
    needed: Needed | None = None
    accounted: Callable[[], bool] | None = None
    latest: Fetched | None = None
    failing: str = ""
    #: each group's last enqueued seq at the last whole read: a probe that finds the same, or
    #: only seqs Python calls covered, spares the rank serialising its whole ring again
    read_to: dict[str, int] | None = None
    whole_at: float = 0.0  # when the NCCL ring was last read whole
    probed: dict[str, Any] | None = None  # the NCCL ring as the last probe found it (active entries)
    probed_at: float = 0.0  # when that probe was asked for
    timeouts: dict[str, int] = field(default_factory=dict)  # group -> timeout_ms seen in entries
    highest: dict[str, int] = field(default_factory=dict)  # group -> highest collective seq seen
    described: set[str] = field(default_factory=set)  # groups a whole read saw with collectives
    cost: float = 0.0  # seconds a read of its rings took lately (a moving average)
    every: float = 0.0  # seconds between its reads, as its cost allows (``READ_BUDGET``)
    floor: float = 0.0  # the fewest seconds between its reads but where its ring turns over (``space``)
    due: float = 0.0  # when it may be read next
    cpu_at: float = 0.0  # when the CPU ring was last read whole
    record: int = -1  # the CPU ring's newest record id at that read (-1: none yet)
    held: int = 0  # the most entries a read of its CPU ring held (its size, once it has filled)
    turnover: float = 0.0  # seconds the CPU ring lately took to gain ``held`` entries (0: unknown)
    nccl_groups: set[str] = field(default_factory=set)  # groups the NCCL ring's pg_status showed
    vouched: float = 0.0  # the latest poll left unread because Python calls accounted for it all
    absent: set[str] = field(default_factory=set)  # rings this build has not (their handler answered 404)
    #: held while one of its reads is under way: its reads never overlap, other ranks' run beside
    lock: threading.Lock = field(default_factory=threading.Lock)
    busy: bool = False  # a periodic read of it is queued or under way
    #: the last read asked for as it ends (``ask_now``): None before; then (done, the read)
    last: tuple[bool, Fetched | None] | None = None


#: The share of a core reading a rank's Flight Recorder rings may take from the rank: the rank's
#: worker server serialises every entry of its rings for each read (milliseconds for a full
#: ring: BENCHMARKS.md, "Flight Recorder read from outside the rank"), so a rank whose
#: reads cost more than this share at the usual interval is read less often, and ``status`` says
#: so. The read's time as the agent sees it (the round trip, parsing included) stands for the
#: rank's cost: it is the larger.
READ_BUDGET = 0.01
#: Groups a rank's NCCL ring may show that the reader remembers (a job has a few dozen at most).
MAX_NCCL_GROUPS = 4096

#: The share of a core a rank's reads may take to keep up with its CPU ring: one whose ring turns
#: over sooner than ``READ_BUDGET`` would read it is read every half turnover up to this share.
#: A collective C++ issued is known only from its entry, and the entries of a busy side thread
#: (a metrics thread's all-reduces, 100 a second) push it out of a 256-entry ring in 2.5 s: on
#: a loaded machine a read's round trip grows, the budget spaced reads ten seconds apart, and
#: a rank waiting inside DDP's bucket all-reduce was blamed for not arriving. What such a ring
#: costs to follow: about 22 us of the rank's CPU per entry, 0.4 % of a core at 100 entries a
#: second; a read whose round trip passes this share is read at the share's pace.
TURNOVER_BUDGET = 0.05
#: However much a read costs, a rank is read at least this often (then over ``READ_BUDGET``, and
#: ``status`` says so): the coordinator takes reads this far apart for reads that stopped
#: (``detectors.horizon.FLIGHT_STALE_S``).
MAX_READ_EVERY_S = config.FR_MAX_READ_EVERY_S
#: Ranks' rings read at once, each on a thread of its own: a worker server that drips its answer
#: holds one of them until its read's deadline, never the reads of the others.
READERS = 8


class RingFetcher:
    """Reads the Flight Recorder rings of the ranks it watches, every ``interval_s``, on its own
    thread: a rank whose worker server does not answer (stopped by SIGSTOP, gone) costs this
    thread its timeout and never the shipper's tick. The shipper takes the newest read of each
    rank when it has read that rank's own ring past the moment it was asked for (so every
    Python call an entry could belong to is known), and asks for one last read itself when a
    rank says it is ending. ``read`` is the seam tests replace."""

    def __init__(
        self,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        read: Callable[..., tuple[dict[str, dict[str, Any]], dict[str, str]]] = read_rings,
        clock: Callable[[], float] = time.time,
        background: bool = True,
    ) -> None:
        self.interval_s = interval_s
        self.background = background  # False: only poll_once reads (a clock driven by hand)
        self.timeout_s = timeout_s
        self._read = read
        self._clock = clock
        self._watched: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reads = 0
        self.failures = 0
        self.spared = 0  # NCCL ring reads a probe showed to have nothing to find
        self.spared_cpu = 0  # CPU ring reads Python calls accounted for (``accounted``)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def watch(
        self,
        key: int,
        path: str,
        pid: int,
        needed: Needed | None = None,
        accounted: Callable[[], bool] | None = None,
    ) -> None:
        """Read ``key``'s rings; with ``needed``, probe ``pg_status`` first and read the whole
        rings only when a group enqueued collectives since the last whole read that ``needed``
        says no Python call accounts for; with ``accounted``, leave the CPU ring unread when it
        says Python calls account for all the ring gained since it was last asked
        (:class:`hangwatch.flight_entries.PythonAccounts`), up to ``WHOLE_READ_EVERY_S``."""
        with self._lock:
            self._watched[key] = _Watched(path, pid, needed, accounted)
            if self._thread is None and self.background:
                self._thread = threading.Thread(target=self._run, name="hangwatch-flightrecorder", daemon=True)
                self._thread.start()

    def forget(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)

    def space(self, key: int, seconds: float) -> None:
        """Read ``key`` this far apart at least (a large job's pace: the shipper reads its ring
        twice as often, and each poll must follow such a read, ``shipped.READ_S``), but where its
        CPU ring turns over sooner."""
        with self._lock:
            watched = self._watched.get(key)
            if watched is not None:
                watched.floor = seconds

    def take(self, key: int) -> Fetched | None:
        """The newest read of ``key`` not taken yet (None: none since the last take)."""
        with self._lock:
            watched = self._watched.get(key)
            if watched is None or watched.latest is None:
                return None
            fetched, watched.latest = watched.latest, None
            return fetched

    def has_new(self, key: int) -> bool:
        """Whether a read of ``key`` waits to be taken."""
        with self._lock:
            watched = self._watched.get(key)
            return watched is not None and watched.latest is not None

    def ask_now(
        self,
        key: int,
        timeout_s: float = 0.5,
        dump: bytes | None = None,
        asked: float = 0.0,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        """``key``'s last read, as it ends (it waits for it), on a reader thread, never the
        caller's: from the ``dump`` it handed over (:meth:`handed`, taken as asked at
        ``asked``), else from its worker server while it is ``alive``. :meth:`asked` says when
        it is done. Once per rank."""
        with self._lock:
            watched = self._watched.get(key)
            if watched is None or watched.last is not None:
                return
            watched.last = (False, None)
        try:
            self._readers().submit(self._last, watched, timeout_s, dump, asked, alive)
        except RuntimeError:  # stopped
            watched.last = (True, None)

    def asked(self, key: int) -> tuple[bool, Fetched | None]:
        """Whether the read :meth:`ask_now` asked for is done, and what it found (None: nothing
        to take, or it failed). Not asked, or not watched: done, with nothing."""
        with self._lock:
            watched = self._watched.get(key)
            last = None if watched is None else watched.last
        return (True, None) if last is None else last

    def _last(
        self, watched: _Watched, timeout_s: float, dump: bytes | None, asked: float, alive: Callable[[], bool]
    ) -> None:
        try:
            with watched.lock:
                fetched = self._handed(watched, dump, asked) if dump is not None else None
                if fetched is None and alive():
                    fetched = self._fetch(watched, timeout_s, probe=False)
        except Exception:  # never a reader thread's end
            log.exception("Flight Recorder read of pid %d failed", watched.pid)
            fetched = None
        watched.last = (True, fetched)

    def _count(self, name: str) -> None:
        with self._lock:  # reader threads count side by side
            setattr(self, name, getattr(self, name) + 1)

    def _readers(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="hangwatch-fr")
            return self._pool

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def vouched(self, key: int) -> float:
        """When ``key``'s latest poll was left unread because Python calls accounted for all its
        rings gained (0: never): as good as a read that found nothing new."""
        with self._lock:
            watched = self._watched.get(key)
        return 0.0 if watched is None else watched.vouched

    def _spare(self, watched: _Watched, timeout_s: float) -> bool:
        """True when a cheap probe of the NCCL ring (``pg_status`` and the entries not completed
        yet, under a millisecond) shows that reading its entries whole would find nothing new.
        (The CPU ring has no cheap probe: its handler sends every entry whatever it is asked, so
        it is read whole each time.)"""
        watched.probed = None
        if watched.needed is None or watched.read_to is None:
            return False
        if self._clock() - watched.whole_at >= WHOLE_READ_EVERY_S:
            return False  # due for a whole read anyway: no probe
        try:
            watched.probed_at = self._clock()  # before asking: nothing enqueued later is in it
            rings, _ = self._read(
                watched.path, watched.pid, only_active=True, collectives=True, names=("nccl",), timeout_s=timeout_s
            )
            watched.probed = rings.get("nccl")
            status = enqueued(rings)
            if not status:
                return False
            if any(seq > 0 and group not in watched.described for group, seq in status.items()):
                return False  # a group no whole read saw with collectives yet: its entries tell its timeout
            since: dict[str, tuple[int, int]] = {}
            for group, seq in status.items():
                before = watched.read_to.get(group, 0)
                if seq == before:
                    continue
                if seq < before:
                    return False  # the counter went back (NCCL counts p2p ops there too): read
                since[group] = (before + 1, seq)
            if since and watched.needed(since):
                return False
            watched.read_to = {**watched.read_to, **status}  # all of it accounted for by Python calls
            return True
        except Exception:
            return False  # when in doubt, read

    def _spare_cpu(self, watched: _Watched) -> bool:
        """True when the CPU ring, read whole lately, gained nothing Python calls do not
        account for since (``accounted``): its read would serialise every entry to find none."""
        if watched.accounted is None or not watched.cpu_at or self._clock() - watched.cpu_at >= WHOLE_READ_EVERY_S:
            return False
        try:
            return bool(watched.accounted())
        except Exception:
            return False  # when in doubt, read

    def _fetch(self, watched: _Watched, timeout_s: float, probe: bool = True) -> Fetched | None:
        names = tuple(n for n in RING_HANDLERS if n not in watched.absent)
        if probe and "nccl" in names and self._spare(watched, timeout_s):
            self._count("spared")
            names = tuple(n for n in names if n != "nccl")
        if probe and "cpu" in names and self._spare_cpu(watched):
            self._count("spared_cpu")
            names = tuple(n for n in names if n != "cpu")
            if not names:
                watched.vouched = self._clock()
                return None  # nothing to read: no round trip at all
        asked = self._clock()
        try:
            rings, errors = self._read(watched.path, watched.pid, names=names, timeout_s=timeout_s)
        except Exception as e:  # never the caller's problem
            rings, errors = {}, {"read": f"{type(e).__name__}: {e}"}
        return self._digest(watched, names, rings, errors, asked)

    def handed(self, key: int, dump: bytes, asked: float) -> Fetched | None:
        """The last read of ``key``, from the dump the rank handed over as it ended
        (:func:`hangwatch.client.workerserver.last_dump`), taken as a read asked at ``asked``
        (when the agent heard the rank say it is ending: the dump was made before). None: not
        watched, or not a dump (and then the worker server is asked, if it still answers)."""
        with self._lock:
            watched = self._watched.get(key)
        return None if watched is None else self._handed(watched, dump, asked)

    def _handed(self, watched: _Watched, dump: bytes, asked: float) -> Fetched | None:
        rings, errors = rings_of_dump(dump)
        if not rings:
            if errors:
                log.info("pid %d's last Flight Recorder dump not read: %s", watched.pid, "; ".join(errors.values()))
            return None
        names = tuple(n for n in RING_HANDLERS if n not in watched.absent)
        return self._digest(watched, names, rings, errors, asked)

    def _digest(
        self,
        watched: _Watched,
        names: tuple[str, ...],
        rings: dict[str, dict[str, Any]],
        errors: dict[str, str],
        asked: float,
    ) -> Fetched | None:
        self._count("reads")
        if errors and not rings:
            self._count("failures")
            text = "; ".join(f"{k}: {v}" for k, v in errors.items())
            if text != watched.failing:
                log.info("Flight Recorder of pid %d not read: %s", watched.pid, text)
                watched.failing = text
            return None
        watched.failing = ""
        if not errors:  # a ring neither read nor failed: the build has none (404), now or ever
            watched.absent.update(name for name in names if name not in rings)
        if "cpu" in rings:
            self._turnover(watched, rings, asked)
            watched.cpu_at = asked
        watched.read_to = {**(watched.read_to or {}), **enqueued(rings)}
        if "nccl" in names:
            watched.whole_at = asked
            nccl_seqs = enqueued({"nccl": rings.get("nccl", {})})
            watched.described.update(group for group, seq in nccl_seqs.items() if seq > 0)
        nccl, read_at = (rings.get("nccl"), asked) if "nccl" in names else (watched.probed, watched.probed_at)
        shown = nccl.get("pg_status") if isinstance(nccl, dict) else None
        if isinstance(shown, dict) and len(watched.nccl_groups) < MAX_NCCL_GROUPS:
            watched.nccl_groups.update(map(str, shown))
        progress = [] if nccl is None else progress_of(nccl, watched.timeouts, watched.highest)
        progress = [dataclasses.replace(p, time=read_at) for p in progress]
        status = cpu_status(rings, watched.nccl_groups)
        return Fetched(asked, entries_of(rings), progress, complete=not errors, status=status)

    @staticmethod
    def _turnover(watched: _Watched, rings: dict[str, dict[str, Any]], asked: float) -> None:
        """How long the CPU ring takes to turn over, from the record ids it gained since its last
        read (a moving average; unknown until it has gained some)."""
        entries = rings["cpu"].get("entries")
        watched.held = max(watched.held, len(entries) if isinstance(entries, list) else 0)
        newest = newest_record(rings)
        gained, elapsed = newest - watched.record, asked - watched.cpu_at
        if watched.record >= 0 and gained > 0 and elapsed > 0 and watched.held:
            took = watched.held * elapsed / gained
            watched.turnover = took if not watched.turnover else min(took, 0.5 * watched.turnover + 0.5 * took)
        if newest >= 0:
            watched.record = newest

    def note(self, key: int) -> str:
        """What the budget slowed down for ``key`` (empty: nothing): said in ``status``."""
        with self._lock:
            w = self._watched.get(key)
        if w is None or w.every <= max(self.interval_s, w.floor):
            return ""  # (a floor is the job's pace, not the read's cost)
        within = (
            f"kept under {READ_BUDGET:.0%} of a core"
            if w.cost / w.every <= READ_BUDGET * 1.001
            else f"{w.cost / w.every:.1%} of a core: read at least every {MAX_READ_EVERY_S:g} s whatever it costs"
        )
        return (
            f"Flight Recorder read every {w.every:.1f} s, not every {max(self.interval_s, w.floor):g} s: "
            f"a read costs the rank about {w.cost * 1e3:.0f} ms ({within})"
        )

    def poll_once(self, due_only: bool = False) -> None:
        """Read every watched rank once, one after the other; with ``due_only``, those that are
        due: one whose reads cost more than ``READ_BUDGET`` of a core at that interval is read
        less often. (The fetcher's thread reads them side by side: ``_run``.)"""
        with self._lock:
            watched = list(self._watched.items())
        for key, w in watched:
            if due_only and self._clock() < w.due:
                continue
            with w.lock:
                self._poll(key, w)

    def _poll(self, key: int, w: _Watched) -> None:
        """One periodic read of ``w`` (its lock held)."""
        started = self._clock()
        fetched = self._fetch(w, self.timeout_s)
        took = max(0.0, self._clock() - started)
        w.cost = took if not w.cost else 0.7 * w.cost + 0.3 * took
        base = max(self.interval_s, w.floor)
        w.every = min(max(base, w.cost / READ_BUDGET), max(base, MAX_READ_EVERY_S))
        if w.turnover:  # read before the CPU ring turns over, where that costs little enough
            w.every = min(w.every, max(self.interval_s, w.turnover / 2, w.cost / TURNOVER_BUDGET))
        w.due = started + w.every - self.interval_s / 2  # read on the tick nearest its due time
        if fetched is not None:
            with self._lock:
                if self._watched.get(key) is w:
                    w.latest = fetched

    def _run(self) -> None:
        """Every ``interval_s``, each rank that is due and not being read is read on a reader
        thread of its own (``READERS`` at once)."""
        while not self._stop.wait(self.interval_s):
            with self._lock:
                watched = list(self._watched.items())
            now = self._clock()
            for key, w in watched:
                if w.busy or now < w.due:
                    continue
                w.busy = True
                try:
                    self._readers().submit(self._poll_then_free, key, w)
                except RuntimeError:  # stopped meanwhile
                    return

    def _poll_then_free(self, key: int, w: _Watched) -> None:
        try:
            with w.lock:
                self._poll(key, w)
        except Exception:  # never a reader thread's end
            log.exception("Flight Recorder read of pid %d failed", w.pid)
        finally:
            w.busy = False
