"""The node agent reads a rank's Flight Recorder rings through the rank's worker server.

Both rings: the CPU one (gloo and other CPU backends, ``fr_trace_json``) and, in CUDA builds, the
NCCL one (``dump_nccl_trace_json``); a handler the build lacks answers 404 and that ring is
absent. The server runs on a C++ thread inside the rank (``hangwatch.client.workerserver``), so
this works while the rank is frozen with its GIL held.

Trust: the socket path comes from the rank's hello, so before sending anything the agent asks the
kernel who serves it (``SO_PEERCRED``) and refuses a socket whose server is not the rank's own
pid, as proven by the rank's link. Every query has a deadline.

Cost, measured on an H100 (``tests/fixtures/nccl/README.md``): a full 2,000-entry NCCL ring is
about 1 MB of JSON and 43-59 ms per round trip; with ``onlyactive=true`` under 1 ms. Read the
active entries often and the whole ring only when a diagnosis needs it.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any
from urllib.parse import urlencode

from hangwatch.link import peer_of

#: The handler of each ring, by the name the rest of hangwatch uses.
RING_HANDLERS = {"cpu": "fr_trace_json", "nccl": "dump_nccl_trace_json"}


class WorkerServerError(Exception):
    """The worker server could not be asked, or refused to answer."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float, expect_pid: int | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path
        self._expect_pid = expect_pid

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
            if self._expect_pid is not None:
                served_by = peer_of(sock).pid
                if served_by != self._expect_pid:
                    raise WorkerServerError(
                        f"{self._path} is served by pid {served_by}, not by the rank's pid {self._expect_pid}"
                    )
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def query(
    path: str, handler: str, params: dict[str, str] | None = None, *, expect_pid: int | None, timeout_s: float = 2.0
) -> bytes:
    """``POST /handler/<handler>?params`` on the worker server at ``path``; the body on 200."""
    conn = _UnixConnection(path, timeout_s, expect_pid)
    url = f"/handler/{handler}" + (f"?{urlencode(params)}" if params else "")
    try:
        conn.request("POST", url)
        reply = conn.getresponse()
        body = reply.read()
    except WorkerServerError:
        raise
    except (OSError, http.client.HTTPException) as e:
        raise WorkerServerError(f"{path}: {e or type(e).__name__}") from None
    finally:
        conn.close()
    if reply.status != 200:
        text = body[:200].decode("utf-8", "replace")
        raise WorkerServerError(f"{handler}: HTTP {reply.status}: {text}")
    return body


def read_rings(
    path: str, pid: int, *, only_active: bool = False, timeout_s: float = 2.0
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Both rings as parsed JSON (absent where the build has none), and why any could not be read."""
    rings: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    params = {"onlyactive": "true" if only_active else "false"}
    for name, handler in RING_HANDLERS.items():
        try:
            data = json.loads(query(path, handler, params, expect_pid=pid, timeout_s=timeout_s))
        except WorkerServerError as e:
            if "HTTP 404" not in str(e):  # this build has no such ring: nothing to say
                errors[name] = str(e)
            if "served by pid" in str(e):
                break  # the same socket: no use asking again
            continue
        except ValueError as e:
            errors[name] = f"{handler}: not JSON ({e})"
            continue
        if isinstance(data, dict):
            rings[name] = data
    return rings, errors
