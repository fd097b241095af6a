"""torch's worker server in the rank, on a private socket: the rank's Flight Recorder, read from outside.

torch ships a per-process control-plane server (``torch._C._distributed_c10d._WorkerServer``) that
answers ``POST /handler/<name>`` on a Unix socket from a C++ thread: ``fr_trace_json`` (the CPU
ring), and in CUDA builds ``dump_nccl_trace_json`` (the NCCL ring). It needs neither the rank's
GIL nor a Python thread of ours: on an H100 it answered at once while the main thread held
the GIL in a native call and while it waited in ``.item()`` behind a stuck collective
(``tests/fixtures/nccl/README.md``). So the node agent reads a frozen rank's rings too.

The hook starts one when the rank registers, on a socket in a directory only the rank's user can
enter (mode 0700), and tells the agent the path in its hello; the agent checks that the socket is
served by the rank's own pid before it believes a byte of it. A user's own server
(``TORCH_WORKER_SERVER_SOCKET``, torch's ``worker_main``) is left alone and read instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Any

from hangwatch.config import private_dir

#: torch's variable for the worker server's socket (torch.distributed.elastic.control_plane).
USER_SOCKET_ENV = "TORCH_WORKER_SERVER_SOCKET"


class WorkerServer:
    """The rank's worker server (or the user's), and its socket path."""

    def __init__(self, path: str, server: Any | None) -> None:
        self.path = path
        self._server = server  # None: the user's own, not ours to stop

    @property
    def ours(self) -> bool:
        return self._server is not None

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
            self._server = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def planned_path() -> str:
    """Where the rank's worker server listens (or will): the user's own, else ours. "" if none can be."""
    try:
        return os.environ.get(USER_SOCKET_ENV) or os.path.join(private_dir(), f"worker-{os.getpid()}.sock")
    except Exception:
        return ""


def start(path: str) -> WorkerServer | None:
    """Start the rank's worker server on ``path`` (or adopt the user's own); None where this torch
    has none. Started only once the rank is linked to its agent: an unused server is not worth a
    thread, and stopping one right after starting it can hang. Never raises."""
    try:
        if not path:
            return None
        if path == os.environ.get(USER_SOCKET_ENV):
            return WorkerServer(path, None)
        from torch._C._distributed_c10d import _WorkerServer

        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by an earlier process with this pid
        return WorkerServer(path, _WorkerServer(path))
    except Exception:
        return None


#: The seals a last dump carries: its agent reads only a memfd that can no longer change.
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

#: What the rank's last dump answers for each ring, by the name the agent uses, and the function
#: in ``torch._C._distributed_c10d`` that makes it (the worker server's handlers call the same).
_DUMPS = {"cpu": "_dump_fr_trace_json", "nccl": "_dump_nccl_trace_json"}


def last_dump() -> int | None:
    """The rank's Flight Recorder rings as its worker server would answer them (a JSON object,
    ``{"cpu": ..., "nccl": ...}``, a ring this build lacks left out), in a memfd to hand to the
    agent as the rank ends; None where none could be made. Never raises.

    Made on the ending rank's own thread: an agent starved of CPU may ask the worker server only
    after the process is gone, and then the rank's last collectives issued from C++ (DDP's last
    buckets) were never read. It costs the rank once, at its end, a few milliseconds for a full
    ring (BENCHMARKS.md)."""
    fd = -1
    try:
        import torch

        c10d = torch._C._distributed_c10d
        parts: list[bytes] = []
        for name, function in _DUMPS.items():
            dump = getattr(c10d, function, None)
            if dump is None:
                continue
            data = dump(True, False)  # collectives included, not only the active ones
            parts.append(b'"%s":%s' % (name.encode(), data.encode() if isinstance(data, str) else bytes(data)))
        if not parts:
            return None
        body = memoryview(b"{" + b",".join(parts) + b"}")
        fd = os.memfd_create("hangwatch-last-read", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        while body:
            body = body[os.write(fd, body) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # what the agent reads cannot change under it
        return fd
    except Exception:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        return None
