"""The node agent's state and actions, without transport: embedded by the coordinator on a single
node, and driven over gRPC by ``hangwatch.agent.daemon`` on the others."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence

from hangwatch.agent import abort as _abort
from hangwatch.agent.gpu import GpuInspector
from hangwatch.agent.identity import START_TIME_TOLERANCE_S, Proofs
from hangwatch.agent.namespaces import PidMapper
from hangwatch.agent.procinfo import ProcessInspector, PsutilInspector
from hangwatch.agent.pyspy import dump_stacks
from hangwatch.agent.stacks import Dumper, dump_many
from hangwatch.records import ProcessStatus, ProcState, StackDump, Target

log = logging.getLogger("hangwatch.agent")

#: Seconds after which an unchanged live process is reported again (fresh CPU and memory).
REFRESH_S = 5.0


def _key(s: ProcessStatus) -> tuple[ProcState, int | None, int | None, tuple[int, ...]]:
    """What, when it changes, is reported at once: state, how it ended, a new Xid on its GPUs."""
    return s.state, s.exit_code, s.signal, tuple(g.xid for g in s.gpus)


class NodeAgentCore:
    """Watches a node's rank processes; dumps their stacks and aborts them on request. Thread-safe."""

    def __init__(
        self,
        inspector: ProcessInspector | None = None,
        dumper: Dumper | None = None,
        host: str | None = None,
        gpus: GpuInspector | None = None,
    ) -> None:
        self.inspector: ProcessInspector = inspector or PsutilInspector()
        self.gpus = gpus or GpuInspector()
        self._dumper: Dumper = dumper or dump_stacks
        self.host = host or socket.gethostname()
        self._lock = threading.Lock()
        self._targets: dict[Target, None] = {}
        self._pids = PidMapper()
        self._reported: dict[Target, tuple[ProcessStatus, float]] = {}
        #: rank processes the kernel proved (they linked to this agent's socket); a dump or an
        #: abort of anything else is refused, whatever the coordinator asks
        self.proofs = Proofs()

    def set_targets(self, targets: Iterable[Target]) -> None:
        """Watch exactly ``targets`` from now on (what was known of kept ones is kept)."""
        with self._lock:
            self._targets = dict.fromkeys(targets)
            self._reported = {t: r for t, r in self._reported.items() if t in self._targets}

    def _status(self, target: Target) -> ProcessStatus:
        """The target's status, reported under the pid the rank itself reported; DEAD when its pid
        now belongs to another process."""
        local = self._pids.localise(target)
        s = self.inspector.status(local.pid)
        if local.pid != target.pid:
            s = dataclasses.replace(s, pid=target.pid)
        if abs(s.start_time - target.start_time) <= START_TIME_TOLERANCE_S:
            return s
        if not s.start_time:  # gone with its exit status unknown, or not inspectable
            return dataclasses.replace(s, start_time=target.start_time)
        return ProcessStatus(target.pid, ProcState.DEAD, s.time, target.start_time)

    def poll(self, *, full: bool = False) -> list[ProcessStatus]:
        """Statuses that changed since the last poll (state, exit), and live ones due a refresh.

        ``full`` returns every watched process, e.g. after (re)registering with a coordinator.
        """
        now = time.monotonic()
        out: list[ProcessStatus] = []
        with self._lock:
            statuses = {target: self._status(target) for target in self._targets}
            gone = (ProcState.DEAD, ProcState.ZOMBIE)
            local = {t: self._pids.localise(t).pid for t, s in statuses.items() if s.state not in gone}
            gpus = self.gpus.of(local.values())
            for target, s in statuses.items():
                held = gpus.get(local.get(target, -1))
                if held:
                    s = dataclasses.replace(s, gpus=held)
                last = self._reported.get(target)
                due = last is None or _key(last[0]) != _key(s)
                if last is not None and not due and s.state is not ProcState.DEAD:
                    due = now - last[1] >= REFRESH_S
                if due or full:
                    self._reported[target] = (s, now)
                    out.append(s)
        return out

    def _proven(self, targets: Sequence[Target]) -> tuple[list[Target], dict[int, str]]:
        """``targets`` in this agent's pid namespace, split into proven ranks and refusals (by rank)."""
        proven: list[Target] = []
        refused: dict[int, str] = {}
        for target in targets:
            local = self._pids.localise(target)
            why = self.proofs.check(local)
            if why is None:
                proven.append(local)
            else:
                refused[target.rank] = why
        return proven, refused

    def dump(self, targets: Sequence[Target], native: bool = False, timeout_s: float = 10.0) -> dict[int, StackDump]:
        """Stacks of ``targets`` by rank; a target not proven a rank, or whose pid was reused, is
        refused (its dump says why)."""
        proven, refused = self._proven(targets)
        dumps = dump_many(proven, native=native, timeout_s=timeout_s, inspector=self.inspector, dumper=self._dumper)
        pids = {t.rank: t.pid for t in targets}
        for rank, why in refused.items():
            log.warning("stacks of rank %d refused: %s", rank, why)
            dumps[rank] = StackDump(pids[rank], time.time(), native=native, error=f"refused: {why}")
        return dumps

    def abort(self, targets: Sequence[Target], grace_s: float = 10.0) -> list[int]:
        """Terminate the proven, verified ``targets`` (SIGTERM, then SIGKILL after ``grace_s``);
        pids signalled."""
        return self.abort_outcome(targets, grace_s)[0]

    def abort_outcome(self, targets: Sequence[Target], grace_s: float = 10.0) -> tuple[list[int], dict[int, str]]:
        """``abort``, and why each target it would not signal was refused (by rank)."""
        proven, refused = self._proven(targets)
        for rank, why in refused.items():
            log.warning("abort of rank %d refused: %s", rank, why)
        signalled = _abort.abort(proven, grace_s=grace_s, inspector=self.inspector)
        for target in proven:
            if target.pid not in signalled:
                refused[target.rank] = f"pid {target.pid} was gone or not the rank's process any more"
        return signalled, refused
