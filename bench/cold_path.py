"""Where the calling thread's cost per collective goes: each piece of the hook's hot path, alone
and interleaved with a real collective, side by side in one process.

The hook's hot path costs a few microseconds in a warm loop (``bench/overhead.py``), yet a tight
loop of real ``all_reduce`` calls pays several times that. This script takes the hot path apart:
one gloo rank (world size 1), and loops that issue the real ``all_reduce`` preceded by one piece
of the hot path each (the caller's frame, the tensors' shapes and dtypes, the signature lookup,
the ring write, the group's sequence counter), all of them, the whole ``Recorder.enter``/``exit``,
and the same pieces with no collective between them (warm). Variants alternate in rounds; the
figure is the median over rounds of the calling thread's CPU per call, minus the bare call's.

    .venv/bin/python bench/cold_path.py --rounds 10 --calls 2000
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from hangwatch.client import recorder as rec_mod
    from hangwatch.client.ops import OPS_BY_NAME
    from hangwatch.client.ringsink import RingSink

    torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    spec = OPS_BY_NAME["all_reduce"]
    collective = dist.all_reduce
    rec = rec_mod.Recorder(0, RingSink(65536, rank=0), c10d)
    pg = rec.default_pg = c10d._get_default_group()
    rec.flush_novel = False
    rec.covers = False
    sink = rec.sink
    t = torch.ones(4, device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def piece(name: str) -> Callable[[dict[str, Any]], None]:
        def site(params: dict[str, Any]) -> None:
            rec.call_site(2)

        def metas(params: dict[str, Any]) -> None:
            rec_mod.raw_metas(spec, spec.inputs, params)

        def key(params: dict[str, Any]) -> None:
            ins = ((t.shape, t.dtype, False),)
            sink.signatures.get((spec, "0", ins, ins, "sum", None, None, False, "train.py:1", None))

        def pack(params: dict[str, Any]) -> None:
            sink.put_slot(sink.mm, sink.positions, sink.capacity, 1, 0, 0, 5, 1, 1, 1, 0, 0.0)

        def seq(params: dict[str, Any]) -> None:
            pg._get_sequence_number_for_group()

        def clock(params: dict[str, Any]) -> None:
            time.time()

        return {"frame": site, "metas": metas, "signature": key, "ring": pack, "seq": seq, "clock": clock}[name]

    pieces = ["frame", "metas", "signature", "ring", "seq", "clock"]

    def loop(work: list[Callable[[dict[str, Any]], None]], with_call: bool, whole: bool) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                params = {"tensor": t}
                if whole:
                    entered = rec.enter(spec, params)
                for w in work:
                    w(params)
                if with_call:
                    collective(t)
                    sync()
                if whole:
                    rec.exit(*entered, None, None)

        return run

    variants: dict[str, Callable[[int], None]] = {"bare call": loop([], True, False)}
    for name in pieces:
        variants[f"{name} + call"] = loop([piece(name)], True, False)
    variants["all pieces + call"] = loop([piece(n) for n in pieces], True, False)
    variants["enter/exit + call"] = loop([], True, True)
    variants["all pieces, warm"] = loop([piece(n) for n in pieces], False, False)
    variants["enter/exit, warm"] = loop([], False, True)
    # the whole wrapper, as ``capture`` installs it: its fast path in C and in Python
    from hangwatch.client import capture

    class _Session:  # what the wrapper reads of a session
        recorder = rec

        def fail(self, what: str, exc: BaseException) -> None:
            raise AssertionError(f"{what}: {exc}")

    capture.set_session(_Session())

    def noop(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    def wrapped(original: Callable[..., Any], native: bool) -> Callable[..., Any]:
        os.environ["HANGWATCH_NATIVE"] = "1" if native else "0"
        fn = capture._wrap_op(spec, original)
        for _ in range(3):
            fn(t)  # the first call remembers the call site; the rest take the fast path
        return fn

    def call_loop(fn: Callable[..., Any]) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                fn(t)
                sync()

        return run

    for native in (True, False) if capture._native is not None else (False,):
        which = "C" if native else "Python"
        variants[f"{which} wrapper + call"] = call_loop(wrapped(c10d.all_reduce, native))
        variants[f"{which} wrapper, warm"] = call_loop(wrapped(noop, native))
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            run(200)
            c0 = time.thread_time()
            run(args.calls)
            results[name].append((time.thread_time() - c0) / args.calls * 1e6)
    bare = statistics.median(results["bare call"])
    print(f"calling thread CPU per call, medians of {args.rounds} rounds x {args.calls} calls ({args.device}):")
    for name, values in results.items():
        median = statistics.median(values)
        extra = "" if name == "bare call" or "warm" in name else f"  (+{median - bare:.2f})"
        print(f"  {name:22s} {median:7.2f} us{extra}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
