"""Views of dumped stacks a report needs: the main thread, ranks alike, one line each."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hangwatch.records import Frame, StackDump, ThreadStack

_LIBRARY = re.compile(
    r"[/\\](site-packages|dist-packages|torch|hangwatch)[/\\]|[/\\]lib[/\\]python3\.\d+[/\\]|^<frozen "
)
_SHORT = re.compile(r"^.*[/\\](?:site-packages|dist-packages|lib[/\\]python3\.\d+)[/\\]")


def main_thread(dump: StackDump) -> ThreadStack | None:
    """The main thread: its native id is the pid (Linux), or py-spy named it ``MainThread``."""
    for t in dump.threads:
        if t.thread_id == dump.pid or t.name == "MainThread":
            return t
    return None


def short_path(filename: str) -> str:
    """A file name as py-spy shortens it: the package path for libraries, the base name otherwise."""
    shortened = _SHORT.sub("", filename)
    return shortened if shortened != filename else filename.rsplit("/", 1)[-1]


def _describe(frame: Frame) -> str:
    where = short_path(frame.filename)
    return f"{frame.function} ({where}:{frame.line})" if frame.line else f"{frame.function} ({where})"


def group_identical(dumps: Mapping[int, StackDump]) -> list[tuple[list[int], str]]:
    """Ranks whose main threads show the same Python frames (function, file, line), largest first.

    Native frames are left out (their addresses differ between processes); failed dumps group
    by their error. Each group comes with its stack as text, innermost frame first.
    """
    groups: dict[tuple[object, ...], tuple[list[int], str]] = {}
    for rank in sorted(dumps):
        dump = dumps[rank]
        thread = main_thread(dump)
        if dump.error is not None:
            key: tuple[object, ...] = ("error", dump.error)
            text = f"no stacks: {dump.error}"
        elif thread is None:
            key, text = ("no main thread",), "no main thread"
        else:
            frames = [f for f in thread.frames if not f.native]
            key = tuple((f.function, f.filename, f.line) for f in frames)
            text = "\n".join(_describe(f) for f in frames) or "(no Python frames)"
        groups.setdefault(key, ([], text))[0].append(rank)
    return sorted(groups.values(), key=lambda g: (-len(g[0]), g[0][0]))


def _user_index(frames: Sequence[Frame]) -> int | None:
    python = [i for i, f in enumerate(frames) if not f.native]
    user = [i for i in python if not _LIBRARY.search(frames[i].filename)]
    found = user or python
    return found[0] if found else None


def summarize(dump: StackDump) -> str:
    """What the process is doing, in one line, e.g. ``time_sleep in train.py:42 (main)``.

    The place is the innermost frame of the user's own code in the main thread (library frames
    are skipped while a user frame exists); the callee is the innermost Python frame below it,
    else the native function it called.
    """
    if dump.error is not None:
        return f"no stacks: {dump.error}"
    thread = main_thread(dump)
    if thread is None or not thread.frames:
        return "no main thread stack"
    frames = thread.frames
    at = _user_index(frames)
    if at is None:
        return f"in native code: {_describe(frames[0])}"
    place = frames[at]
    callee = next((f for f in frames[:at] if not f.native), frames[at - 1] if at else None)
    where = f"{short_path(place.filename)}:{place.line} ({place.function})"
    line = f"{callee.function} in {where}" if callee else where
    return line + (", holding the GIL" if thread.owns_gil else "")


def user_frame(dump: StackDump) -> str:
    """Where the process is in its own code: ``download_dataset at train.py:12`` ("": unknown)."""
    if dump.error is not None:
        return ""
    thread = main_thread(dump)
    if thread is None or not thread.frames:
        return ""
    at = _user_index(thread.frames)
    if at is None:
        return ""
    place = thread.frames[at]
    return f"{place.function} at {short_path(place.filename)}:{place.line}"


#: A main thread in one of these waits on the rank's own processes (its DataLoader's workers, a
#: subprocess, a multiprocessing pool).
_WAITS_ON_CHILDREN = re.compile(
    r"torch[/\\]utils[/\\]data[/\\]dataloader\.py$|[/\\]subprocess\.py$|"
    r"[/\\]multiprocessing[/\\](pool|connection|queues|popen_\w+)\.py$"
)
#: A DataLoader worker's loop: frames outside it are its parent's, copied at fork.
_WORKER_LOOP = re.compile(r"torch[/\\]utils[/\\]data[/\\]_utils[/\\]worker\.py$")


def child_where(dump: StackDump) -> tuple[str, str]:
    """What one of a rank's processes is and where it is in the program's code:
    ``("DataLoader worker", "read_shard at train.py:355")``; where is "" when it is idle in
    library code (a worker waiting for its next index)."""
    thread = main_thread(dump) or (dump.threads[0] if dump.threads else None)
    if thread is None:
        return "child process", ""
    frames = thread.frames
    loop = next((i for i, f in enumerate(frames) if _WORKER_LOOP.search(f.filename)), None)
    inner = frames[:loop] if loop is not None else frames
    user = next((f for f in inner if not f.native and not _LIBRARY.search(f.filename)), None)
    what = "DataLoader worker" if loop is not None else "child process"
    return what, f"{user.function} at {short_path(user.filename)}:{user.line}" if user is not None else ""


def waited_children(dump: StackDump) -> list[tuple[int, str, str]]:
    """The rank's own processes its main thread waits for that are in the program's code:
    (pid, what, where) each; none where it waits on nothing of its own."""
    thread = main_thread(dump)
    if dump.error is not None or thread is None or not dump.children:
        return []
    if not any(_WAITS_ON_CHILDREN.search(f.filename) for f in thread.frames):
        return []
    out = []
    for child in dump.children:
        if child.error is None:
            what, where = child_where(child)
            if where:
                out.append((child.pid, what, where))
    return out


def dump_json(d: StackDump) -> dict[str, Any]:
    """One dump as ``stacks --json`` gives it."""
    return {
        "pid": d.pid,
        "time": d.time,
        "text": d.text,
        "error": d.error,
        "native": d.native,
        "threads": [
            {
                "thread_id": t.thread_id,
                "name": t.name,
                "active": t.active,
                "owns_gil": t.owns_gil,
                "frames": [
                    {"function": f.function, "filename": f.filename, "line": f.line, "native": f.native}
                    for f in t.frames
                ],
            }
            for t in d.threads
        ],
        "children": [dump_json(c) for c in d.children],
    }
