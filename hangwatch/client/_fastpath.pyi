"""Types of the hook's C fast path (``_fastpath.c``); built at install where a C compiler is."""

from collections.abc import Callable
from typing import Any

SLOT_SIZE: int
HEADER_SIZE: int
BLOB_USED_OFFSET: int

def general_enter(tls: Any, /) -> None:
    """The calling thread enters a call the Python wrapper records: ``tls.depth`` set and the
    count (its fast path skips ``depth`` where none is inside) up, in one step."""

def general_leave(tls: Any, /) -> None:
    """It left (a second call does nothing)."""

def put_slot(
    mm: Any,
    positions: Any,
    capacity: int,
    kind: int,
    flags: int,
    aux: int,
    ref: int,
    call_id: int,
    seq: int,
    step: int,
    arg: int,
    time: float,
    /,
) -> int:
    """Claims the next slot from ``positions`` and publishes the record there, in one step; its position."""

def put_blob(mm: Any, blobs_at: int, limit: int, data: bytes, /) -> int:
    """Appends and publishes a blob; its id, or 0 where there is no room (counted)."""

def store_release(mm: Any, offset: int, value: int, /) -> None: ...
def store_begin(mm: Any, offset: int, value: int, /) -> None: ...
def load_acquire(mm: Any, offset: int, /) -> int: ...
def load_after(mm: Any, offset: int, /) -> int: ...
def fence_acquire() -> None: ...
def set_foreign(fn: Callable[[BaseException], bool], /) -> None: ...
def _take_steps(mm: Any, capacity: int, position: int, between: Callable[[int], None], /) -> tuple[bool, bytes]:
    """Tests: the slot at ``position`` taken as ``scan_packed`` takes it, ``between`` between its steps."""

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
