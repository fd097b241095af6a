"""The GPUs of a node's ranks, through NVML: utilisation, memory, ECC errors and Xid events.

Optional: the ``gpu`` extra installs ``nvidia-ml-py`` (NVIDIA's maintained binding, imported as
``pynvml``); without it, or on a node without a driver, :class:`GpuInspector` reports nothing
and says why once (``unavailable``). A rank's GPUs are those NVML lists it as a compute process
on. Xid errors (NVML's ``XidCriticalError`` events: a GPU that fell off the bus, a page fault,
a hung channel) are collected from an event set polled without waiting, and stay on the device
they came from.

A hung NCCL rank typically shows its GPU at 100 % utilisation: NCCL's kernel spins while it
waits for its peers. That, and an Xid, is what the coordinator's diagnosis quotes.

``nvml`` is the seam: anything with pynvml's functions (tests pass a fake NVML). Every NVML call
is guarded; an error on one device or one query leaves that field unknown, never the agent down.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from hangwatch.records import GpuStatus

log = logging.getLogger("hangwatch.agent")

#: Xid events kept per device (the newest wins in reports).
XIDS_KEPT = 8


def load_nvml() -> Any:
    """``pynvml``, initialised; raises ImportError or NVML's own error where unavailable."""
    import pynvml  # type: ignore[import-not-found, import-untyped, unused-ignore]

    pynvml.nvmlInit()
    return pynvml


#: How often the background thread asks NVML again.
REFRESH_S = 2.0


class GpuInspector:
    """What NVML says of the GPUs a set of processes run on. Thread-safe; NVML is loaded on first
    use (``load`` is the seam: it returns pynvml or a fake, or raises).

    NVML is asked on a thread of its own (``background``, the default): a GPU that fell off the
    bus can make an NVML call block, and the agent's loop, which serves stack dumps and aborts,
    must never wait on it. :meth:`of` then answers at once from the last refresh (at most
    ``REFRESH_S`` old; nothing before the first). ``background=False`` asks NVML in :meth:`of`
    itself (tests)."""

    def __init__(
        self, load: Callable[[], Any] = load_nvml, clock: Callable[[], float] = time.time, background: bool = True
    ) -> None:
        self._load = load
        self._clock = clock
        self._background = background
        self._wanted: frozenset[int] = frozenset()
        self._cache: dict[int, tuple[GpuStatus, ...]] = {}
        self._thread: threading.Thread | None = None
        self._asked = threading.Event()
        self._nvml: Any = None
        self._tried = False
        self._lock = threading.Lock()
        self._events: Any = None
        self._handles: list[Any] = []
        self.unavailable = ""  # why NVML could not be used ("" while it can, or before first use)
        self.xids: dict[int, list[tuple[int, float]]] = {}  # device index -> [(xid, time)]

    def _start(self) -> bool:
        if self._tried:
            return self._nvml is not None
        self._tried = True
        try:
            nvml = self._load()
            count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as e:  # no binding, no driver, no device: a CPU node
            self.unavailable = f"{type(e).__name__}: {e}"
            log.info("GPU health not watched: %s", self.unavailable)
            return False
        self._nvml = nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
            for handle in self._handles:
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
                except Exception:
                    continue  # this device does not report Xids (not supported, no permission)
        except Exception:
            self._events = None
        return True

    def _drain_xids(self) -> None:
        nvml, events = self._nvml, self._events
        if events is None:
            return
        for _ in range(64):  # bounded: a storm of events is read over several polls
            try:
                data = nvml.nvmlEventSetWait_v2(events, 0)
            except Exception:
                return  # NVML_ERROR_TIMEOUT: nothing pending (or the set failed)
            index = self._index_of(data.device)
            if index is None:
                continue
            kept = self.xids.setdefault(index, [])
            kept.append((int(data.eventData), self._clock()))
            del kept[:-XIDS_KEPT]

    def _index_of(self, handle: Any) -> int | None:
        for i, h in enumerate(self._handles):
            if h == handle or _address(h) == _address(handle):
                return i
        return None

    def of(self, pids: Iterable[int]) -> dict[int, tuple[GpuStatus, ...]]:
        """pid -> the GPUs it runs on (empty where NVML is unavailable or knows no such pid)."""
        wanted = frozenset(pids)
        if not self._background:
            return self.query(wanted)
        if self._tried and self._nvml is None:
            return {}  # no NVML here
        self._wanted = wanted
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hangwatch-nvml", daemon=True)
            self._thread.start()
        self._asked.set()
        cache = self._cache
        return {pid: cache[pid] for pid in wanted if pid in cache}

    def _run(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            try:
                self._cache = self.query(self._wanted)
            except Exception:  # never this thread's end
                log.debug("NVML query failed", exc_info=True)
            time.sleep(REFRESH_S)

    def query(self, pids: Iterable[int]) -> dict[int, tuple[GpuStatus, ...]]:
        """Ask NVML now (blocks as long as NVML does)."""
        wanted = set(pids)
        with self._lock:
            if not wanted or not self._start():
                return {}
            self._drain_xids()
            out: dict[int, list[GpuStatus]] = {}
            for index, handle in enumerate(self._handles):
                users = self._users(handle)
                mine = wanted.intersection(users)
                if not mine:
                    continue
                device = self._device(index, handle)
                for pid in mine:
                    out.setdefault(pid, []).append(_with_process_memory(device, users[pid]))
            return {pid: tuple(gpus) for pid, gpus in out.items()}

    def _users(self, handle: Any) -> dict[int, int]:
        """pid -> bytes of the device's memory it holds, for its compute processes."""
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return {}
        users: dict[int, int] = {}
        for p in procs:
            try:
                users[int(p.pid)] = int(p.usedGpuMemory or 0)
            except (TypeError, ValueError, AttributeError):
                continue
        return users

    def _device(self, index: int, handle: Any) -> GpuStatus:
        nvml = self._nvml

        def ask(fn: Callable[[], Any], default: Any) -> Any:
            try:
                return fn()
            except Exception:
                return default

        uuid = ask(lambda: _text(nvml.nvmlDeviceGetUUID(handle)), "")
        name = ask(lambda: _text(nvml.nvmlDeviceGetName(handle)), "")
        util = ask(lambda: int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu), -1)
        memory = ask(lambda: nvml.nvmlDeviceGetMemoryInfo(handle), None)
        ecc = ask(
            lambda: int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            ),
            -1,
        )
        xids = self.xids.get(index, [])
        xid, xid_time = xids[-1] if xids else (0, 0.0)
        return GpuStatus(
            index=index,
            uuid=uuid,
            name=name,
            utilization=util,
            memory_used=int(getattr(memory, "used", 0) or 0),
            memory_total=int(getattr(memory, "total", 0) or 0),
            ecc_uncorrected=ecc,
            xid=xid,
            xid_time=xid_time,
        )


def _with_process_memory(device: GpuStatus, used: int) -> GpuStatus:
    return dataclasses.replace(device, process_memory=used)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _address(handle: Any) -> object:
    """A device handle's identity: pynvml returns a fresh ctypes pointer object per call."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except Exception:
        return id(handle)
