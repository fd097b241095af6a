"""The coordinator's side of the node agents: who watches which host, and stack/abort requests.

The embedded agent (single node) is called in-process on a worker pool. Remote agents long-poll
``AgentPoll``: commands wait in their queue and results come back with a later poll. A request
for a host no agent serves is answered at once, with a note saying so.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hangwatch import records as r

log = logging.getLogger("hangwatch.coordinator")

StacksCallback = Callable[[dict[int, r.StackDump]], None]
AbortCallback = Callable[[list[int], dict[int, str]], None]
DUMP_TIMEOUT_S = 10.0
#: A remote agent that has not polled for this long is considered gone (it polls every ~2 s).
AGENT_SILENT_S = 6.0
#: A dump command not answered within this long is answered with a note instead.
COMMAND_EXPIRY_S = DUMP_TIMEOUT_S + 10.0


@dataclass
class RemoteAgent:
    agent_id: str
    host: str
    pid: int
    registered_at: float
    last_poll: float
    can_ptrace: bool = True
    ptrace_note: str = ""
    commands: queue.Queue[Any] = field(default_factory=queue.Queue)
    waiting: dict[int, tuple[StacksCallback, list[r.Target]]] = field(default_factory=dict)
    aborting: dict[int, AbortCallback] = field(default_factory=dict)  # abort commands sent, by id


class AgentHub:
    def __init__(self, embedded: Any | None = None, embedded_host: str | None = None) -> None:
        self.embedded = embedded  # a hangwatch.agent.core.NodeAgentCore, or None
        self.embedded_host = embedded_host or socket.gethostname()
        self.remote: dict[str, RemoteAgent] = {}
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hangwatch-stacks")
        self._ids = itertools.count(1)

    # ---- remote agents --------------------------------------------------------------------

    def register_remote(self, host: str, pid: int, can_ptrace: bool, note: str) -> RemoteAgent:
        now = time.time()
        with self.lock:
            for agent in list(self.remote.values()):
                if agent.host == host:
                    del self.remote[agent.agent_id]
            agent = RemoteAgent(uuid.uuid4().hex[:12], host, pid, now, now, can_ptrace, note)
            self.remote[agent.agent_id] = agent
        log.info("agent %s registered for host %s", agent.agent_id, host)
        return agent

    def agent_for(self, host: str) -> RemoteAgent | None:
        with self.lock:
            for agent in self.remote.values():
                if agent.host == host:
                    return agent
        return None

    def complete(self, agent: RemoteAgent, command_id: int, dumps: dict[int, r.StackDump]) -> None:
        entry = agent.waiting.pop(command_id, None)
        if entry is not None:
            entry[0](dumps)

    def _expire(self, agent: RemoteAgent, command_id: int) -> None:
        entry = agent.waiting.pop(command_id, None)
        if entry is not None:
            callback, targets = entry
            note = f"the hangwatch agent on host {agent.host} did not answer within {COMMAND_EXPIRY_S:.0f} s"
            callback({t.rank: r.StackDump(t.pid, time.time(), error=note) for t in targets})

    def hosts(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if self.embedded is not None:
            out[self.embedded_host] = {"kind": "embedded", "connected": True}
        now = time.time()
        with self.lock:
            for agent in self.remote.values():
                out[agent.host] = {
                    "kind": "remote",
                    "agent_id": agent.agent_id,
                    "connected": now - agent.last_poll < AGENT_SILENT_S,
                    "last_poll_s": round(now - agent.last_poll, 1),
                    "can_ptrace": agent.can_ptrace,
                    "ptrace_note": agent.ptrace_note,
                }
        return out

    # ---- requests -------------------------------------------------------------------------

    def request_stacks(
        self, targets: list[r.Target], hosts: dict[int, str], native: bool, callback: StacksCallback
    ) -> None:
        """Dump ``targets`` (rank -> host in ``hosts``); ``callback`` receives the dumps per host."""
        by_host: dict[str, list[r.Target]] = {}
        for target in targets:
            by_host.setdefault(hosts.get(target.rank, self.embedded_host), []).append(target)
        for host, host_targets in by_host.items():
            agent = self.agent_for(host)
            silent = time.time() - agent.last_poll if agent is not None else 0.0
            if agent is not None and silent > AGENT_SILENT_S:
                note = (
                    f"the hangwatch agent on host {host} stopped polling {silent:.0f} s ago (killed or "
                    "unreachable?); restart `hangwatch agent` there"
                )
                callback({t.rank: r.StackDump(t.pid, time.time(), error=note) for t in host_targets})
            elif agent is not None:
                command_id = next(self._ids)
                agent.waiting[command_id] = (callback, host_targets)
                agent.commands.put(("dump", command_id, host_targets, native))
                expiry = threading.Timer(COMMAND_EXPIRY_S, self._expire, (agent, command_id))
                expiry.daemon = True
                expiry.start()
            elif self.embedded is not None and host == self.embedded_host:
                embedded = self.embedded
                self.pool.submit(self._run_embedded, embedded, host_targets, native, callback)
            else:
                note = f"no hangwatch agent is connected on host {host}: run `hangwatch agent` there"
                callback({t.rank: r.StackDump(t.pid, time.time(), error=note) for t in host_targets})

    @staticmethod
    def _run_embedded(embedded: Any, targets: list[r.Target], native: bool, callback: StacksCallback) -> None:
        try:
            dumps = embedded.dump(targets, native=native, timeout_s=DUMP_TIMEOUT_S)
        except Exception as exc:
            log.exception("embedded agent failed to dump stacks")
            dumps = {t.rank: r.StackDump(t.pid, time.time(), error=f"agent error: {exc}") for t in targets}
        callback(dumps)

    def dump_now(
        self,
        targets: list[r.Target],
        hosts: dict[int, str],
        native: bool,
        timeout_s: float = DUMP_TIMEOUT_S + 5.0,
    ) -> dict[int, r.StackDump]:
        """Blocking variant for ``hangwatch stacks``."""
        done = threading.Event()
        results: dict[int, r.StackDump] = {}
        pending = {t.rank for t in targets}
        lock = threading.Lock()

        def collect(dumps: dict[int, r.StackDump]) -> None:
            with lock:
                results.update(dumps)
                pending.difference_update(dumps)
                if not pending:
                    done.set()

        if targets:
            self.request_stacks(targets, hosts, native, collect)
            done.wait(timeout_s)
        for t in targets:
            results.setdefault(t.rank, r.StackDump(t.pid, time.time(), error="timed out waiting for the agent"))
        return results

    def abort(
        self,
        targets: list[r.Target],
        hosts: dict[int, str],
        grace_s: float = 10.0,
        on_result: AbortCallback | None = None,
    ) -> None:
        """Abort ``targets`` through their hosts' agents; ``on_result(signalled pids, refused:
        rank -> why)`` is called once per host with what its agent did."""
        by_host: dict[str, list[r.Target]] = {}
        for target in targets:
            by_host.setdefault(hosts.get(target.rank, self.embedded_host), []).append(target)
        report = on_result or (lambda signalled, refused: None)
        for host, host_targets in by_host.items():
            agent = self.agent_for(host)
            if agent is not None:
                command_id = next(self._ids)
                agent.aborting[command_id] = report
                agent.commands.put(("abort", command_id, host_targets, grace_s))
            elif self.embedded is not None and host == self.embedded_host:
                self.pool.submit(self._abort_embedded, self.embedded, host_targets, grace_s, report)
            else:
                log.error("cannot abort ranks on %s: no agent there", host)
                report([], {t.rank: f"no hangwatch agent is connected on host {host}" for t in host_targets})

    @staticmethod
    def _abort_embedded(embedded: Any, targets: list[r.Target], grace_s: float, report: AbortCallback) -> None:
        try:
            report(*embedded.abort_outcome(targets, grace_s))
        except Exception:
            log.exception("the embedded agent's abort failed")

    def aborted(self, agent: RemoteAgent, command_id: int, signalled: list[int], refused: dict[int, str]) -> None:
        """A remote agent's answer to an abort command."""
        callback = agent.aborting.pop(command_id, None)
        if callback is not None:
            callback(signalled, refused)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
