"""``hangwatch analyze`` beside torch's own ``torchfrtrace`` on the same Flight Recorder dumps.

Real 3-rank gloo jobs (hangwatch not attached) dump their rings a few seconds into each fault
(``hangwatch.testing.fr_dump_job``); both tools read each folder, and what each reports and how
long it took is printed side by side. Then the time to analyse 1,024 ranks' dumps: a real job's
dumps of 2,000-entry rings (rank 1 skipped one all_reduce near the end) copied to 1,024 ranks
(rank 1's dump for rank 1, rank 0's for every other), with the files' times kept.

    .venv/bin/python bench/postmortem.py [--ranks 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hangwatch.postmortem import dumps, replay
from hangwatch.testing import BIN, fr_dump_job

SCENARIOS = {
    "rank 1 skipped an all_reduce (pickle, frames)": (
        "for step in range(5):\n    dist.all_reduce(t)\n    if not (rank == 1 and step == 3):\n"
        "        dist.all_reduce(t)\n",
        {},
    ),
    "the same, JSON dumps": (
        "for step in range(5):\n    dist.all_reduce(t)\n    if not (rank == 1 and step == 3):\n"
        "        dist.all_reduce(t)\n",
        {"fmt": "json"},
    ),
    "rank 2 broadcasts where the others all_reduce": (
        "for step in range(3):\n    dist.all_reduce(t)\n"
        "dist.broadcast(t, src=0) if rank == 2 else dist.all_reduce(t)\n",
        {},
    ),
    "rank 2 frozen holding the GIL: no dump of it": (
        "import ctypes\nfor step in range(6):\n    dist.all_reduce(t)\n    if rank == 2 and step == 3:\n"
        "        ctypes.PyDLL(None).sleep(300)\n",
        {},
    ),
    "healthy, dumped mid-run": (
        "deadline = time.time() + 30\nwhile time.time() < deadline:\n    dist.all_reduce(t)\n",
        {},
    ),
}

#: 2,000-entry rings: 700 steps of 3 all_reduce, rank 1 skipping one at step 650.
LONG = """
for step in range(700):
    dist.all_reduce(t)
    dist.all_reduce(t)
    if not (rank == 1 and step == 650):
        dist.all_reduce(t)
"""


def _ours(folder: Path, world: int | None = None) -> tuple[str, float]:
    t0 = time.perf_counter()
    analysis = replay.analyze(dumps.load(folder), stuck_after=5.0, world_size=world)
    took = time.perf_counter() - t0
    said = "; ".join(f"{i.kind.value}, culprit {i.culprit_ranks}: {i.summary}" for i in analysis.incidents)
    return said or "no incident", took


def _torch(folder: Path) -> tuple[str, float]:
    named = folder.parent / f"{folder.name}-torchfrtrace"  # the names it parses: <prefix><rank>
    if not named.exists():
        named.mkdir()
        for path in folder.iterdir():
            rank = dumps.rank_of(path.name, "nccl_trace_rank_")
            if rank is not None:
                shutil.copy2(path, named / f"nccl_trace_rank_{rank}")
    cmd = [str(BIN / "torchfrtrace"), str(named), "-p", "nccl_trace_rank_"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    took = time.perf_counter() - t0
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip() and "tabulate" not in ln]
    if done.returncode:
        return f"exit {done.returncode}: {lines[-1] if lines else ''}", took
    return " / ".join(lines[:3]) or "no output", took


def _cell(text: str, width: int = 220) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hangwatch-postmortem-"))
    try:
        print("| dumps of a 3-rank gloo job | `hangwatch analyze` | s | `torchfrtrace` | s |")
        print("| --- | --- | ---: | --- | ---: |")
        for i, (title, (body, kwargs)) in enumerate(SCENARIOS.items()):
            folder = fr_dump_job(body, work, name=f"s{i}", **kwargs)  # type: ignore[arg-type]
            ours, t_ours = _ours(folder)
            theirs, t_theirs = _torch(folder)
            print(f"| {title} | {_cell(ours)} | {t_ours:.2f} | {_cell(theirs)} | {t_theirs:.2f} |")
        source = fr_dump_job(LONG, work, name="long", dump_at=12.0)
        big = work / "big"
        big.mkdir()
        for rank in range(args.ranks):
            shutil.copy2(source / f"nccl_trace_rank_{1 if rank == 1 else 0}", big / f"nccl_trace_rank_{rank}")
        entries = len(dumps.load(source).dumps[0].entries)
        size = sum(p.stat().st_size for p in big.iterdir()) / 2**20
        ours_t, theirs_t = [], []
        ours = theirs = ""
        for _ in range(args.repeats):
            ours, t = _ours(big, args.ranks)
            ours_t.append(t)
            theirs, t = _torch(big)
            theirs_t.append(t)
        print()
        print(f"{args.ranks} ranks' dumps ({entries} entries each, pickle with frames, {size:.0f} MiB), "
              f"medians of {args.repeats}:")  # fmt: skip
        print()
        print("| tool | s to analyse | what it said |")
        print("| --- | ---: | --- |")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(f"| `hangwatch analyze` (peak RSS {peak:.0f} MiB) | {statistics.median(ours_t):.1f} | {_cell(ours)} |")
        print(f"| `torchfrtrace` | {statistics.median(theirs_t):.1f} | {_cell(theirs)} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
