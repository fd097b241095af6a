"""Serving the ``Coordinator`` gRPC service: the coordinator does, and so does a relaying agent.

Registers a servicer like the generated helper does, but answers bytes that do not decode with
INVALID_ARGUMENT (and a reason) instead of gRPC's generic INTERNAL, before any handler runs.
"""

from __future__ import annotations

import ipaddress
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


def _guarded(method: Any) -> Any:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message ({request.error})")
        return method(request, context)

    return handler


def add_service(servicer: Any, server: grpc.Server) -> None:
    """Serve every method of the ``Coordinator`` service from ``servicer``'s same-named methods."""
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _guarded(getattr(servicer, method.name)),
            request_deserializer=_safe_deserializer(request_class),
            response_serializer=lambda message: message.SerializeToString(),
        )
    # registered methods are matched in gRPC's core, not by a Python lookup per call
    server.add_registered_method_handlers(service.full_name, handlers)


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps a server to this machine (else it needs a token)."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
