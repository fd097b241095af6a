"""Webhook alerts: every new incident POSTed as JSON, retried with backoff, never blocking detection.

The body is the incident's JSON (the documented contract) plus ``event`` (``opened``, or
``aftermath`` when an open incident learns the death it caused: the same ``id``, updated) and a
``text`` field, so Slack's incoming webhooks show a readable line as they are.
"""

from __future__ import annotations

import base64
import heapq
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from hangwatch.diagnosis.incidents import Incident

log = logging.getLogger("hangwatch.coordinator")


class WebhookAlerter:
    def __init__(self, url: str, *, attempts: int = 5, first_backoff_s: float = 0.5, timeout_s: float = 5.0) -> None:
        self.url = url
        self._target, self._auth, self.shown = _split_credentials(url)
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
        headers = {"Content-Type": "application/json"}
        if self._auth:
            headers["Authorization"] = self._auth
        request = urllib.request.Request(self._target, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read()

    def _run(self) -> None:
        """Send alerts in order; one that fails waits for its retry *behind* those queued since
        (an endpoint that black-holes one alert delays the next by one attempt, not five)."""
        retries: list[tuple[float, int, int, dict[str, Any]]] = []  # (due, order, attempt, body)
        order = 0
        while True:
            now = time.monotonic()
            if retries and retries[0][0] <= now:
                _, _, attempt, body = heapq.heappop(retries)
            else:
                wait = retries[0][0] - now if retries else None
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    continue
                if item is None:
                    return
                attempt, body = 1, item
            try:
                self._post(body)
                self.sent += 1
            except (urllib.error.URLError, OSError, ValueError) as exc:
                if attempt >= self.attempts:
                    self.failed += 1
                    log.error("webhook %s failed %d times for %s: %s", self.shown, attempt, body.get("id"), exc)
                else:
                    order += 1
                    due = time.monotonic() + self.first_backoff_s * 2 ** (attempt - 1)
                    heapq.heappush(retries, (due, order, attempt + 1, body))

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass


def _split_credentials(url: str) -> tuple[str, str, str]:
    """``url`` without its ``user:pass@`` (sent as HTTP basic auth instead, which urllib does not
    do from the URL), that header, and the URL as logs may show it: scheme, host and port only
    (a Slack webhook's path is its secret)."""
    parts = urllib.parse.urlsplit(url)
    auth = ""
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    target = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    shown = f"{parts.scheme}://{netloc}/..." if parts.path not in ("", "/") else f"{parts.scheme}://{netloc}"
    return target, auth, shown
