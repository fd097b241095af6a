"""The coordinator's gRPC server: ``grpc.aio`` on an event loop of its own thread.

Why not the thread-pool server: every batch a rank (or a relay) sends takes the coordinator's
lock and runs Python, so ingest cannot use more than one core anyway; spreading it over a pool of
threads only adds hand-offs and GIL contention. Here ingest handlers run on the loop thread
one after another, and the handlers that wait (agent long polls, stack dumps) or build large
replies run in a separate pool, so a hundred agents long-polling cannot starve ingest.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from hangwatch.serving import add_service

SERVICE_NAME = "hangwatch.v1.Coordinator"
START_TIMEOUT_S = 30.0
#: How often the loop's lateness is probed.
PROBE_S = 0.25


class BindError(RuntimeError):
    """The server could not listen where it was asked to."""


class RpcServer:
    def __init__(
        self,
        servicer: Any,
        bind: str,
        *,
        credentials: grpc.ServerCredentials | None = None,
        blocking: frozenset[str] = frozenset(),
        blocking_workers: int = 64,
        options: list[tuple[str, Any]] | None = None,
        on_late: Callable[[float], None] | None = None,
    ) -> None:
        self.servicer = servicer
        self.bind = bind
        self.credentials = credentials
        self.blocking = blocking
        self.options = options or []
        self.on_late = on_late  # how late the loop came to each probe (``diagnosis.lag``)
        self._probe: asyncio.Future[None] | None = None
        self.executor = ThreadPoolExecutor(max_workers=blocking_workers, thread_name_prefix="hangwatch-rpc")
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None
        self._thread = threading.Thread(target=self._run, name="hangwatch-grpc", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> int:
        """Listen and serve; returns the port (``bind`` may ask for port 0)."""
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise BindError(f"gRPC server on {self.bind} did not start within {START_TIMEOUT_S:.0f} s")
        if self._error is not None:
            raise self._error
        return self.port

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # reported to start()
            self._error = exc if isinstance(exc, BindError) else BindError(f"cannot serve on {self.bind}: {exc}")
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start(self) -> None:
        server = grpc.aio.server(options=self.options)
        add_service(self.servicer, server, blocking=self.blocking, executor=self.executor)
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            if self.credentials is not None:
                port = server.add_secure_port(self.bind, self.credentials)
            else:
                port = server.add_insecure_port(self.bind)
        except RuntimeError as exc:  # recent grpcio raises where older ones returned 0
            raise BindError(f"cannot listen on {self.bind} (in use?)") from exc
        if port == 0:
            raise BindError(f"cannot listen on {self.bind} (in use?)")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.port = port
        if self.on_late is not None:
            self._probe = asyncio.ensure_future(self._probe_loop())

    async def _probe_loop(self) -> None:
        """How late the loop comes to a timer: the ingest handlers queued ahead of it."""
        assert self.on_late is not None
        while True:
            asked = self._loop.time()
            await asyncio.sleep(PROBE_S)
            self.on_late(self._loop.time() - asked - PROBE_S)

    def stop(self, grace: float) -> None:
        """Refuse new calls, let calls under way finish for up to ``grace`` seconds, then stop."""
        if self._server is None or not self._thread.is_alive():
            self.executor.shutdown(wait=False, cancel_futures=True)
            return

        async def shutdown() -> None:
            assert self._server is not None and self._health is not None
            if self._probe is not None:
                self._probe.cancel()
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(grace + 5)
        except Exception:
            pass
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
