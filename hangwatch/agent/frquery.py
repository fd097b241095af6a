"""One bounded query of a rank's worker server, and what its Flight Recorder rings say.

Trust: the socket path comes from the rank's hello, so before sending anything the agent asks the
kernel who serves it (``SO_PEERCRED``) and refuses a socket whose server is not the rank's own
pid, as proven by the rank's link. Every query has a deadline and a size cap.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlencode

from hangwatch import records as r
from hangwatch import untrusted
from hangwatch.link import peer_of

#: The handler of each ring, by the name the rest of hangwatch uses.
RING_HANDLERS = {"cpu": "fr_trace_json", "nccl": "dump_nccl_trace_json"}


class WorkerServerError(Exception):
    """The worker server could not be asked, or refused to answer."""


#: The largest answer a worker server may give (a full 2,000-entry NCCL ring is about 1 MB of
#: JSON); a larger one is refused unread, and so is one of more objects than its size allows
#: (``untrusted.loads_json``).
MAX_ANSWER_BYTES = 16 << 20
_MAX_HEAD = 16384


class _Deadline:
    """A Unix-socket exchange that must be whole by one moment, however the peer drips it."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.end = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def _left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise WorkerServerError(f"no whole answer within {self.timeout_s:g} s")
        self.sock.settimeout(left)
        return left

    def send(self, data: bytes) -> None:
        self._left()
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        self._left()
        return self.sock.recv(n)


def _answer(io: _Deadline, max_bytes: int) -> tuple[int, bytes]:
    """An HTTP/1.1 answer's status and body (by its length, chunked, or to its end), bounded."""
    head = b""
    while b"\r\n\r\n" not in head:
        more = io.recv(4096)
        if not more:
            raise WorkerServerError("closed before a whole answer")
        head += more
        if len(head) > _MAX_HEAD and b"\r\n\r\n" not in head[:_MAX_HEAD]:
            raise WorkerServerError("an answer's head over 16 KiB")
    head, _, body = head.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise WorkerServerError(f"not an HTTP answer: {lines[0][:80]!r}") from None
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise WorkerServerError("a bad Content-Length") from None
        if length > max_bytes:
            raise WorkerServerError(f"an answer of {length} bytes, over {max_bytes}")
        parts = [body]
        got = len(body)
        while got < length:
            more = io.recv(min(1 << 20, length - got))
            if not more:
                raise WorkerServerError("closed inside an answer")
            parts.append(more)
            got += len(more)
        return status, b"".join(parts)[:length]
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return status, _chunked(io, body, max_bytes)
    parts, got = [body], len(body)
    while True:
        more = io.recv(1 << 20)
        if not more:
            return status, b"".join(parts)
        got += len(more)
        if got > max_bytes:
            raise WorkerServerError(f"an answer over {max_bytes} bytes")
        parts.append(more)


def _chunked(io: _Deadline, data: bytes, max_bytes: int) -> bytes:
    buf = bytearray(data)
    out = bytearray()

    def fill(n: int) -> None:
        while len(buf) < n:
            more = io.recv(1 << 20)
            if not more:
                raise WorkerServerError("closed inside a chunked answer")
            buf.extend(more)

    while True:
        while b"\r\n" not in buf:
            if len(buf) > 64:
                raise WorkerServerError("a bad chunk size")
            fill(len(buf) + 1)
        line, _, rest = bytes(buf).partition(b"\r\n")
        try:
            size = int(line.split(b";")[0], 16)
        except ValueError:
            raise WorkerServerError("a bad chunk size") from None
        if len(out) + size > max_bytes:
            raise WorkerServerError(f"an answer over {max_bytes} bytes")
        buf[:] = rest
        fill(size + 2)
        if size == 0:
            return bytes(out)
        out += buf[:size]
        del buf[: size + 2]


def query(
    path: str,
    handler: str,
    params: dict[str, str] | None = None,
    *,
    expect_pid: int | None,
    timeout_s: float = 2.0,
    max_bytes: int = MAX_ANSWER_BYTES,
) -> bytes:
    """``POST /handler/<handler>?params`` on the worker server at ``path``; the body on 200.

    The whole exchange has ``timeout_s``, however the server drips its answer, and the body at
    most ``max_bytes``: a rank's worker server is the rank's, not the agent's, to trust."""
    url = f"/handler/{handler}" + (f"?{urlencode(params)}" if params else "")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    io = _Deadline(sock, timeout_s)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        if expect_pid is not None:
            served_by = peer_of(sock).pid
            if served_by != expect_pid:
                raise WorkerServerError(f"{path} is served by pid {served_by}, not by the rank's pid {expect_pid}")
        io.send(f"POST {url} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        status, body = _answer(io, max_bytes)
    except WorkerServerError as e:
        raise WorkerServerError(f"{path}: {e}") from None
    except TimeoutError:
        raise WorkerServerError(f"{path}: no whole answer within {timeout_s:g} s") from None
    except OSError as e:
        raise WorkerServerError(f"{path}: {e or type(e).__name__}") from None
    finally:
        sock.close()
    if status != 200:
        text = body[:200].decode("utf-8", "replace")
        raise WorkerServerError(f"{handler}: HTTP {status}: {text}")
    return body


def read_rings(
    path: str,
    pid: int,
    *,
    only_active: bool = False,
    collectives: bool = True,
    names: tuple[str, ...] = tuple(RING_HANDLERS),
    timeout_s: float = 2.0,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The rings ``names`` (default both) as parsed JSON (absent where the build has none), and
    why any could not be read. ``collectives=False``: no entries, only each group's
    ``pg_status`` (cheap: nothing serialised per entry). The NCCL handler honours both flags; the
    CPU ring's (torch 2.13) ignores them and always sends every entry."""
    rings: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    params = {
        "onlyactive": "true" if only_active else "false",
        "includecollectives": "true" if collectives else "false",
    }
    for name, handler in RING_HANDLERS.items():
        if name not in names:
            continue
        try:
            data = untrusted.loads_json(query(path, handler, params, expect_pid=pid, timeout_s=timeout_s), handler)
        except WorkerServerError as e:
            if "HTTP 404" not in str(e):  # this build has no such ring: nothing to say
                errors[name] = str(e)
            if "served by pid" in str(e):
                break  # the same socket: no use asking again
            continue
        except untrusted.Refused as e:
            errors[name] = str(e)
            continue
        if isinstance(data, dict):
            rings[name] = data
        else:  # a ring neither read nor failed is one the build has not (404): this one failed
            errors[name] = f"{handler}: not a JSON object"
    return rings, errors


def rings_of_dump(dump: bytes) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """A rank's own dump of its rings (``{"cpu": ..., "nccl": ...}``) as :func:`read_rings`
    answers: the rings that parsed, and why any did not. Never raises."""
    try:
        data = untrusted.loads_json(dump, "its last dump")
    except untrusted.Refused as e:
        return {}, {"dump": str(e)}
    if not isinstance(data, dict):
        return {}, {"dump": "not a JSON object"}
    rings: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for name in RING_HANDLERS:
        ring = data.get(name)
        if isinstance(ring, dict):
            rings[name] = ring
        elif ring is not None:
            errors[name] = "not a JSON object"
    return rings, errors


def entries_of(rings: dict[str, dict[str, Any]]) -> list[Any]:
    """Every entry of both rings, the CPU ring's first (their (group, seq) never overlap: a
    group records into one of them)."""
    out: list[Any] = []
    for name in RING_HANDLERS:
        entries = rings.get(name, {}).get("entries", [])
        if isinstance(entries, list):
            out.extend(entries)
    return out


def cpu_status(rings: dict[str, dict[str, Any]], nccl: Iterable[str] = ()) -> dict[str, tuple[int, int]]:
    """Each group's ``(last_enqueued, last_completed)`` from the CPU ring's ``pg_status`` (empty
    without one). They do not number collectives: ProcessGroupGloo's p2p ops move the group's
    sequence without an entry (the next collective's counter jumps past them), though never
    showing as under way, torch 2.13. Their difference says whether the group has a collective
    under way, which outlives the entry a full ring overwrote.
    Groups the NCCL ring showed (``nccl``) are left out: their collectives are recorded there."""
    status = rings.get("cpu", {}).get("pg_status")
    out: dict[str, tuple[int, int]] = {}
    if not isinstance(status, dict):
        return out
    theirs = set(nccl)
    for group, values in status.items():
        if str(group) in theirs:
            continue
        enqueued, completed = _count(values, "last_enqueued_collective"), _count(values, "last_completed_collective")
        if enqueued >= 0:
            out[str(group)] = (enqueued, completed)
    return out


def newest_record(rings: dict[str, dict[str, Any]]) -> int:
    """The CPU ring's newest ``record_id`` (-1: no entry): torch numbers every entry of a ring
    in one sequence, whatever its group, so ids gained between two reads say how fast the ring
    turns over."""
    newest = -1
    entries = rings.get("cpu", {}).get("entries")
    for entry in entries if isinstance(entries, list) else []:
        try:
            newest = max(newest, int(entry["record_id"]))
        except (KeyError, TypeError, ValueError):
            continue
    return newest


def enqueued(rings: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The last collective seq each group enqueued, from both rings' ``pg_status`` (values are
    strings in JSON; a group in neither ring is absent)."""
    out: dict[str, int] = {}
    for ring in rings.values():
        status = ring.get("pg_status")
        if not isinstance(status, dict):
            continue
        for group, values in status.items():
            try:
                seq = int(values["last_enqueued_collective"])
            except (KeyError, TypeError, ValueError):
                continue
            out[str(group)] = max(out.get(str(group), -1), seq)
    return out


def _count(values: Any, key: str) -> int:
    try:
        return int(values[key])
    except (KeyError, TypeError, ValueError):
        return -1


def progress_of(
    ring: dict[str, Any], timeouts: dict[str, int] | None = None, highest: dict[str, int] | None = None
) -> list[r.GroupProgress]:
    """Where each group's collectives stand on the device, from one read of the NCCL ring.

    Taken from the collective entries (not p2p) and their states, not from ``pg_status``'s
    counters: ProcessGroupNCCL stamps a p2p work with its p2p counter and moves
    ``last_enqueued``/``last_completed`` with it too, so after any send/recv on a group those
    counters mix two numberings (an all_reduce at seq 51 then reads "completed 1"). The first
    collective entry not completed is the one the group waits on (``completed`` is the seq before
    it, ``enqueued`` the last not completed); with none in flight, ``enqueued == completed``: at
    the time of the read everything enqueued had completed. ``started``: -1 where CUDA start
    events are off (``pg_status`` says -1), else the last started. Works on a whole read and on an
    ``onlyactive`` one (only entries not completed). ``timeouts`` (group -> ms) and ``highest``
    (group -> highest collective seq) carry what earlier reads found; entries found here update
    them. ``rank`` is left -1 and ``time`` 0 for the caller to fill."""
    status = ring.get("pg_status")
    status = status if isinstance(status, dict) else {}
    timeouts = {} if timeouts is None else timeouts
    seen = {} if highest is None else highest  # group -> highest collective seq seen
    started_at: dict[tuple[str, int], float] = {}
    pending: dict[str, list[tuple[int, bool]]] = {}  # group -> (seq, started) of collectives not completed
    done: dict[str, tuple[int, float]] = {}  # group -> (highest completed seq, when it was found so)
    entries = ring.get("entries")
    for entry in entries if isinstance(entries, list) else []:
        try:
            if entry.get("is_p2p"):
                continue
            group = str(entry["process_group"][0])
            seq = int(entry["collective_seq_id"])
            state = entry.get("state")
            completed_at = float(entry.get("time_discovered_completed_ns") or 0) / 1e9
            started_at[(group, seq)] = float(entry.get("time_discovered_started_ns") or 0) / 1e9
            timeout = int(entry.get("timeout_ms") or 0)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            continue
        if timeout > 0:
            timeouts[group] = timeout
        seen[group] = max(seen.get(group, -1), seq)
        if state == "completed":
            if seq > done.get(group, (-1, 0.0))[0]:
                done[group] = (seq, completed_at)
        else:
            pending.setdefault(group, []).append((seq, state == "started"))
    out = []
    for group in sorted(set(map(str, status)) | set(seen)):
        timing = _count(status.get(group, {}), "last_started_collective") >= 0
        waiting = sorted(pending.get(group, []))
        if waiting:
            completed = waiting[0][0] - 1
            enqueued = waiting[-1][0]
            started_seqs = [seq for seq, started in waiting if started]
            started = (started_seqs[-1] if started_seqs else completed) if timing else -1
        else:
            completed = enqueued = seen.get(group, -2)  # -2: nothing in flight, numbering unknown
            started = completed if timing else -1
        top = done.get(group)
        out.append(
            r.GroupProgress(
                rank=-1,
                group=group,
                enqueued=enqueued,
                started=started,
                completed=completed,
                time=0.0,
                completed_time=top[1] if top is not None and top[0] == completed else 0.0,
                timeout_ms=timeouts.get(group, 0),
                started_time=started_at.get((group, started), 0.0),
            )
        )
    return out


#: The NCCL ring is read whole at least this often, whatever the probe says (a safety net: the
#: probe reasons from counters torch does not document).
