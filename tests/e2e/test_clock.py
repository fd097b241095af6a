"""A rank's wall clock stepped back 20 s in the middle of a real job (NTP stepping a node, a VM
resumed): no false hang, and a real hang after the step is told with its true timing.

The step is made in the rank's own process by ``clockshift.c`` (LD_PRELOAD): every read of
CLOCK_REALTIME through libc is offset from a chosen step on (Python's ``time.time``, gRPC's
deadlines, gloo), as on a stepped node, and the monotonic clocks are left alone, as the kernel
leaves them. The ranks ship their own records (no node agent), as the processes of a stepped node
without an agent do. Needs a C compiler (the test skips without one).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hangwatch import testing
from hangwatch.coordinator.daemon import Coordinator
from tests.e2e.test_fault_classes import _brief, wait_incident

pytestmark = pytest.mark.slow

STEPPED = """
import ctypes, datetime, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
t = torch.ones(4)
for step in range(1000):
    if rank == 1 and step == 10:
        # rank 1's node's clock steps back 20 s
        ctypes.c_longlong.in_dll(ctypes.CDLL(None), "hw_clock_offset_ns").value = -20 * 10**9
    if rank == 0 and step == 50:
        time.sleep(600)  # then a real hang: rank 0 stops coming
    dist.all_reduce(t)
    time.sleep(0.1)
"""


def test_a_clock_stepped_back_20_s_raises_no_false_hang(
    coordinator_factory: Callable[..., Coordinator], tmp_path: Path
) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the clock shim")
    shim = tmp_path / "clockshift.so"
    source = Path(__file__).with_name("clockshift.c")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"], check=True)
    c = coordinator_factory(stuck_after=3.0, embedded_agent=False)
    script = tmp_path / "stepped.py"
    script.write_text(STEPPED)
    env = testing.job_env(f"127.0.0.1:{c.port}", {"LD_PRELOAD": str(shim)})
    job = testing.torchrun(script, nproc=2, env=env, cwd=tmp_path, log=tmp_path / "stepped.log")
    try:
        inc = wait_incident(c, "stuck_collective", timeout=90)
        incs = c.incidents_json()
        assert [i["kind"] for i in incs] == ["stuck_collective"], _brief(incs)  # nothing during the 4 s after the step
        assert (inc["culprit_ranks"], inc["waiting_ranks"]) == ([0], [1])
        # told on time: the stepped rank's wait is not 20 s longer than it was
        assert 2.5 <= inc["detected_time"] - inc["onset_time"] < 8, _brief(incs)
        ranks = {rk["rank"]: rk for rk in c.status()["ranks"]}
        assert ranks[1]["state"] == "waiting"
        assert [st.clock_steps for _, st in sorted(c.job.ranks.items())] == [0, 1]  # the step was made, and seen
        # and the stepped rank's heartbeats go on while it waits: it is not taken for frozen
        time.sleep(6)
        assert [i["kind"] for i in c.incidents_json()] == ["stuck_collective"], _brief(c.incidents_json())
    finally:
        job.kill()
