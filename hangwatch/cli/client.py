"""The CLI's connection to a coordinator: one call, a deadline, and a one-line error."""

from __future__ import annotations

import json
from typing import Any

import grpc

from hangwatch import tls
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc


class CoordinatorUnreachable(RuntimeError):
    """The coordinator could not answer; the message is one line for the user."""


def query(addr: str, method: str, *, token: str | None = None, timeout: float = 5.0, **fields: Any) -> Any:
    """Call ``method`` (GetStatus, ListIncidents, GetIncident, DumpStacks) and decode its JSON."""
    request = pb.QueryRequest(token=token or "", **fields)
    # status of thousands of ranks is megabytes: lift gRPC's 4 MB default for replies
    with tls.channel(addr, [("grpc.max_receive_message_length", 512 * 1024 * 1024)]) as channel:
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        try:
            reply = getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CoordinatorUnreachable(
                    f"cannot reach the hangwatch coordinator at {addr} ({code.name.lower()}); "
                    "is it running? (--addr or HANGWATCH_ADDR)"
                ) from None
            raise CoordinatorUnreachable(f"coordinator at {addr} refused: {details}") from None
    return json.loads(reply.json)
