"""Imported at interpreter start by ``hangwatch_attach.pth`` when ``HANGWATCH_ADDR`` is set.

It imports neither torch nor grpc. It arranges for ``torch.distributed`` to be instrumented
right after it is first imported, and asks PyTorch's Flight Recorder to keep a small ring (so
collectives issued from C++ are visible) unless the user chose a size. It swallows every error:
a broken hook must never stop an interpreter from starting.
"""

from __future__ import annotations

import os
import sys


def _bootstrap() -> None:
    from hangwatch import config

    if config.env_flag(config.ENV_DISABLE):
        return
    if config.inherited_rank():
        return  # a subprocess started by a rank (DataLoader worker, tool): never a rank itself
    level = os.environ.get(config.ENV_LOG_LEVEL)
    if level:
        import logging

        try:
            logging.getLogger("hangwatch.client").setLevel(level.upper())
        except ValueError:
            pass  # an unknown level name must not cost the job its hook
    if config.env_flag(config.ENV_FLIGHT_RECORDER, True):
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(config.DEFAULT_FR_BUFFER_SIZE))
    addr = os.environ.get(config.ENV_ADDR, "")
    if config.env_flag(config.ENV_JOINING, True):
        from hangwatch.client import joining

        if joining.start(addr):
            os.environ[config.ENV_RANK_PID] = str(os.getpid())  # its subprocesses are not ranks
            os.environ[config.ENV_RANK_OF] = config.launcher_rank()
    from hangwatch.client import importhook

    importhook.when_imported("torch.distributed", _instrument)
    importhook.when_imported("accelerate.accelerator", _accelerate)
    importhook.when_imported("torch.nn.parallel.distributed", _ddp)


def _accelerate(module: object) -> None:
    from hangwatch.client import integrations

    integrations.patch_accelerate(module)  # type: ignore[arg-type]


def _ddp(module: object) -> None:
    from hangwatch.client import integrations

    integrations.patch_ddp(module)  # type: ignore[arg-type]


def _instrument(module: object) -> None:
    from hangwatch.client import capture

    capture.instrument()


try:
    _bootstrap()
except Exception as exc:  # pragma: no cover - defensive: never break interpreter start
    sys.stderr.write(f"hangwatch: hook not attached ({type(exc).__name__}: {exc})\n")
