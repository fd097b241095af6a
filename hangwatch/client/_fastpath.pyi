"""Types of the hook's C fast path (``_fastpath.c``); built at install where a C compiler is."""

from collections.abc import Callable
from typing import Any

SLOT_SIZE: int

def general_entered() -> None:
    """A thread entered a call the Python wrapper records (its fast paths skip ``depth`` otherwise)."""

def general_left() -> None: ...
def scan_packed(
    mm: Any, header: int, capacity: int, position: int, budget: int, /
) -> tuple[bytes, int, tuple[int, int] | None]:
    """``RingReader.poll``'s loop over slots in C: the slots as they lie in the ring, one bytes
    object (``SLOT_SIZE`` each), the next position, and the stamps of the slot that stopped the
    scan (None: the budget did)."""

def gather_packed(
    head: list[Any],
    data: bytes,
    n: int,
    whole: set[int],
    ok: dict[int, bool],
    known: Callable[[int], None],
    run_min: int,
    slot_type: type[Any],
    cycles: tuple[set[int], dict[int, Any], int, int] | None,
    /,
) -> tuple[list[Any], bool]:
    """``RingEncoder._gather`` in C (then ``_cycled``, where asked) on ``head``'s slots and the
    first ``n`` of ``data`` (``scan_packed``'s): the items (slots, runs as (enter, exit, enters,
    exits), cycles with their refs after) and whether the batch was steady; a slot's tuple is
    made only where it is one."""

def general_inside() -> int:
    """Threads inside a call the Python wrapper records, now."""

class FastOp:
    """A recorded ``torch.distributed`` function whose repeated calls are recorded in C."""

    served: int
    __wrapped__: Callable[..., Any]
    __hangwatch_original__: Callable[..., Any]
    __hangwatch_python__: Callable[..., Any]
    def __init__(
        self,
        spec: Any,
        k: int,
        original: Callable[..., Any],
        general: Callable[..., Any],
        globals: dict[str, Any],
        tls: Any,
        on_error: Callable[..., None],
        on_exit_error: Callable[..., None],
        header: int,
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def forget(self) -> None: ...
