"""The webhook's bodies: a new incident, then the aftermath that completes it (one story per root
cause). ``WebhookAlerter._post`` is the seam (the HTTP round trip itself is proven in
``test_service.test_metrics_and_webhook``)."""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from typing import Any

import pytest

from hangwatch.coordinator.alerts import WebhookAlerter
from hangwatch.diagnosis.incidents import Incident, IncidentKind
from hangwatch.testing import wait_for


def test_an_aftermath_is_posted_as_an_update_of_its_incident() -> None:
    posted: list[dict[str, Any]] = []
    done = threading.Event()
    alerter = WebhookAlerter("http://127.0.0.1:9/unused")

    def post(body: dict[str, Any]) -> None:
        posted.append(body)
        if len(posted) == 2:
            done.set()

    alerter._post = post  # type: ignore[method-assign]
    inc = Incident(
        "inc-0001", "job", IncidentKind.SHAPE_MISMATCH, "run/mismatch:0:3", [0], [1], "all_reduce", "0", 3, 0,
        "rank 0 calls all_reduce with [10], rank 1 with [20]", "fix the shapes", 1.0, 2.0,
    )  # fmt: skip
    alerter(inc)
    inc.details["aftermath"] = {"summary": "rank 0 then died: SIGABRT", "ranks": [0]}
    alerter.updated(inc)
    assert done.wait(5)
    alerter.close()
    assert [b["event"] for b in posted] == ["opened", "aftermath"]
    assert {b["id"] for b in posted} == {"inc-0001"}
    assert posted[1]["text"] == "hangwatch shape_mismatch (inc-0001), then: rank 0 then died: SIGABRT"


def _incident(n: int) -> Incident:
    return Incident(
        f"inc-{n:04d}", "job", IncidentKind.STUCK_COLLECTIVE, f"run/stuck:0:{n}", [1], [0], "all_reduce", "0", n, 0,
        "rank 1 never came", "look at rank 1", 1.0, 2.0,
    )  # fmt: skip


def test_credentials_in_the_url_are_sent_as_basic_auth_and_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str, str | None]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200 if len(seen) == 1 else 500)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://alice:s3cret@127.0.0.1:{server.server_address[1]}/services/T000/SECRETPATH"
    alerter = WebhookAlerter(url, attempts=2, first_backoff_s=0.05)
    try:
        alerter(_incident(1))
        alerter(_incident(2))  # refused twice: logged, without the URL's secrets
        wait_for(lambda: alerter.failed == 1, 10, 0.05, "the second alert to fail")
    finally:
        alerter.close()
        server.shutdown()
    assert seen[0] == ("/services/T000/SECRETPATH", "Basic " + base64.b64encode(b"alice:s3cret").decode())
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "failed 2 times" in logged and "SECRETPATH" not in logged and "s3cret" not in logged


def test_an_alert_the_endpoint_black_holes_does_not_hold_back_the_next() -> None:
    got: list[str] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body["id"] == "inc-0001":
                time.sleep(1.5)  # never answered within the alerter's timeout
            got.append(body["id"])
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    alerter = WebhookAlerter(f"http://127.0.0.1:{server.server_address[1]}/", timeout_s=0.3, first_backoff_s=0.5)
    try:
        alerter(_incident(1))
        alerter(_incident(2))
        began = time.monotonic()
        wait_for(lambda: "inc-0002" in got, 10, 0.02, "the second alert")
        assert time.monotonic() - began < 1.2  # one timed-out attempt of the first, not all five
    finally:
        alerter.close()
        server.shutdown()
