"""What the node agent hands its ranks' records to, and the identity it registers each with.

``Intake`` is the coordinator's side: in the coordinator's embedded agent it is the coordinator
itself (``DirectIntake``, typed records without the wire); a remote agent passes a gRPC client
of it."""

from __future__ import annotations

from typing import Protocol

from hangwatch import records as r
from hangwatch.agent.joining import JoiningLink
from hangwatch.agent.procinfo import ProcessInspector
from hangwatch.agent.rings import RankLink
from hangwatch.protos import hangwatch_pb2 as pb


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
