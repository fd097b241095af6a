"""Webhook alerts: every new incident POSTed as JSON, retried with backoff, never blocking detection.

The body is the incident's JSON (the documented contract) plus ``event`` (``opened``, or
``aftermath`` when an open incident learns the death it caused: the same ``id``, updated) and a
``text`` field, so Slack's incoming webhooks show a readable line as they are.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from hangwatch.coordinator.incidents import Incident

log = logging.getLogger("hangwatch.coordinator")


class WebhookAlerter:
    def __init__(self, url: str, *, attempts: int = 5, first_backoff_s: float = 0.5, timeout_s: float = 5.0) -> None:
        self.url = url
        self.attempts = attempts
        self.first_backoff_s = first_backoff_s
        self.timeout_s = timeout_s
        self.sent = 0
        self.failed = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=1000)
        self._thread = threading.Thread(target=self._run, name="hangwatch-webhook", daemon=True)
        self._thread.start()

    def __call__(self, incident: Incident) -> None:
        """An engine listener (a new incident): queue the alert and return at once."""
        self._enqueue(incident, "opened", f"hangwatch {incident.kind} ({incident.id}): {incident.summary}")

    def updated(self, incident: Incident) -> None:
        """An engine update listener: the incident gained its aftermath (a rank it killed); the
        update names the incident it completes, so a chat shows one story per root cause."""
        aftermath = incident.details.get("aftermath") or {}
        what = aftermath.get("summary") if isinstance(aftermath, dict) else ""
        self._enqueue(incident, "aftermath", f"hangwatch {incident.kind} ({incident.id}), then: {what}")

    def _enqueue(self, incident: Incident, event: str, text: str) -> None:
        body = incident.to_json()
        body["event"] = event
        body["text"] = text
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            self.failed += 1
            log.error("webhook queue full: alert for %s dropped", incident.id)

    def _post(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read()

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            if body is None:
                return
            backoff = self.first_backoff_s
            for attempt in range(1, self.attempts + 1):
                try:
                    self._post(body)
                    self.sent += 1
                    break
                except (urllib.error.URLError, OSError, ValueError) as exc:
                    if attempt == self.attempts:
                        self.failed += 1
                        log.error("webhook %s failed %d times for %s: %s", self.url, attempt, body.get("id"), exc)
                    else:
                        time.sleep(backoff)
                        backoff *= 2

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
