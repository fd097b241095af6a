"""What the node agent hands its ranks' records to, and the identity it registers each with.

``Intake`` is the coordinator's side: in the coordinator's embedded agent it is the coordinator
itself (``DirectIntake``, typed records without the wire); a remote agent passes a gRPC client
of it (``ManyIntake``, a tick's batches in one call). ``tell_phases`` tells it where the
processes linked before they join stand."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from hangwatch import records as r
from hangwatch.agent.joining import JoiningLink
from hangwatch.agent.procinfo import ProcessInspector
from hangwatch.agent.rings import RankLink, RingServer
from hangwatch.protos import hangwatch_pb2 as pb

log = logging.getLogger("hangwatch.agent")


class Intake(Protocol):
    """What the shipper needs of the coordinator."""

    def accept_registration(self, identity: r.RankIdentity, via: str = "direct") -> pb.RegisterReply: ...

    def accept_report(self, request: pb.ReportBatch, relay: str = "") -> pb.ReportReply: ...

    def apply_process_statuses(self, host: str, statuses: list[r.ProcessStatus]) -> None: ...


class DirectIntake(Intake, Protocol):
    """A coordinator in this process (the embedded agent's): it takes records already typed,
    without the wire in between (``RingEncoder.decode``), with ``header``'s batch header."""

    def accept_events(self, header: pb.ReportBatch, events: list[r.RankEvent]) -> int | None: ...

    def record_cost(self, call: r.CallRecord) -> int: ...

    #: whether its job state takes runs of alike calls (``records.CallRun``)
    takes_runs: bool


class ManyIntake(Intake, Protocol):
    """A coordinator reached over the network (a remote agent's): it takes a tick's batches of
    all the node's ranks in one call, a reply for each, in order (``outbox``)."""

    def accept_reports(self, requests: list[pb.ReportBatch]) -> list[pb.ReportReply]: ...


def identity_of(link: RankLink | JoiningLink, host: str, inspector: ProcessInspector) -> r.RankIdentity:
    """The rank's identity: pid from the kernel, the rest from its hello (checked for type)."""
    hello = link.hello

    def text(key: str) -> str:
        value = hello.get(key, "")
        return value if isinstance(value, str) else str(value)

    def number(key: str, default: int) -> int:
        value = hello.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    status = inspector.status(link.peer.pid)
    return r.RankIdentity(
        job_id=text("job_id"),
        rank=number("rank", -1),
        world_size=number("world_size", 0),
        host=host,
        pid=link.peer.pid,
        local_rank=number("local_rank", -1),
        start_time=status.start_time,
        session=text("session"),
        backend=text("backend"),
        torch_version=text("torch_version"),
        hook_version=text("hook_version"),
        launch=text("launch")[:256],
        attempt=number("attempt", 0),
    )


def tell_phases(server: RingServer, intake: Intake, host: str, inspector: ProcessInspector) -> None:
    """Tell the coordinator where each process linked before it is a rank stands, once per
    change (``JoiningLink.phase``); one that joined is told by its rank's registration."""
    for link in server.joining():
        phase = link.phase
        if phase != link.told:
            if phase:
                identity = dataclasses.replace(identity_of(link, host, inspector), phase=phase)
                try:
                    intake.accept_registration(identity, via="agent")
                except ValueError as e:  # not a rank of any job it could be: said once
                    log.info("starting process pid %d refused by the coordinator: %s", link.peer.pid, e)
                except Exception as e:  # the coordinator is unreachable: told next tick
                    log.debug("cannot tell pid %d's phase: %s", link.peer.pid, e)
                    continue
            link.told = phase
        if link.closed_at is not None:  # unregistered from the selector by its thread
            server.forget_joining(link)
