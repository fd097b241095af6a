"""hangwatch: out-of-process hang diagnosis for PyTorch distributed training.

The namespace gathers the repository's top-level folders: ``client/`` is ``hangwatch.client``
(the in-rank hook), ``coordinator/`` is ``hangwatch.coordinator``, ``agent/`` is
``hangwatch.agent`` and ``protos/`` is ``hangwatch.protos``. This package itself (the
repository's ``common/`` folder) holds what they share: configuration, the typed records, the
wire conversion and the CLI.
"""

from __future__ import annotations

__version__ = "0.1.0"


def step(n: int | None = None) -> None:
    """Mark a training step for the in-rank hook (custom loops without an optimizer step).

    A no-op when the hook is not attached. ``n`` sets the step number; by default it increments.
    """
    from hangwatch.client import api

    api.step(n)
