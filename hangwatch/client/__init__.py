"""The in-rank hook (installed as ``hangwatch.client``).

Attach with no code change by exporting ``HANGWATCH_ADDR=host:port`` in every rank's
environment, or call :func:`attach`. Importing this package imports neither torch nor grpc.
"""

from __future__ import annotations

from hangwatch.client.api import attach, detach, step

__all__ = ["attach", "detach", "step"]
