"""The webhook's bodies: a new incident, then the aftermath that completes it (one story per root
cause). ``WebhookAlerter._post`` is the seam (the HTTP round trip itself is proven in
``test_service.test_metrics_and_webhook``)."""

from __future__ import annotations

import threading
from typing import Any

from hangwatch.coordinator.alerts import WebhookAlerter
from hangwatch.coordinator.incidents import Incident, IncidentKind


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
