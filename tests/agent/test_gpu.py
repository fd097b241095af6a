"""GPU health through NVML: the inspector against a fake NVML (the seam is ``load``), the agent
core reporting it with its ranks' statuses, and the wire carrying it. No GPU here: on a CPU node
the real binding is reported unavailable and nothing else changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from hangwatch import wire
from hangwatch.agent.core import NodeAgentCore
from hangwatch.agent.gpu import GpuInspector, load_nvml
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.records import GpuStatus, ProcessStatus, ProcState, Target
from tests.agent.test_core import FakeInspector

NVML_ERROR_TIMEOUT = 10


class NVMLError(Exception):
    pass


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int


@dataclass
class Device:
    name: str
    util: int
    procs: list[Proc] = field(default_factory=list)
    ecc: int = 0
    broken: bool = False  # every query but the process list fails


@dataclass
class Event:
    device: Any
    eventData: int
    eventType: int = 8


class FakeNvml:
    """pynvml's functions the inspector calls, over devices the test sets up."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, devices: list[Device]) -> None:
        self.devices = devices
        self.pending: list[Event] = []
        self.registered: list[int] = []

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Device:
        return self.devices[i]

    def _ok(self, d: Device) -> Device:
        if d.broken:
            raise NVMLError("Not Supported")
        return d

    def nvmlDeviceGetUUID(self, d: Device) -> bytes:
        return f"GPU-{self.devices.index(self._ok(d))}".encode()

    def nvmlDeviceGetName(self, d: Device) -> str:
        return self._ok(d).name

    def nvmlDeviceGetUtilizationRates(self, d: Device) -> Any:
        return type("U", (), {"gpu": self._ok(d).util})()

    def nvmlDeviceGetMemoryInfo(self, d: Device) -> Any:
        return type("M", (), {"used": 40 << 30, "total": 80 << 30})() if not d.broken else self._ok(d)

    def nvmlDeviceGetTotalEccErrors(self, d: Device, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)
        return self._ok(d).ecc

    def nvmlDeviceGetComputeRunningProcesses(self, d: Device) -> list[Proc]:
        return d.procs

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, d: Device, kinds: int, events: str) -> None:
        assert kinds == 8 and events == "set"
        self.registered.append(self.devices.index(d))

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Event:
        assert timeout_ms == 0  # never waits
        if not self.pending:
            raise NVMLError("Timeout")
        return self.pending.pop(0)


def _node() -> FakeNvml:
    return FakeNvml(
        [
            Device("NVIDIA H100", 100, [Proc(11, 30 << 30)]),
            Device("NVIDIA H100", 0, [Proc(12, 2 << 30), Proc(99, 1 << 30)]),
            Device("NVIDIA H100", 50, []),
        ]
    )


def test_each_rank_gets_the_gpus_it_runs_on() -> None:
    nvml = _node()
    gpus = GpuInspector(load=lambda: nvml, background=False).of([11, 12, 13])
    assert set(gpus) == {11, 12}  # 13 runs on no GPU; 99 is not a rank
    (g,) = gpus[11]
    assert (g.index, g.uuid, g.name, g.utilization) == (0, "GPU-0", "NVIDIA H100", 100)
    assert (g.memory_used, g.memory_total, g.process_memory, g.ecc_uncorrected) == (40 << 30, 80 << 30, 30 << 30, 0)
    assert gpus[12][0].utilization == 0 and gpus[12][0].process_memory == 2 << 30
    assert nvml.registered == [0, 1, 2]


def test_xid_events_stay_on_their_device_and_the_newest_is_reported() -> None:
    nvml = _node()
    inspector = GpuInspector(load=lambda: nvml, clock=lambda: 1234.0, background=False)
    assert inspector.of([11])[11][0].xid == 0
    nvml.pending = [Event(nvml.devices[1], 13), Event(nvml.devices[1], 79)]
    gpus = inspector.of([11, 12])
    assert gpus[11][0].xid == 0
    assert (gpus[12][0].xid, gpus[12][0].xid_time) == (79, 1234.0)


def test_a_failing_query_leaves_that_field_unknown() -> None:
    nvml = _node()
    nvml.devices[0].broken = True
    (g,) = GpuInspector(load=lambda: nvml, background=False).of([11])[11]
    assert (g.utilization, g.ecc_uncorrected, g.name, g.memory_total) == (-1, -1, "", 0)


def test_without_nvml_nothing_is_reported_and_the_reason_is_kept() -> None:
    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    inspector = GpuInspector(load=missing, background=False)
    assert inspector.of([11]) == {}
    assert inspector.of([11]) == {}  # tried once
    assert "pynvml" in inspector.unavailable


def test_the_real_binding_on_a_node_without_a_driver_is_unavailable() -> None:
    pytest.importorskip("pynvml")
    try:
        load_nvml()
    except Exception:
        pass
    else:
        pytest.skip("this node has an NVIDIA driver")
    inspector = GpuInspector(background=False)
    assert inspector.of([1]) == {} and inspector.unavailable


def test_the_agent_reports_its_ranks_gpus_and_a_new_xid_at_once() -> None:
    nvml = _node()
    inspector = FakeInspector()
    inspector.states[11] = ProcessStatus(11, ProcState.RUNNING, 1.0, start_time=500.0)
    core = NodeAgentCore(inspector=inspector, gpus=GpuInspector(load=lambda: nvml, clock=lambda: 7.0, background=False))
    core.set_targets([Target(0, 11, 500.0)])
    (first,) = core.poll()
    assert [g.utilization for g in first.gpus] == [100]
    assert core.poll() == []  # nothing changed
    nvml.pending = [Event(nvml.devices[0], 79)]
    (again,) = core.poll()  # an Xid is news: reported without waiting for the refresh
    assert again.gpus[0].xid == 79


def test_gpus_travel_on_the_wire_and_hostile_values_are_bounded() -> None:
    status = ProcessStatus(11, ProcState.RUNNING, 1.0, gpus=(GpuStatus(3, "GPU-x", "H100", 97, 1, 2, 3, 0, 79, 5.0),))
    msg = pb.ProcStatus()
    wire.process_status_to_pb(status, msg)
    assert wire.process_status_from_pb(msg) == status
    for _ in range(100):
        msg.gpus.add(name="x" * 10_000, xid_time=float("nan"))
    back = wire.process_status_from_pb(msg)
    assert len(back.gpus) == wire.MAX_GPUS and len(back.gpus[-1].name) == 128 and back.gpus[-1].xid_time == 0.0


def test_a_rank_that_dies_keeps_what_its_gpu_last_showed(coordinator_factory: Any) -> None:
    """The agent asks NVML only about live processes: the status that says a rank is gone has no
    GPUs. The Xid seen on its GPU just before stays with it, for the death's diagnosis."""
    from hangwatch.diagnosis.detectors.ends import _death_text
    from tests.factories import identity

    c = coordinator_factory(embedded_agent=False)
    c.accept_registration(identity(0, 2, host="node-a", pid=4242, start_time=500.0))
    xid = (GpuStatus(0, name="NVIDIA H100", utilization=100, xid=79, xid_time=1_000.0),)
    c.apply_process_statuses("node-a", [ProcessStatus(4242, ProcState.RUNNING, 1.0, 500.0, gpus=xid)])
    c.apply_process_statuses("node-a", [ProcessStatus(4242, ProcState.DEAD, 2.0, 500.0, signal=6)])
    st = c.job.ranks[0]
    assert st.proc is not None and st.proc.state is ProcState.DEAD and st.proc.gpus == xid
    assert "its GPU 0 (NVIDIA H100) reported Xid 79" in _death_text(st)


def test_a_blocked_nvml_never_blocks_the_agent() -> None:
    """A wedged GPU can make an NVML call hang: the agent's poll (and with it stack dumps and
    aborts on that node) answers at once from the last refresh, on time."""
    import threading
    import time

    nvml = _node()
    release = threading.Event()
    real = nvml.nvmlDeviceGetComputeRunningProcesses

    def blocked(d: Device) -> list[Proc]:
        release.wait(30)
        return real(d)

    nvml.nvmlDeviceGetComputeRunningProcesses = blocked  # type: ignore[method-assign]
    inspector = FakeInspector()
    inspector.states[11] = ProcessStatus(11, ProcState.RUNNING, 1.0, start_time=500.0)
    core = NodeAgentCore(inspector=inspector, gpus=GpuInspector(load=lambda: nvml))
    core.set_targets([Target(0, 11, 500.0)])
    t0 = time.monotonic()
    (first,) = core.poll()
    core.set_targets([Target(0, 11, 500.0)])
    assert time.monotonic() - t0 < 1.0 and first.gpus == ()
    release.set()
    gpus = GpuInspector(load=lambda: nvml)
    gpus.of([11])
    from hangwatch.testing import wait_for

    wait_for(lambda: gpus.of([11]), 5, 0.05, "the background refresh")
