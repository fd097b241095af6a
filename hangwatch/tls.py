"""Channels and server credentials, plaintext or TLS, from the documented environment variables.

Clients (ranks, agents, the CLI) use TLS when ``HANGWATCH_TLS_CA`` names the CA that signed the
coordinator's certificate, and present ``HANGWATCH_TLS_CLIENT_CERT``/``_KEY`` when set. The
coordinator serves TLS with ``--tls-cert``/``--tls-key`` and requires client certificates signed
by ``--tls-client-ca`` when given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import grpc

from hangwatch import config

ChannelOptions = Sequence[tuple[str, int | str]]


class TLSConfigError(ValueError):
    """A TLS file is missing or unreadable."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def channel(addr: str, options: ChannelOptions = ()) -> grpc.Channel:
    """A channel to the coordinator at ``addr``: TLS if ``HANGWATCH_TLS_CA`` is set."""
    ca = os.environ.get(config.ENV_TLS_CA)
    if not ca:
        return grpc.insecure_channel(addr, options=list(options))
    cert = os.environ.get(config.ENV_TLS_CLIENT_CERT)
    key = os.environ.get(config.ENV_TLS_CLIENT_KEY)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA bundle"),
        private_key=_read(key, "client key") if key else None,
        certificate_chain=_read(cert, "client certificate") if cert else None,
    )
    return grpc.secure_channel(addr, credentials, options=list(options))


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(_read(key, "server key"), _read(cert, "server certificate"))],
        root_certificates=_read(client_ca, "client CA bundle") if client_ca else None,
        require_client_auth=bool(client_ca),
    )
