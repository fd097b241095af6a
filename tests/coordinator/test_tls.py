"""TLS with a CA generated for the test (openssl): server-only, and with client certificates."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from hangwatch import config
from hangwatch import records as r
from hangwatch.client.transport import Transport
from hangwatch.coordinator.daemon import Coordinator

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=hangwatch-test-ca",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            cwd=d,
        )
    return d


def _ident() -> r.RankIdentity:
    return r.RankIdentity("job", 0, 1, "h", 1, session=uuid.uuid4().hex)


def test_tls_server(
    pki: Path, coordinator_factory: Callable[..., Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = coordinator_factory(embedded_agent=False, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    # a plaintext client cannot talk to it
    with pytest.raises(grpc.RpcError):
        Transport(f"127.0.0.1:{c.port}", None, timeout_s=2).register(_ident())
    monkeypatch.setenv(config.ENV_TLS_CA, str(pki / "ca.pem"))
    Transport(f"127.0.0.1:{c.port}", None).register(_ident())
    assert list(c.job.ranks) == [0]


def test_tls_client_certificates_required(
    pki: Path, coordinator_factory: Callable[..., Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = coordinator_factory(
        embedded_agent=False,
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem"),
    )
    monkeypatch.setenv(config.ENV_TLS_CA, str(pki / "ca.pem"))
    with pytest.raises(grpc.RpcError):
        Transport(f"127.0.0.1:{c.port}", None, timeout_s=2).register(_ident())
    monkeypatch.setenv(config.ENV_TLS_CLIENT_CERT, str(pki / "client.pem"))
    monkeypatch.setenv(config.ENV_TLS_CLIENT_KEY, str(pki / "client.key"))
    Transport(f"127.0.0.1:{c.port}", None).register(_ident())
    assert list(c.job.ranks) == [0]


def test_the_cli_tells_a_tls_mismatch_from_a_coordinator_that_is_down(
    pki: Path, coordinator_factory: Callable[..., Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hangwatch.cli.client import CoordinatorUnreachable, query

    c = coordinator_factory(embedded_agent=False, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    addr = f"127.0.0.1:{c.port}"
    with pytest.raises(CoordinatorUnreachable, match=r"did not answer plaintext gRPC.*HANGWATCH_TLS_CA"):
        query(addr, "GetStatus", timeout=3)
    monkeypatch.setenv(config.ENV_TLS_CA, str(pki / "client.pem"))  # a certificate, not the CA that signed it
    with pytest.raises(CoordinatorUnreachable, match=r"TLS with the coordinator .* failed"):
        query(addr, "GetStatus", timeout=3)
    monkeypatch.setenv(config.ENV_TLS_CA, str(pki / "missing.pem"))
    with pytest.raises(CoordinatorUnreachable, match=r"cannot read CA bundle .*missing\.pem"):
        query(addr, "GetStatus", timeout=3)
    monkeypatch.delenv(config.ENV_TLS_CA)
    c.stop()
    with pytest.raises(CoordinatorUnreachable, match="is it running"):
        query(addr, "GetStatus", timeout=3)
