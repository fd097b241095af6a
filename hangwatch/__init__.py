"""hangwatch: out-of-process hang diagnosis for PyTorch distributed training.

Folders are import paths: ``hangwatch/client/`` is ``hangwatch.client`` (the in-rank hook),
``hangwatch/coordinator/`` the coordinator's service, ``hangwatch/diagnosis/`` the job state and
detectors it and ``hangwatch/postmortem/`` both feed, ``hangwatch/model/`` the model they use,
``hangwatch/agent/`` the node agent, ``hangwatch/protos/`` the wire contract and
``hangwatch/cli/`` the command line. The modules at
this level are what they share: the op catalogue, configuration, the typed records, the wire
conversion.
"""

from __future__ import annotations

__version__ = "0.1.0"


def step(n: int | None = None) -> None:
    """Mark a training step for the in-rank hook (custom loops without an optimizer step).

    A no-op when the hook is not attached. ``n`` sets the step number; by default it increments.
    """
    from hangwatch.client import api

    api.step(n)
