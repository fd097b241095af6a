"""Bytes and text from outside, taken without letting them cost more than their size.

JSON and pickles from ranks, worker servers, dump files and imports are parsed only where the
objects they would make stay proportional to their length: ``{},`` repeated makes a dict of
every three bytes (32 MiB of it took 1.6 GB), and a pickle's memo can name one list a million
times (16 KB took 6 s to walk). Text that reaches a terminal has its control characters shown
as U+FFFD, so no escape sequence in a name or a file moves the cursor or rewrites a line.
"""

from __future__ import annotations

import json
from typing import Any

#: A JSON document may hold one container (``{`` or ``[``) per this many bytes, plus
#: ``CONTAINER_SLACK``: real Flight Recorder JSON holds one per 40 to 60 bytes.
BYTES_PER_CONTAINER = 16
CONTAINER_SLACK = 4096
#: Objects a decoded pickle may reach, walked as a tree (a shared object counted at each place it
#: is reached), per byte of the pickle, plus ``OBJECT_SLACK``: each object costs a pickle at
#: least one byte unless the memo shares it.
OBJECTS_PER_BYTE = 2
OBJECT_SLACK = 100_000

#: Control characters (ANSI escapes among them): each is shown as U+FFFD.
CONTROLS = {c: "\ufffd" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0))}
#: The same, keeping newlines and tabs (a traceback keeps its lines).
TEXT_CONTROLS = {c: r for c, r in CONTROLS.items() if c not in (0x09, 0x0A)}


class Refused(ValueError):
    """Input refused before it could cost more than its size (the message says why)."""


def loads_json(data: bytes | bytearray | memoryview, what: str = "JSON") -> Any:
    """``json.loads`` of ``data``, refused (``Refused``) where it is not JSON, nests past the
    recursion limit, or holds more containers than its length allows."""
    data = bytes(data)
    containers = data.count(b"{") + data.count(b"[")  # an upper bound: brackets in strings count too
    allowed = len(data) // BYTES_PER_CONTAINER + CONTAINER_SLACK
    if containers > allowed:
        raise Refused(f"{what}: {containers} objects in {len(data)} bytes, more than {allowed}")
    try:
        return json.loads(data)
    except RecursionError:
        raise Refused(f"{what}: not valid JSON (nested too deep)") from None
    except ValueError as e:
        raise Refused(f"{what}: not valid JSON ({e})") from None


def check_size(obj: Any, limit: int, what: str = "data") -> None:
    """Refuse ``obj`` when more than ``limit`` objects are reached walking it as a tree: what a
    reader that visits every entry pays, shared references included. Stops at the limit."""
    seen = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        seen += 1
        if seen > limit:
            raise Refused(f"{what}: more than {limit} objects once its shared parts are counted where they are used")
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)


def object_limit(nbytes: int) -> int:
    """The objects a pickle of ``nbytes`` may reach (``check_size``)."""
    return nbytes * OBJECTS_PER_BYTE + OBJECT_SLACK


def printable(text: str, lines: bool = True) -> str:
    """``text`` with its control characters shown as U+FFFD (``lines``: newlines and tabs kept)."""
    if text.isprintable():
        return text
    return text.translate(TEXT_CONTROLS if lines else CONTROLS)
