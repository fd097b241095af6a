"""Keep the terminal output shown in README.md true: it is rendered by the real CLI renderers.

    python scripts/readme_samples.py --capture   # run a real 4-rank job with a hang, save its JSON
    python scripts/readme_samples.py             # re-render docs/samples/*.json into README.md

``tests/test_readme.py`` fails when README.md differs from what the renderers print for the
stored samples, so the README cannot drift from the program.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "docs" / "samples"

JOB = """
import datetime, time
import torch, torch.distributed as dist

def save_checkpoint(step):
    time.sleep(600)  # rank 3 writes a checkpoint the others do not wait for

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    if rank == 3 and step == 3:
        save_checkpoint(step)
    dist.all_reduce(torch.ones(2))
"""


def capture() -> None:
    from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions

    with tempfile.TemporaryDirectory() as tmp:
        coordinator = Coordinator(CoordinatorOptions(port=0, data_dir=tmp, stuck_after=5.0))
        coordinator.start()
        script = Path(tmp) / "train.py"
        script.write_text(textwrap.dedent(JOB))
        env = dict(os.environ, HANGWATCH_ADDR=f"127.0.0.1:{coordinator.port}", OMP_NUM_THREADS="1")
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script)],
            cwd=tmp,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.time() + 90
            incident = None
            while time.time() < deadline and incident is None:
                time.sleep(0.5)
                found = [i for i in coordinator.incidents_json() if i["stacks"]]
                incident = found[0] if found else None
            if incident is None:
                raise SystemExit("no incident with stacks within 90 s")
            status = coordinator.status()
        finally:
            job.terminate()
            job.wait(30)
            coordinator.stop()
    SAMPLES.mkdir(parents=True, exist_ok=True)
    (SAMPLES / "status.json").write_text(json.dumps(status, indent=1, sort_keys=True) + "\n")
    (SAMPLES / "incident.json").write_text(json.dumps(incident, indent=1, sort_keys=True) + "\n")


def rendered() -> dict[str, str]:
    from hangwatch.cli import render

    status = json.loads((SAMPLES / "status.json").read_text())
    incident = json.loads((SAMPLES / "incident.json").read_text())
    out = {}
    buf = io.StringIO()
    render.render_status(status, buf)
    out["status"] = buf.getvalue()
    buf = io.StringIO()
    render.render_report(incident, buf)
    out["report"] = buf.getvalue()
    return out


def block(name: str, text: str) -> str:
    return f"<!-- sample:{name} -->\n```text\n{text.rstrip()}\n```\n<!-- /sample:{name} -->"


def updated_readme() -> str:
    readme = (ROOT / "README.md").read_text()
    for name, text in rendered().items():
        pattern = re.compile(rf"<!-- sample:{name} -->.*?<!-- /sample:{name} -->", re.S)
        readme = pattern.sub(lambda m, n=name, t=text: block(n, t), readme)
    return readme


def main() -> int:
    if "--capture" in sys.argv:
        capture()
    (ROOT / "README.md").write_text(updated_readme())
    return 0


if __name__ == "__main__":
    sys.exit(main())
