"""A real job's hang diagnosed while hostile processes on its node do all they can to the same
coordinator and its embedded agent: a linked rank that tries to truncate its ring, one that
hands over a ring that could shrink, worker servers that drip or flood their answers (one of
them as it ends), hellos dripped or nested past the recursion limit, and an import bomb. Each
attack is a small program of its own; the job and the coordinator are real."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil

from hangwatch import link
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from hangwatch.testing import Job
from tests.e2e.test_fault_classes import STUCK_SLEEP, wait_incident

#: A linked process that serves its own worker socket: ``drip`` answers a byte every 0.3 s,
#: ``huge`` sends 512 MiB, ``flood`` 15 MiB of ``{},``; with ``end`` it then says it is ending
#: (no dump handed over: the agent asks its worker server, which drips). ``truncate`` tries to
#: shrink its ring under the agent, then links a second ring that was never sealed.
ATTACKER = r"""
import fcntl, os, socket, sys, threading, time
from hangwatch import link
from hangwatch.ring import RingWriter
path, mode, where = sys.argv[1], sys.argv[2], sys.argv[3]

def serve():
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(where); srv.listen(16)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()

def answer(conn):
    try:
        conn.recv(65536)
        if mode.startswith("drip"):
            for b in b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}":
                conn.sendall(bytes([b])); time.sleep(0.3)
        elif mode == "huge":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (512 << 20))
            for _ in range(512): conn.sendall(b" " * (1 << 20))
        else:
            body = b'{"entries": [' + b"{}," * (5 << 20) + b"{}]}"
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass

ring = RingWriter(capacity=1024, blob_bytes=4096, rank=0)
hello = {"job_id": "attack-" + mode, "rank": 0, "world_size": 1, "session": mode, "worker_socket": where}
if mode == "truncate":
    hello["worker_socket"] = ""
else:
    threading.Thread(target=serve, daemon=True).start()
    time.sleep(0.2)
sock = link.connect(path, hello, [ring.fd])
print("linked" if sock is not None else "refused", flush=True)
if mode == "truncate":
    try:
        os.ftruncate(ring.fd, 0)
        print("truncated", flush=True)
    except PermissionError:
        print("sealed", flush=True)
    loose = os.memfd_create("loose", os.MFD_ALLOW_SEALING)
    os.ftruncate(loose, ring.size)
    os.pwrite(loose, os.pread(ring.fd, 1024, 0), 0)
    again = link.connect(path, {**hello, "session": "loose"}, [loose])
    print("loose " + ("linked" if again is not None else "refused"), flush=True)
    if again is not None:
        os.ftruncate(loose, 0)
elif mode.endswith("end"):
    link.farewell(sock, 30.0)
time.sleep(120)
"""


def _drip_hello(path: str, stop: threading.Event) -> None:
    payload = link.encode_hello({"rank": 5, "session": "slow"})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall(payload[:5])
        for byte in payload[5:]:
            if stop.wait(0.5):
                return
            s.send(bytes([byte]))
    except OSError:
        return
    finally:
        s.close()


def _nested_hello(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(5)
        s.connect(path)
        deep = b"[" * 16000
        fd = os.memfd_create("x")
        socket.send_fds(s, [struct.pack("<I", len(deep)) + deep], [fd])
        os.close(fd)
        s.recv(1)
    except OSError:
        pass
    finally:
        s.close()


def test_a_real_hang_is_diagnosed_while_every_attack_runs_beside_it(
    coordinator_factory: Callable[..., Coordinator], torchrun: Callable[..., Job], tmp_path: Path
) -> None:
    c = coordinator_factory(stuck_after=3.0)
    assert c.rings is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    attackers = {
        mode: subprocess.Popen(
            [sys.executable, "-c", ATTACKER, c.rings.path, mode, str(tmp_path / f"{mode}.sock")],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in ("truncate", "drip", "drip-end", "huge", "flood")
    }
    stop = threading.Event()
    dripping = threading.Thread(target=_drip_hello, args=(c.rings.path, stop), daemon=True)
    try:
        said = {mode: proc.stdout.readline().strip() for mode, proc in attackers.items() if proc.stdout}
        assert said == dict.fromkeys(attackers, "linked"), said
        truncate = attackers["truncate"].stdout
        assert truncate is not None
        assert truncate.readline().strip() == "sealed"
        assert truncate.readline().strip() == "loose refused"
        dripping.start()
        _nested_hello(c.rings.path)
        with grpc.insecure_channel(f"127.0.0.1:{c.port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            bomb = zlib.compress(b'{"ranks": {"0": {"entries": [' + b"{}," * (20 << 20) + b"{}]}}}", 9)
            try:
                stub.ImportDumps(pb.ImportRequest(dumps=bomb), timeout=30)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), e
        # the real job, beside all of it: rank 1 sleeps at step 3, rank 0 waits in all_reduce
        job = torchrun(STUCK_SLEEP, addr=f"127.0.0.1:{c.port}", name="stuck_sleep")
        inc = wait_incident(
            c, "stuck_collective", timeout=60, pred=lambda i: i["job"] != "" and "attack" not in i["job"]
        )
        assert (inc["culprit_ranks"], inc["waiting_ranks"], inc["op"], inc["step"]) == ([1], [0], "all_reduce", 3)
        assert inc["detected_time"] - inc["onset_time"] < 3.0 + 4.0, inc  # the threshold, and a few ticks
        assert psutil.Process().memory_info().rss < 1 << 30  # the coordinator is this process
        for mode, proc in attackers.items():
            if mode != "truncate":
                assert proc.poll() is None, f"{mode}: gone"
        job.kill()
    finally:
        stop.set()
        for proc in attackers.values():
            proc.kill()
            proc.wait(5)
        dripping.join(5)
    assert c.rings is not None and c.rings.refused >= 3  # the loose ring, the nested and the dripped hello
