"""A rank's link to its node agent: one Unix-socket connection for the rank's whole life.

The rank connects once, when it registers, and sends a hello (who it says it is, where its torch
worker server listens) with its ring's descriptor attached (``SCM_RIGHTS``). From then on the
connection carries nothing; it exists for what the kernel says about it:

- who is at the other end: ``SO_PEERCRED`` gives the peer's pid, uid and gid as the kernel knows
  them, so the agent never takes a rank's word for its identity;
- when that process is gone: its descriptors close when it exits, however it exits (SIGKILL,
  a native abort, the OOM killer), and the agent's end reads EOF at once.

One exchange follows the hello, at the rank's end: the rank says it is ending (``ENDING``) once its
last records are in its ring, and waits, for a bounded time, for the agent's ``FAREWELL``, sent
once the agent has read them and the rank's Flight Recorder one last time. That last read comes
with ``ENDING`` itself where the rank could make it: a memfd holding its rings' dump, as its
worker server would have answered, handed over like the ring. The agent reads it whenever it
gets to it, the rank gone or not; an agent starved of CPU used to ask the worker server after
the rank had stopped waiting, and the rank's last collectives issued from C++ went unread.

The ring's descriptor keeps the ring alive in the agent after the rank is gone, so its last
records are still there to read. Both ends are here; neither raises into the training job (the
rank's side returns None on any failure, and the rank goes on without an agent).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

#: A hello larger than this is refused: it is a few hundred bytes of JSON.
HELLO_MAX = 16384
_LEN = struct.Struct("<I")
MAX_FDS = 2  # the ring, and one spare for later use
ACK = b"\x01"  # the agent took the hello
ENDING = b"E"  # the rank: my last records are written (with it, maybe: its last Flight Recorder dump)
FAREWELL = b"\x02"  # the agent: read; you may go
#: A process its launcher started as a rank links from its first line, without a ring: its hello
#: says ``"phase": "starting"``, then it says when it enters ``init_process_group`` (``IN_INIT``)
#: and that it joined (``JOINED``: init returned; its rank's own link follows), and closes.
STARTING = "starting"
IN_INIT = b"I"
JOINED = b"J"


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a Unix socket, as the kernel says."""

    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return Peer(pid, uid, gid)


class LinkError(ValueError):
    """A hello that is not one (too long, not JSON, no descriptor)."""


def encode_hello(hello: dict[str, Any]) -> bytes:
    data = json.dumps(hello, separators=(",", ":"), sort_keys=True).encode()
    if len(data) > HELLO_MAX:
        raise LinkError(f"hello of {len(data)} bytes is over {HELLO_MAX}")
    return _LEN.pack(len(data)) + data


def _parse(data: bytes) -> dict[str, Any]:
    try:
        hello = json.loads(data)
    except (ValueError, RecursionError) as e:  # nested past the recursion limit is no hello either
        raise LinkError(f"a hello is JSON ({type(e).__name__})") from None
    if not isinstance(hello, dict):
        raise LinkError("a hello is a JSON object")
    return hello


class HelloReader:
    """One peer's hello as it arrives, a piece at a time, from a non-blocking socket: the agent's
    selector thread serves every link and never waits on one peer. The caller owns the
    descriptors once the hello is whole; ``close`` closes those it still holds."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.fds: list[int] = []

    def feed(self, sock: socket.socket) -> dict[str, Any] | None:
        """Take what ``sock`` has now: the hello once whole (its descriptors in ``fds``), None
        until then. ``LinkError`` when it cannot be one (closed early, too long, not JSON)."""
        want = _LEN.size + HELLO_MAX - len(self.data)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, max(1, want), MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            raise LinkError(str(e)) from None
        for fd in fds:
            if len(self.fds) < MAX_FDS:
                self.fds.append(fd)
            else:
                os.close(fd)
        if not msg:
            raise LinkError("connection closed before a whole hello")
        self.data += msg
        if len(self.data) < _LEN.size:
            return None
        (length,) = _LEN.unpack_from(self.data)
        if length > HELLO_MAX:
            raise LinkError(f"hello of {length} bytes is over {HELLO_MAX}")
        if len(self.data) < _LEN.size + length:
            return None
        return _parse(bytes(self.data[_LEN.size : _LEN.size + length]))

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


#: How long a rank waits for its agent's acknowledgement: an agent that answers after the rank gave
#: up holds a link the rank no longer uses, so wait as long as the agent listens.
CONNECT_TIMEOUT_S = 5.0


def connect(
    path: str, hello: dict[str, Any], fds: list[int], timeout_s: float = CONNECT_TIMEOUT_S
) -> socket.socket | None:
    """The rank's side: connect to the agent at ``path`` and send ``hello`` with ``fds``.

    Returns the connected socket (keep it open for the rank's life) after the agent's one-byte
    acknowledgement, or None when there is no agent or it refused. Never raises."""
    sock = None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(path)
        socket.send_fds(sock, [encode_hello(hello)], fds)
        if sock.recv(1) != ACK:
            sock.close()
            return None
        sock.settimeout(None)
        return sock
    except Exception:
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        return None


def farewell(sock: socket.socket, timeout_s: float, last_read: int | None = None) -> bool:
    """The rank's side, as it ends: say so (handing over ``last_read``, a descriptor of its last
    Flight Recorder dump, where it has one), and wait up to ``timeout_s`` for the agent to have
    read its last records. True when it answered. Never raises."""
    try:
        sock.settimeout(timeout_s)
        if last_read is None:
            sock.sendall(ENDING)
        else:
            socket.send_fds(sock, [ENDING], [last_read])
        while True:
            data = sock.recv(16)
            if not data:
                return False
            if FAREWELL in data:
                return True
    except Exception:
        return False
