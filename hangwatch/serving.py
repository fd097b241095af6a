"""Serving the ``Coordinator`` gRPC service: the coordinator does, and so does a relaying agent.

Registers a servicer like the generated helper does, but answers bytes that do not decode with
INVALID_ARGUMENT (and a reason) instead of gRPC's generic INTERNAL, before any handler runs.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from concurrent.futures import Executor
from typing import Any

import grpc

from hangwatch.protos import hangwatch_pb2 as pb


class _Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


def _safe_deserializer(message_class: Any) -> Any:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except Exception as exc:  # DecodeError, and anything else a hostile payload can provoke
            return _Malformed(f"{type(exc).__name__}: {exc}")

    return parse


TOKEN_REFUSED = "wrong or missing hangwatch token (set HANGWATCH_TOKEN to the coordinator's --token)"


def token_ok(expected: str | None, presented: str) -> bool:
    """Whether ``presented`` is the shared token (always, when none is configured); constant time."""
    return not expected or hmac.compare_digest(presented.encode(), expected.encode())


class Refused(Exception):
    """Raised by a handler to end its call with ``code`` and a clear message (and no reply);
    works the same whether the handler runs on a thread-pool server or an asyncio one."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _guarded(method: Any) -> Any:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message ({request.error})")
        try:
            return method(request, context)
        except Refused as refused:
            context.abort(refused.code, refused.message)

    return handler


def _guarded_async(method: Any, executor: Executor | None) -> Any:
    async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message ({request.error})")
        try:
            if executor is None:
                return method(request, context)  # on the event loop itself: short, CPU-only work
            return await asyncio.get_running_loop().run_in_executor(executor, method, request, context)
        except Refused as refused:
            await context.abort(refused.code, refused.message)

    return handler


def add_service(
    servicer: Any,
    server: grpc.Server | grpc.aio.Server,
    *,
    blocking: frozenset[str] = frozenset(),
    executor: Executor | None = None,
) -> None:
    """Serve every method of the ``Coordinator`` service from ``servicer``'s same-named methods
    (plain functions that raise :class:`Refused` to refuse). On an asyncio server, the methods
    named in ``blocking`` (those that wait, or build large replies) run in ``executor``; the
    others run on the event loop."""
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    handlers = {}
    is_aio = isinstance(server, grpc.aio.Server)
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        function = getattr(servicer, method.name)
        if is_aio:
            behaviour = _guarded_async(function, executor if method.name in blocking else None)
        else:
            behaviour = _guarded(function)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=_safe_deserializer(request_class),
            response_serializer=lambda message: message.SerializeToString(),
        )
    # registered methods are matched in gRPC's core, not by a Python lookup per call
    registrar: Any = server  # (grpcio's type stubs do not know this method yet)
    registrar.add_registered_method_handlers(service.full_name, handlers)


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps a server to this machine (else it needs a token)."""
    host = host.strip("[]")  # "[::1]", as an address is written with a port
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC and URLs take it: an IPv6 address in brackets (``[::1]:29600``)."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"
