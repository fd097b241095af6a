"""What interpreter start costs a process with the hook, measured side by side in one run.

Four variants, interleaved, ``python -c pass`` each time: no site hooks at all (``-S``), the
attach line with ``HANGWATCH_ADDR`` unset, set (the bootstrap imported), and set in a process its
launcher started as a rank (``RANK``, ``WORLD_SIZE``) that links to its node agent from its first
line (``client.joining``): a real agent socket served by this process. Prints medians and what
linking adds.

    python bench/start.py [--starts 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=40)
    args = parser.parse_args()
    from hangwatch.agent.rings import RingServer

    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_") and k not in ("RANK", "WORLD_SIZE")}
    with tempfile.TemporaryDirectory() as d:
        server = RingServer(os.path.join(d, "agent.sock"))
        server.start()
        hooked = {**env, "HANGWATCH_ADDR": "127.0.0.1:1"}
        variants = {
            "no site hooks (python -S)": ([sys.executable, "-S", "-c", "pass"], env),
            "HANGWATCH_ADDR unset": ([sys.executable, "-c", "pass"], env),
            "HANGWATCH_ADDR set": ([sys.executable, "-c", "pass"], hooked),
            "set, a rank linking to its agent": (
                [sys.executable, "-c", "pass"],
                {**hooked, "RANK": "0", "WORLD_SIZE": "2", "HANGWATCH_AGENT_SOCKET": server.path},
            ),
        }
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.starts):
            for name, (cmd, e) in variants.items():
                start = time.perf_counter()
                subprocess.run(cmd, env=e, check=True)
                samples[name].append(time.perf_counter() - start)
        linked = len(server.joining())
        server.stop()
    medians = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    print(f"interpreter start, median of {args.starts} each, interleaved ({linked} links still held):")
    for name, ms in medians.items():
        print(f"  {name:36s} {ms:6.2f} ms")
    base, linking = medians["HANGWATCH_ADDR set"], medians["set, a rank linking to its agent"]
    print(f"linking at start adds {linking - base:+.2f} ms (ratio {linking / base:.3f})")


if __name__ == "__main__":
    main()
