"""The node agent's end of its ranks' links: a Unix socket that ranks connect to once.

For each rank it keeps what the kernel proved (pid, uid, gid of the connected process), what the
rank said (its hello), the reader of the ring it handed over, and when its connection closed (the
moment the process was gone). Nothing here believes a pid a client sends: the pid that counts
is the socket's peer.

One thread owns the listening socket and every connection (a selector loop, 0.2 s ticks); the
rest of the agent reads :meth:`RingServer.links` and polls the readers. The socket file is
created with mode ``0600`` inside the directory given (which the caller creates ``0700``): only
the agent's own user (and root) can connect, the same rule the ring itself follows.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hangwatch.agent.identity import Proofs, proven_start_time
from hangwatch.agent.joining import JoiningLink
from hangwatch.agent.procinfo import exit_when_gone, memory_events_path, oom_kills
from hangwatch.link import ACK, ENDING, FAREWELL, STARTING, HelloReader, LinkError, Peer, peer_of
from hangwatch.records import link_tag
from hangwatch.ring import RingError, RingReader

log = logging.getLogger(__name__)

#: A connection that has not said its whole hello within this long, all told, is dropped. Long
#: enough for a rank starting on a loaded node; the pending bound keeps slow talkers harmless.
HELLO_TIMEOUT_S = 5.0
#: Connections saying their hello at once; one beyond this is refused at once.
MAX_PENDING = 64
#: Links kept at most (live and recently closed); a new one beyond this is refused.
MAX_LINKS = 4096
#: The largest last Flight Recorder dump a rank may hand over: as large as its worker server may
#: answer (``frquery.MAX_ANSWER_BYTES``); a larger one is ignored, and the worker server
#: is asked instead.
LAST_READ_MAX = 16 << 20
#: The seals it must carry (``hangwatch.client.workerserver.SEALS``): nothing can change it.
LAST_READ_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


@dataclass
class RankLink:
    """One rank's link: proven identity, claimed identity, its ring, and its life."""

    peer: Peer
    hello: dict[str, Any]
    reader: RingReader
    ring_fd: int
    connected_at: float
    closed_at: float | None = None  # when the connection closed: the process is gone
    sock: socket.socket | None = field(default=None, repr=False)
    #: its cgroup v2 ``memory.events`` and that file's ``oom_kill`` count when it linked (None:
    #: not readable, and then nothing is said about the OOM killer)
    memory_events: str | None = None
    oom_kills: int | None = None
    #: how it ended, read the moment its link closed (before its parent reaps it), where known
    exit_code: int | None = None
    exit_signal: int | None = None
    oom_killed: bool = False
    #: when the rank said it is ending (its last records are in its ring; it waits, briefly,
    #: for the agent's farewell before it exits)
    ending_at: float | None = None
    #: the memfd of its last Flight Recorder dump, handed over as it said so (None: none came,
    #: or it was taken)
    last_read_fd: int | None = None

    @property
    def alive(self) -> bool:
        return self.closed_at is None

    def take_last_read(self) -> bytes | None:
        """The rank's last Flight Recorder dump, handed over as it said it is ending (None: none
        came, it was taken, or it is over ``LAST_READ_MAX``); the descriptor is closed."""
        fd, self.last_read_fd = self.last_read_fd, None
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size
            # only a sealed memfd: a pipe, socket or device is no dump, and any other file (one
            # on a FUSE or hung network mount) could block the shipper's thread, every rank's
            if not stat.S_ISREG(st.st_mode) or not _sealed(fd):
                log.warning("pid %d handed over a last Flight Recorder dump that is not a sealed memfd", self.peer.pid)
                return None
            if size > LAST_READ_MAX:
                log.warning(
                    "pid %d's last Flight Recorder dump of %d bytes ignored (over %d)",
                    self.peer.pid,
                    size,
                    LAST_READ_MAX,
                )
                return None
            return os.pread(fd, size, 0)
        except OSError:
            return None
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        self.reader.close()
        with contextlib.suppress(OSError):
            os.close(self.ring_fd)
        if self.last_read_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.last_read_fd)
            self.last_read_fd = None
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None


def _sealed(fd: int) -> bool:
    """``fd`` is a memfd sealed against every change (``F_GET_SEALS`` fails on anything else)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & LAST_READ_SEALS == LAST_READ_SEALS
    except OSError:
        return False


@dataclass
class _Pending:
    """A connection saying its hello: who the kernel says it is, what came so far, its deadline."""

    conn: socket.socket
    peer: Peer
    reader: HelloReader
    deadline: float  # monotonic

    def drop(self) -> None:
        self.reader.close()
        with contextlib.suppress(OSError):
            self.conn.close()


#: The selector's longest wait: ``stop`` wakes it sooner (see ``RingServer._wake``).
SELECT_S = 5.0
_WAKE = object()  # the selector's key data of the wake-up socket


class RingServer:
    """Accepts rank links on ``path``; ``on_link`` / ``on_close`` are called on its thread."""

    def __init__(
        self,
        path: str,
        on_link: Callable[[RankLink], None] | None = None,
        on_close: Callable[[RankLink], None] | None = None,
        clock: Callable[[], float] = time.time,
        mode: int = 0o600,
        proofs: Proofs | None = None,
    ) -> None:
        if mode & ~0o666:
            raise ValueError(f"socket mode {mode:o}: only read/write bits (at most 0666)")
        self.path = path
        self.mode = mode
        self._on_link = on_link
        self._on_close = on_close
        self._clock = clock
        self.proofs = proofs  # where each linked process's kernel-proven identity is recorded
        self._lock = threading.Lock()
        #: set when a link is made, says it is ending, or closes: the shipper's loop sleeps until
        #: its next read is due, or until this (``Shipper.run``)
        self.changed = threading.Event()
        self._links: list[RankLink] = []
        self._joining: list[JoiningLink] = []  # processes linked before they are ranks
        self.refused = 0  # connections dropped: no hello, a bad ring, too many links
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        #: written by ``stop``: the selector waits on it, and on nothing else, between links'
        #: events (a timeout to look at ``_stop`` would wake an idle agent for nothing)
        self._wake: tuple[socket.socket, socket.socket] | None = None
        #: open sockets of links forgotten on other threads: the selector thread unregisters and
        #: closes them (closed elsewhere, a socket's number stays registered, and the next link
        #: given that number is refused)
        self._closing: list[socket.socket] = []

    def start(self) -> None:
        """Listen on the socket; an OSError if another live agent serves it already (a stale
        socket file, one nobody listens on, is replaced)."""
        if os.path.exists(self.path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)  # nobody listens: left by an agent that is gone
            else:
                raise OSError(f"{self.path} is served by another agent")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        # 0600: ranks of the agent's own user (or root) only. A wider mode lets other users'
        # ranks link (an agent run by root for every user of a node); each link still proves
        # its pid and uid through the kernel, and the agent reads nothing but what it was handed
        # and the worker server that pid serves.
        os.chmod(self.path, self.mode)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._wake = socket.socketpair()
        self._wake[0].setblocking(False)
        self._thread = threading.Thread(target=self._run, name="hangwatch-rings", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.changed.set()
        if self._wake is not None:
            with contextlib.suppress(OSError):
                self._wake[1].send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._listener is not None:
            self._listener.close()
        if self._wake is not None and (self._thread is None or not self._thread.is_alive()):
            for end in self._wake:
                end.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            for link in self._links:
                link.close()
            self._links.clear()
            for joining in self._joining:
                joining.close()
            self._joining.clear()

    def links(self) -> list[RankLink]:
        with self._lock:
            return list(self._links)

    def joining(self) -> list[JoiningLink]:
        with self._lock:
            return list(self._joining)

    def forget_joining(self, link: JoiningLink) -> None:
        """Drop a starting process's link once the coordinator was told how it ended."""
        with self._lock:
            if link in self._joining:
                self._joining.remove(link)
        link.close()

    def farewell(self, link: RankLink) -> None:
        """Tell a rank that said it is ending that its last records are read: it may go."""
        sock = link.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.send(FAREWELL)

    def forget(self, link: RankLink) -> None:
        """Drop a link: closed once its ring has been read to the end, or refused by the
        coordinator while open (its socket then goes to the selector thread to close)."""
        with self._lock:
            if link in self._links:
                self._links.remove(link)
            sock, link.sock = link.sock, None
            if sock is not None:
                self._closing.append(sock)
        link.close()
        if sock is not None and self._wake is not None:
            with contextlib.suppress(OSError):
                self._wake[1].send(b"x")

    # ---- the selector thread -------------------------------------------------------------

    def _run(self) -> None:
        assert self._listener is not None and self._wake is not None
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        sel.register(self._wake[0], selectors.EVENT_READ, _WAKE)
        pending: dict[socket.socket, _Pending] = {}
        try:
            while not self._stop.is_set():
                # ``stop`` wakes it; the timeout bounds the hellos under way, and a lost wake-up
                timeout = SELECT_S
                if pending:
                    timeout = max(0.0, min(p.deadline for p in pending.values()) - time.monotonic())
                for key, _ in sel.select(timeout=timeout):
                    try:
                        if key.data is None:
                            self._accept(sel, pending)
                        elif key.data is _WAKE:
                            with contextlib.suppress(OSError):
                                self._wake[0].recv(64)
                            self._close_forgotten(sel)
                        elif isinstance(key.data, _Pending):
                            self._hello(sel, pending, key.data)
                        elif isinstance(key.data, JoiningLink):
                            self._joining_said(sel, key.data)
                        else:
                            self._readable(sel, key.data)
                    except Exception:  # one peer's trouble never stops the loop that serves all
                        log.exception("rank link event failed")
                self._expire(sel, pending)
        except Exception:  # the agent must outlive any bug here; say so loudly
            log.exception("rank link loop failed")
        finally:
            for p in pending.values():
                p.drop()
            sel.close()

    def _close_forgotten(self, sel: selectors.BaseSelector) -> None:
        with self._lock:
            closing, self._closing = self._closing, []
        for sock in closing:
            with contextlib.suppress(KeyError, ValueError):  # unregistered already on a read that saw it close
                sel.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending]) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            peer = peer_of(conn)
        except OSError:
            conn.close()
            return
        if len(pending) >= MAX_PENDING:
            log.warning("rank link from pid %d refused: %d others are saying their hello", peer.pid, MAX_PENDING)
            self.refused += 1
            conn.close()
            return
        conn.setblocking(False)
        p = pending[conn] = _Pending(conn, peer, HelloReader(), time.monotonic() + HELLO_TIMEOUT_S)
        sel.register(conn, selectors.EVENT_READ, p)

    def _hello(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending], p: _Pending) -> None:
        """Take what a peer saying its hello sent; link it once the hello is whole."""
        try:
            hello = p.reader.feed(p.conn)
        except LinkError as e:
            self._refuse(sel, pending, p, str(e))
            return
        if hello is None:
            return
        sel.unregister(p.conn)
        del pending[p.conn]
        fds, p.reader.fds = p.reader.fds, []
        starting = hello.get("phase") == STARTING and not fds  # not a rank yet: no ring
        link: RankLink | JoiningLink | None = (
            self._establish_joining(p.conn, p.peer, hello) if starting else self._establish(p.conn, p.peer, hello, fds)
        )
        if link is None:
            self.refused += 1
            p.conn.close()
            return
        sel.register(p.conn, selectors.EVENT_READ, link)
        self.changed.set()
        if self._on_link is not None and isinstance(link, RankLink):
            self._on_link(link)

    def _expire(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending]) -> None:
        now = time.monotonic()
        for p in [p for p in pending.values() if p.deadline <= now]:
            self._refuse(sel, pending, p, f"no whole hello within {HELLO_TIMEOUT_S:g} s")

    def _refuse(
        self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending], p: _Pending, why: str
    ) -> None:
        log.warning("rank link from pid %d refused: %s", p.peer.pid, why)
        self.refused += 1
        sel.unregister(p.conn)
        del pending[p.conn]
        p.drop()

    def _establish_joining(self, conn: socket.socket, peer: Peer, hello: dict[str, Any]) -> JoiningLink | None:
        """A starting process's link: proven like a rank's (its stacks may be dumped), no ring."""
        with self._lock:
            if len(self._links) + len(self._joining) >= MAX_LINKS:
                return None
            link = JoiningLink(peer, hello, self._clock(), sock=conn)
            self._joining.append(link)
        self._prove(peer, hello)
        return link

    def _prove(self, peer: Peer, hello: dict[str, Any]) -> None:
        """Record what the kernel proved of a linked process: its stacks may be dumped, and, a
        rank's, it may be signalled (``agent.identity.Proofs``)."""
        started = proven_start_time(peer.pid)
        session = hello.get("session")
        if self.proofs is not None and started is not None and isinstance(session, str) and session:
            self.proofs.add(peer.pid, peer.uid, started, link_tag(session))

    def _joining_said(self, sel: selectors.BaseSelector, link: JoiningLink) -> None:
        sock = link.sock
        if sock is None:
            return
        try:
            data = sock.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            link.said(data, self._clock())
        else:
            sel.unregister(sock)
            link.closed_at = self._clock()
            link.close()
        self.changed.set()

    def _establish(self, conn: socket.socket, peer: Peer, hello: dict[str, Any], fds: list[int]) -> RankLink | None:
        """The link of a whole hello and its descriptors (the caller's to close on None)."""
        if not fds:
            log.warning("rank link from pid %d refused: no ring descriptor", peer.pid)
            return None
        for extra in fds[1:]:
            os.close(extra)
        try:
            reader = RingReader(fds[0])
        except (RingError, OSError, ValueError) as e:
            log.warning("rank link from pid %d refused: %s", peer.pid, e)
            os.close(fds[0])
            return None
        with self._lock:
            if len(self._links) >= MAX_LINKS:
                reader.close()
                os.close(fds[0])
                return None
            link = RankLink(peer, hello, reader, fds[0], self._clock(), sock=conn)
            self._links.append(link)
        self._prove(peer, hello)
        link.memory_events = memory_events_path(peer.pid)
        link.oom_kills = oom_kills(link.memory_events)
        try:
            conn.send(ACK)
        except OSError:
            pass  # gone already: the selector sees it closed next
        return link

    def _readable(self, sel: selectors.BaseSelector, link: RankLink) -> None:
        sock = link.sock
        if sock is None:
            return
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        for fd in fds:  # a descriptor comes only with ENDING: the rank's last dump
            if ENDING in data and link.ending_at is None:  # set just below: one dump at most
                link.last_read_fd = fd
            else:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if data:
            if ENDING in data and link.ending_at is None:
                link.ending_at = self._clock()
                self.changed.set()  # it waits for its farewell
            return  # nothing else is said on a link
        sel.unregister(sock)
        closed_at = self._clock()
        with contextlib.suppress(OSError):
            sock.close()
        link.sock = None
        self._ended(link)
        link.closed_at = closed_at  # said closed once how it ended is read: the shipper reads both
        self.changed.set()
        if self._on_close is not None:
            self._on_close(link)

    @staticmethod
    def _ended(link: RankLink) -> None:
        """How the process ended, read now: its parent (torchrun polls every 0.1 s) reaps it soon
        and then ``/proc`` no longer says; and whether its cgroup's OOM killer struck meanwhile."""
        link.exit_code, link.exit_signal = exit_when_gone(link.peer.pid)
        now = oom_kills(link.memory_events)
        link.oom_killed = now is not None and link.oom_kills is not None and now > link.oom_kills
