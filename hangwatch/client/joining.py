"""A process its launcher started as a rank, linked to its node agent from its first line.

Until ``init_process_group`` returns, the process is not a rank: the launcher says which rank it
will be (``RANK``, ``WORLD_SIZE``), nothing more is known. It links to its node agent at
interpreter start with that, and no ring: the agent proves its pid through the kernel, and says
so to the coordinator, which then sees who never joined a job whose other ranks wait in
``init_process_group`` (a rank still downloading its data, one that never started). It says
when it enters ``init_process_group`` and when it joined, then closes the link: its rank's own
link (``client.session``) takes over.

Interpreter start pays for this in every such process: no ``socket``, ``json`` or ``uuid`` import
(milliseconds each), a connect and one write, never a wait for the agent. It never raises.
"""

from __future__ import annotations

import os

_sock = None  # the link, while the process is joining (a ``_socket.socket``)


def _text(s: str) -> str:
    """A JSON string of ``s`` without importing json."""
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " ":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def hello(rank: int, world_size: int) -> bytes:
    """The hello of a starting process: who its launcher says it will be, framed for the agent."""
    from hangwatch import config

    fields: dict[str, object] = {
        "phase": "starting",
        "job_id": config.job_id_from_env(),
        "rank": rank,
        "world_size": world_size,
        "local_rank": _int(os.environ.get("LOCAL_RANK"), -1),
        "session": os.urandom(16).hex(),
        "host": os.environ.get(config.ENV_NODE_NAME) or os.uname().nodename,
        "launch": config.launch_from_env(),
        "attempt": config.attempt_from_env(),
        "pid": os.getpid(),
    }
    body = "{" + ",".join(f"{_text(k)}:{v if isinstance(v, int) else _text(str(v))}" for k, v in fields.items()) + "}"
    data = body.encode()
    return len(data).to_bytes(4, "little") + data


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def start(addr: str, timeout_s: float = 0.2) -> bool:
    """Link this process as the rank its launcher says it will be; False where it is not one
    (no ``RANK``/``WORLD_SIZE``) or there is no agent to link to."""
    global _sock
    rank = _int(os.environ.get("RANK"), -1)
    world_size = _int(os.environ.get("WORLD_SIZE"), 0)
    if not 0 <= rank < world_size:
        return False
    import _socket

    from hangwatch import config

    try:
        path = config.agent_socket_path(addr)
        if not os.path.exists(path):
            return False
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(hello(rank, world_size))
            sock.setblocking(False)  # the agent's acknowledgement is not waited for
        except OSError:
            sock.close()
            return False
    except Exception:
        return False
    _sock = sock
    return True


def _say(what: bytes) -> None:
    sock = _sock
    if sock is not None:
        try:
            sock.send(what)
        except OSError:
            pass


def entering_init() -> None:
    """``init_process_group`` is entered."""
    _say(b"I")


def joined() -> None:
    """``init_process_group`` returned and the rank linked in full: this link is done."""
    global _sock
    sock, _sock = _sock, None
    if sock is not None:
        try:
            sock.send(b"J")
            sock.close()
        except OSError:
            pass


def _after_fork_in_child() -> None:
    """A forked child is not the joining process: close its copy, or the agent would not see the
    process go (the connection closes with its last descriptor)."""
    global _sock
    sock, _sock = _sock, None
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
