"""One attached rank: who it is, its recorder and its sender, and its end.

A process becomes a rank when ``init_process_group`` returns in it (that is when rank and
world size are known): ``after_init`` creates the Session, which registers with the coordinator
from its sender thread. Launchers and DataLoader workers never call ``init_process_group`` and so
never register; forked children drop the inherited Session at fork.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
from types import TracebackType
from typing import Any

from hangwatch import __version__, config, link, native
from hangwatch import records as r
from hangwatch.client import capture, joining, workerserver
from hangwatch.client.recorder import Recorder
from hangwatch.client.ringsink import RingSink
from hangwatch.native import foreign

log = logging.getLogger("hangwatch.client")

#: The longest an ending rank waits for its agent to have read its last records (one shipper
#: tick and a Flight Recorder read: tens of milliseconds).
FAREWELL_TIMEOUT_S = 0.5

#: Settings for the next Session, from ``attach()`` or the environment.
_settings: dict[str, Any] = {}


def hook_version() -> str:
    """What a rank says of its hook when it registers: its version, and whether it records calls
    in C or in Python and why (``hangwatch status`` shows it per rank): ``0.1.0 (native)``."""
    return f"{__version__} ({native.describe()})"


class Session:
    """One attached rank: its ring, its recorder, its link to the node agent, its sender thread.

    ``link`` is the connection to the node agent that holds the ring (None: no agent on this
    node, and the sender ships the ring itself); ``agent_socket`` None skips looking for one."""

    def __init__(
        self,
        identity: r.RankIdentity,
        addr: str,
        token: str | None,
        c10d: Any,
        agent_socket: str | None = None,
        **sender_seams: Any,
    ) -> None:
        from hangwatch.client.sender import Sender

        self.identity = identity
        self.sink = RingSink(config.env_int(config.ENV_QUEUE_SIZE, config.DEFAULT_QUEUE_SIZE), rank=identity.rank)
        self.recorder = Recorder(identity.rank, self.sink, c10d)
        self.worker_server: workerserver.WorkerServer | None = None
        self.agent_socket = agent_socket
        # the agent reads Flight Recorder through it; HANGWATCH_FLIGHT_RECORDER=0: none to read
        reads_fr = config.env_flag(config.ENV_FLIGHT_RECORDER, True)
        self.worker_socket = workerserver.planned_path() if agent_socket and reads_fr else ""
        self.link = link.connect(agent_socket, self.hello(self.worker_socket), [self.sink.fd]) if agent_socket else None
        if self.link is not None:
            self.recorder.flush_novel = False  # every record is outside the rank already
            self.worker_server = workerserver.start(self.worker_socket) if self.worker_socket else None
            # Flight Recorder is read from outside, coverage taken from the ring: none to keep here
            self.recorder.covers = self.worker_server is None
        self.sender = Sender(self, addr, token, **sender_seams)
        self.ended = False
        self._failures: set[str] = set()

    def relink(self) -> bool:
        """Link to the node agent again (from the sender thread, after the agent went away)."""
        if self.agent_socket:
            self.link = link.connect(self.agent_socket, self.hello(self.worker_socket), [self.sink.fd])
        return self.link is not None

    @property
    def via(self) -> str:
        return "agent" if self.link is not None else "direct"

    def hello(self, worker_socket: str = "") -> dict[str, Any]:
        """What the rank says of itself to its node agent (its pid, uid and liveness the agent
        takes from the kernel instead)."""
        i = self.identity
        return {
            "job_id": i.job_id,
            "rank": i.rank,
            "world_size": i.world_size,
            "local_rank": i.local_rank,
            "session": i.session,
            "host": i.host,
            "backend": i.backend,
            "torch_version": i.torch_version,
            "hook_version": i.hook_version,
            "pid": i.pid,
            "launch": i.launch,
            "attempt": i.attempt,
            "worker_socket": worker_socket,
        }

    def fail(self, what: str, exc: BaseException) -> None:
        """An internal error: log it once, say so in the ring (``status`` shows it), and stop
        recording calls (the job goes on)."""
        was_on = capture.active_session() is self
        capture.set_session(None)
        if what not in self._failures:
            self._failures.add(what)
            log.warning(
                "hangwatch: internal error while %s (%s: %s); call capture disabled",
                what,
                type(exc).__name__,
                exc,
            )
        if was_on:
            detail = f"internal error while {what} ({type(exc).__name__}: {exc})"[:500]
            try:
                self.sink.put(r.MarkerEvent(self.identity.rank, r.CAPTURE_OFF, time.time(), detail))
            except Exception as inner:  # the ring itself failing: the log said it
                if foreign(inner):
                    raise
                log.debug("hangwatch: could not record that capture is off: %s", inner)

    def end(
        self,
        kind: r.EndKind,
        detail: str = "",
        call_site: str = "",
        exit_code: int | None = None,
        flush_timeout: float = 1.0,
    ) -> None:
        if self.ended:
            return
        self.ended = True
        self.sink.put(
            r.RankEnd(self.identity.rank, kind, time.time(), detail, call_site, exit_code, self.recorder.step)
        )
        self.sender.flush(flush_timeout)
        sock = self.link
        if sock is not None:
            # the agent reads this rank's last records, and its Flight Recorder one last time:
            # the dump handed over with the farewell, made here, outlives the process
            last_read = workerserver.last_dump() if self.worker_server is not None else None
            try:
                link.farewell(sock, min(flush_timeout, FAREWELL_TIMEOUT_S), last_read)
            finally:
                if last_read is not None:
                    with contextlib.suppress(OSError):
                        os.close(last_read)


_session: Session | None = None
_session_lock = threading.Lock()


def current() -> Session | None:
    return _session


def _process_start_time() -> float:
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return 0.0


def _pid_namespace() -> str:
    """This process's pid namespace, so an agent outside the container can find its host pid."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def after_init(params: dict[str, Any]) -> None:
    """``init_process_group`` returned: this process is a rank; attach it."""
    global _session
    import torch
    import torch.distributed.distributed_c10d as c10d

    if config.inherited_rank():
        return  # a subprocess of a rank that initialised its own group: not one of the job's ranks
    addr = _settings.get("addr") or os.environ.get(config.ENV_ADDR)
    if not addr or config.env_flag(config.ENV_DISABLE):
        return
    with _session_lock:
        if _session is not None:
            _session.recorder.default_pg = c10d._get_default_group()  # re-initialised after a destroy
            _session.recorder.memo.clear()  # call sites remembered with the old default group
            return
        rank = int(c10d.get_rank())
        identity = r.RankIdentity(
            job_id=_settings.get("job_id") or config.job_id_from_env(),
            rank=rank,
            world_size=int(c10d.get_world_size()),
            host=os.environ.get(config.ENV_NODE_NAME) or socket.gethostname(),
            pid=os.getpid(),
            local_rank=int(os.environ.get("LOCAL_RANK", "-1")),
            start_time=_process_start_time(),
            session=uuid.uuid4().hex,
            backend=str(c10d.get_backend()),
            torch_version=str(torch.__version__),
            hook_version=hook_version(),
            pid_namespace=_pid_namespace(),
            launch=config.launch_from_env(),
            attempt=config.attempt_from_env(),
        )
        session = Session(
            identity, addr, _settings.get("token") or os.environ.get(config.ENV_TOKEN), c10d, _agent_socket(addr)
        )
        os.environ[config.ENV_RANK_PID] = str(os.getpid())
        os.environ.pop(config.ENV_RANK_OF, None)  # every process it starts from now on is not a rank
        session.recorder.default_pg = c10d._get_default_group()
        session.recorder.group_info(session.recorder.default_pg)
        _session = session
        capture.set_session(session)
        _install_end_hooks()
        _install_step_hook()
        session.sender.start()
    joining.joined()


def after_new_group(pg: Any, params: dict[str, Any]) -> None:
    session = _session
    if session is None or pg is None:
        return
    try:
        from torch.distributed.distributed_c10d import GroupMember

        if pg is GroupMember.NON_GROUP_MEMBER:
            return
    except Exception:
        pass
    session.recorder.group_info(pg)


def before_destroy(group: Any) -> Any:
    session = _session
    if session is None:
        return None
    session.recorder.memo.clear()  # call sites remembered with the group (any: cheap, rare)
    if group is None:
        session.recorder.default_pg = None
        session.end(r.EndKind.DESTROYED, "destroy_process_group()", session.recorder.call_site(4))
        return None
    return session.recorder.groups.forget(group)


def after_destroy(info: Any) -> None:
    session = _session
    if session is None or info is None:
        return
    session.sink.put(r.GroupEvent(session.identity.rank, r.GroupEventKind.DESTROYED, info, time.time()))


def step(n: int | None = None) -> None:
    session = _session
    if session is None:
        return
    rec = session.recorder
    rec.step = rec.step + 1 if n is None else int(n)
    session.sink.put(r.StepEvent(rec.rank, rec.step, time.time()))


# ---- the end of a rank ------------------------------------------------------------------

_hooks_installed = False


def _install_end_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous_hook = sys.excepthook

    def excepthook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        session = _session
        if session is not None:
            try:
                site = session.recorder.user_frame_of(tb)
                session.end(r.EndKind.EXCEPTION, f"{tp.__name__}: {value}"[:2000], site, 1)
            except Exception:
                pass
        previous_hook(tp, value, tb)

    sys.excepthook = excepthook
    atexit.register(_at_exit)
    # Deliberately no SIGTERM/SIGHUP handler: a Python handler runs only when the main thread
    # returns to the interpreter, so a rank blocked inside a collective would no longer die when
    # its launcher terminates it. Deaths by signal are seen from outside, by the node agent.


def _at_exit() -> None:
    session = _session
    if session is not None:
        session.end(r.EndKind.CLEAN_EXIT, "interpreter exit", exit_code=0)
        session.sender.stop()


def _install_step_hook() -> None:
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: step())
    except Exception as exc:
        log.debug("hangwatch: no optimizer step hook: %s", exc)


def _agent_socket(addr: str) -> str | None:
    try:
        return config.agent_socket_path(addr)
    except Exception:
        return None


def _after_fork_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) is not a rank: drop everything inherited, and
    close the inherited link first, or the agent would not see the rank's death while the child
    lives (the connection closes when its last descriptor does)."""
    global _session
    inherited = _session
    _session = None
    capture.set_session(None)
    if inherited is not None and inherited.link is not None:
        try:
            inherited.link.close()
        except Exception:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
