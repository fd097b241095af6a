"""What a collective's arguments say, as the hook records them: each tensor's shape, dtype and
device, a reduce op's name, a batch's ops and peers.
"""

from __future__ import annotations

from typing import Any

from hangwatch import records as r
from hangwatch.client.ops import OpSpec
from hangwatch.native import foreign

#: A raw tensor: (torch.Size, torch.dtype, is_cuda); an object list: (length, None, False).
RawMeta = tuple[Any, Any, bool]

_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        text = str(dtype)
        name = _DTYPE_NAMES[dtype] = text[6:] if text.startswith("torch.") else text
    return name


def cook(raw: tuple[RawMeta, ...]) -> tuple[r.TensorMeta, ...]:
    out = []
    for shape, dtype, cuda in raw:
        if dtype is None:  # an object list of ``shape`` items, or a single object (-1)
            out.append(r.TensorMeta((shape,) if shape >= 0 else (), "object", ""))
        else:
            out.append(r.TensorMeta(tuple(shape), _dtype_name(dtype), "cuda" if cuda else "cpu"))
    return tuple(out)


def _raw(t: Any) -> RawMeta:
    try:
        return (t.shape, t.dtype, t.is_cuda)
    except Exception as exc:
        if foreign(exc):  # the program's (a signal handler's): never swallowed
            raise
        return ((), type(t).__name__, False)


def raw_metas(spec: OpSpec, names: tuple[str, ...], params: dict[str, Any]) -> tuple[RawMeta, ...]:
    out: list[RawMeta] = []
    for name in names:
        value = params.get(name)
        if value is None:
            continue
        if spec.objects:
            out.append((len(value), None, False) if isinstance(value, (list, tuple)) else (-1, None, False))
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, (list, tuple)):
                    out.extend(_raw(x) for x in item)
                elif hasattr(item, "shape"):
                    out.append(_raw(item))
                elif hasattr(item, "tensor"):  # P2POp
                    out.append(_raw(item.tensor))
        else:
            out.append(_raw(value))
    return tuple(out)


def batch_ops(ops: Any) -> str:
    """``isend:1,irecv:1``: each P2POp of a batch and its peer (global rank)."""
    out: list[str] = []
    for op in ops or ():
        name = getattr(getattr(op, "op", None), "__name__", "?")
        out.append(f"{name}:{getattr(op, 'peer', '?')}")
    return ",".join(out)


def reduce_name(red: Any) -> str:
    name = getattr(red, "name", None)
    if isinstance(name, str):
        return name.lower()
    text = str(red)
    return text.rsplit(".", 1)[-1].lower()
