"""The CLI's connection to a coordinator: one call, a deadline, and a one-line error."""

from __future__ import annotations

import json
import os
from typing import Any

import grpc

from hangwatch import config, tls
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.protos import hangwatch_pb2_grpc as pb_grpc


class CoordinatorUnreachable(RuntimeError):
    """The coordinator could not answer; the message is one line for the user."""


def query(addr: str, method: str, *, token: str | None = None, timeout: float = 5.0, **fields: Any) -> Any:
    """Call ``method`` (GetStatus, ListIncidents, GetIncident, DumpStacks) and decode its JSON."""
    return call(addr, method, pb.QueryRequest(token=token or "", **fields), timeout)


def import_dumps(addr: str, payload: bytes, *, token: str | None = None, job: str = "", timeout: float = 120.0) -> Any:
    """Send a folder of Flight Recorder dumps (``packed.pack``) to be analysed and joined to a job."""
    return call(addr, "ImportDumps", pb.ImportRequest(token=token or "", job=job, dumps=payload), timeout)


def call(addr: str, method: str, request: Any, timeout: float) -> Any:
    """One unary call whose reply is a ``JsonReply``; its JSON decoded."""
    try:
        # status of thousands of ranks is megabytes: lift gRPC's 4 MB default for replies
        channel = tls.channel(
            addr,
            [("grpc.max_receive_message_length", 512 * 1024 * 1024), ("grpc.max_send_message_length", 16 << 20)],
        )
    except tls.TLSConfigError as exc:
        raise CoordinatorUnreachable(str(exc)) from None
    with channel:
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        try:
            reply = getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CoordinatorUnreachable(_unreachable(addr, code, str(details))) from None
            raise CoordinatorUnreachable(f"coordinator at {addr} refused: {details}") from None
    return json.loads(reply.json)


def _unreachable(addr: str, code: grpc.StatusCode, details: str) -> str:
    """One line that tells nobody listening from a TLS mismatch (a plaintext client at a TLS
    coordinator, a CA that did not sign its certificate)."""
    lowered = details.lower()
    nobody = "connection refused" in lowered or "no route" in lowered or code is grpc.StatusCode.DEADLINE_EXCEEDED
    if nobody or not details:
        return (
            f"cannot reach the hangwatch coordinator at {addr} ({code.name.lower()}); is it running? "
            f"(--addr or {config.ENV_ADDR})"
        )
    if os.environ.get(config.ENV_TLS_CA):
        return (
            f"TLS with the coordinator at {addr} failed ({details}): check that {config.ENV_TLS_CA} holds the CA "
            f"that signed its certificate, and {config.ENV_TLS_CLIENT_CERT}/{config.ENV_TLS_CLIENT_KEY} if it "
            "requires client certificates"
        )
    return (
        f"the coordinator at {addr} did not answer plaintext gRPC ({details}): if it serves TLS, set "
        f"{config.ENV_TLS_CA} to the CA that signed its certificate"
    )
