"""The explicit API, for users who prefer code to an environment variable.

import hangwatch.client
hangwatch.client.attach("coordinator-host:29600")   # before or after init_process_group
...
hangwatch.step()                                   # custom loops without an optimizer
"""

from __future__ import annotations

import sys

from hangwatch import config


def attach(addr: str | None = None, *, token: str | None = None, job_id: str | None = None) -> bool:
    """Instrument ``torch.distributed`` and register this rank once its process group exists.

    Idempotent. Returns False when the hook is disabled (``HANGWATCH_DISABLE=1``) or torch is
    not importable; never raises.
    """
    try:
        if config.env_flag(config.ENV_DISABLE):
            return False
        from hangwatch.client import capture, session

        resolved = addr or config.default_addr()
        session._settings.update({"addr": resolved, "token": token, "job_id": job_id})
        if not capture.instrument():
            return False
        from hangwatch.client import importhook, integrations

        importhook.when_imported("accelerate.accelerator", integrations.patch_accelerate)
        importhook.when_imported("torch.nn.parallel.distributed", integrations.patch_ddp)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_initialized():
            session.after_init({})
        return True
    except Exception:
        return False


def detach() -> None:
    """Stop recording and restore ``torch.distributed``. Idempotent."""
    from hangwatch.client import capture, session

    current = session.current()
    capture.set_session(None)
    capture.uninstrument()
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    if ddp is not None:
        from hangwatch.client import integrations

        integrations.unpatch_ddp(ddp)
    if current is not None:
        current.sender.flush(1.0)
        current.sender.stop()


def step(n: int | None = None) -> None:
    """Mark a training step (increments, or sets it to ``n``)."""
    from hangwatch.client import session

    session.step(n)
