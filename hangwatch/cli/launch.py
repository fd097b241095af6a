"""``hangwatch run`` and ``hangwatch demo``: torchrun with a coordinator and agent attached.

The coordinator (with its embedded agent) runs in this process on a free port; the ranks get
``HANGWATCH_ADDR``; each incident's diagnosis is printed as it happens, and again in full once
its stacks are in. The exit code is torchrun's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from hangwatch import config, gctune
from hangwatch.cli import render

SCENARIOS = {
    "early_stop": "rank 1 stops training one step early (its own early-stop check) -> early_exit",
    "stuck": "rank 1 sleeps instead of joining an all_reduce -> stuck_collective",
    "checkpoint": "rank 0 saves a slow checkpoint while the others wait in a barrier -> stuck_collective",
    "shape_mismatch": "broadcast of [1, 5] on rank 0 vs [1, 2, 5] on rank 1 -> shape_mismatch",
    "dtype_mismatch": "all_reduce of float32 vs float64 -> dtype_mismatch",
    "op_mismatch": "rank 0 calls all_reduce while rank 1 calls broadcast -> op_mismatch",
    "died": "rank 1 raises an exception mid-training -> rank_died",
    "frozen": "rank 1 holds the GIL in native code -> rank_frozen",
}


def _printer(coordinator: Any) -> None:
    """Print each new incident now, and its full report once stacks arrive."""

    def on_incident(incident: Any) -> None:
        sys.stdout.write(f"\nhangwatch: [{incident.kind}] {incident.summary}\n")
        sys.stdout.flush()

        def full_report() -> None:
            deadline = time.time() + 15.0
            while time.time() < deadline and incident.stacks_time is None:
                time.sleep(0.2)
            data = coordinator.incident_json(incident.id)
            if data is not None:
                sys.stdout.write("\n")
                render.render_report(data)
                sys.stdout.flush()

        threading.Thread(target=full_report, daemon=True).start()

    coordinator.engine.listeners.append(on_incident)


def run_torchrun(
    args: argparse.Namespace,
    torchrun_args: list[str],
    extra_env: dict[str, str] | None = None,
    job_log: str | None = None,
) -> int:
    from hangwatch.coordinator.daemon import Coordinator, CoordinatorOptions

    options = CoordinatorOptions(
        host="127.0.0.1",
        port=getattr(args, "port", 0) or 0,
        data_dir=args.data_dir or tempfile.mkdtemp(prefix="hangwatch-"),
        token=getattr(args, "token", None),
        stuck_after=args.stuck_after,
        abort_on_hang=getattr(args, "abort_on_hang", False),
        alert_webhook=getattr(args, "alert_webhook", None),
        max_data_mb=getattr(args, "max_data_mb", config.DEFAULT_MAX_DATA_MB),
    )
    coordinator = Coordinator(options)
    coordinator.start()
    gctune.tune()  # this process is the coordinator's while the job runs (torchrun is a child)
    _printer(coordinator)
    env = dict(os.environ)
    for secret in (config.ENV_AGENT_TOKEN, config.ENV_AGENT_TOKEN_FILE):
        env.pop(secret, None)  # the agents' credential is never a rank's
    env[config.ENV_ADDR] = f"127.0.0.1:{coordinator.port}"
    if options.token:
        env[config.ENV_TOKEN] = options.token
    env.update(extra_env or {})
    sys.stdout.write(f"hangwatch: coordinator on 127.0.0.1:{coordinator.port}, data in {options.data_dir}\n")
    sys.stdout.flush()
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args]
    log_file = open(job_log, "w") if job_log else None  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT if log_file else None)
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        code = proc.wait()
    finally:
        if log_file is not None:
            log_file.close()
    time.sleep(1.0)  # let the last batches and detections land
    coordinator.engine.tick()
    time.sleep(0.5)
    incidents = coordinator.incidents_json()
    sys.stdout.write(
        f"\nhangwatch: job exited with code {code}; {len(incidents)} incident(s) stored in {options.data_dir}\n"
    )
    if job_log:
        sys.stdout.write(f"hangwatch: the job's own output is in {job_log}\n")
    coordinator.stop()
    return code


def cmd_run(args: argparse.Namespace) -> int:
    rest = list(args.torchrun_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        sys.stderr.write("hangwatch run: give torchrun options and a script, e.g. --nproc-per-node 2 train.py\n")
        return 2
    return run_torchrun(args, rest)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.list:
        for name, text in SCENARIOS.items():
            sys.stdout.write(f"{name:<16} {text}\n")
        return 0
    if args.scenario not in SCENARIOS:
        sys.stderr.write(f"hangwatch demo: unknown scenario {args.scenario!r}; see hangwatch demo --list\n")
        return 2
    sys.stdout.write(f"hangwatch demo {args.scenario}: {SCENARIOS[args.scenario]}\n")
    args.abort_on_hang = True  # the demo ends itself once the hang is diagnosed
    from hangwatch import demos

    script = os.path.join(os.path.dirname(demos.__file__), "scenarios.py")
    torchrun_args = ["--nproc-per-node", str(args.nproc), "--standalone", script, args.scenario]
    args.data_dir = args.data_dir or tempfile.mkdtemp(prefix="hangwatch-demo-")
    run_torchrun(args, torchrun_args, {"OMP_NUM_THREADS": "1"}, job_log=os.path.join(args.data_dir, "job.log"))
    return 0
