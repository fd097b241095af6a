"""The rank's side of the wire: gRPC calls with deadlines, and nothing else.

The sender thread owns the only instance; the channel is created lazily on that thread (never
at import, never before a fork) and closed on failure so that a restarted coordinator is found.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from hangwatch import records as r
from hangwatch import tls, wire
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc
from hangwatch.ring import Batch
from hangwatch.ringwire import RingEncoder

#: Keepalive settings aligned with the coordinator's (server permits pings every 10 s).
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


class Transport:
    def __init__(
        self, addr: str, token: str | None, timeout_s: float = 2.0, options: tls.ChannelOptions = CHANNEL_OPTIONS
    ) -> None:
        self.addr = addr
        self.options = options
        self.token = token or ""
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CoordinatorStub | None = None
        self.encoder = RingEncoder()
        #: what the sender slowed down to stay within its CPU budget (``sender.ShipBudget``)
        self.budget_note = ""

    def _get_stub(self) -> pb_grpc.CoordinatorStub:
        if self._stub is None:
            self._channel = tls.channel(self.addr, self.options)
            self._stub = pb_grpc.CoordinatorStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    def close(self) -> None:
        if self._channel is not None:
            try:
                self._channel.close()
            except Exception:
                pass
        self._channel = None
        self._stub = None

    def register(self, identity: r.RankIdentity) -> pb.RegisterReply:
        req = pb.RegisterRequest(token=self.token)
        wire.identity_to_pb(identity, req.identity)
        self.encoder.reset()  # whatever the outcome, the coordinator's table for us starts empty
        reply: pb.RegisterReply = self._get_stub().Register(req, timeout=self.timeout_s)
        # calls the coordinator holds already (an agent shipped this ring before): not again
        self.encoder.skip_through = max(self.encoder.skip_through, reply.last_call_id)
        self.encoder.send_runs = reply.takes_runs  # runs of alike calls in one column entry
        return reply

    def report(
        self,
        identity: r.RankIdentity,
        batch_seq: int,
        events: Sequence[r.RankEvent],
        queued: int,
        dropped: int,
        where: str = "",
        where_user: str = "",
        urgent: bool = False,
        ring: Batch | None = None,
        stack: Sequence[str] = (),
    ) -> pb.ReportReply:
        batch = self.build_report(identity, batch_seq, events, queued, dropped, where, where_user, ring)
        batch.urgent = urgent
        batch.where_stack.extend(stack)
        reply: pb.ReportReply = self._get_stub().Report(batch, timeout=self.timeout_s)
        return reply

    def build_report(
        self,
        identity: r.RankIdentity,
        batch_seq: int,
        events: Sequence[r.RankEvent],
        queued: int,
        dropped: int,
        where: str = "",
        where_user: str = "",
        ring: Batch | None = None,
    ) -> pb.ReportBatch:
        """The batch ``report`` sends: ``events`` (rare typed events, e.g. group announcements)
        as whole events, then the records read from the rank's ring (their new call signatures
        count as sent from here on)."""
        batch = pb.ReportBatch(
            token=self.token,
            job_id=identity.job_id,
            rank=identity.rank,
            session=identity.session,
            batch_seq=batch_seq,
            sent_time=time.time(),
            mono_time=time.monotonic(),
            queued=queued,
            dropped=dropped,
            where=where,
            where_user=where_user,
            budget_note=self.budget_note,
        )
        for event in events:
            wire.event_to_pb(event, batch.events.add())
        if ring is not None:
            self.encoder.encode(ring, batch)
        return batch
