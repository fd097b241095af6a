"""Reading torch's Flight Recorder dumps from a folder: one file per rank, either ring (the CPU
ring every backend records into, NCCL's CUDA ring), either format (pickle, JSON).

torch writes them at a NCCL timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, to
``TORCH_FR_DUMP_TEMP_FILE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` + the rank, default
``/tmp/nccl_trace_rank_<N>``), or when a program asks (``_dump_fr_trace`` /
``_dump_nccl_trace``, pickle, with stack frames when asked; the ``*_json`` variants, without).
A dump does not say which rank wrote it: the rank is the number its file name ends with, as
torch names them.

A dump is pickle, and unpickling runs whatever code the file names: a folder of dumps can come
from anywhere (a shared /tmp, a colleague's job), so only the plain containers and scalars a
Flight Recorder dump is made of are accepted, and a file naming anything else is refused as
not a dump. Unreadable files are reported, never fatal: the ranks that could be read are
analysed.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangwatch import untrusted

#: A file bigger than this is not a Flight Recorder dump (20,000 entries with frames: ~30 MB).
MAX_DUMP_BYTES = 256 << 20
#: Ranks a job may have (the coordinator's bound on a registration's world size).
MAX_RANKS = 1 << 20
#: Entries one dump may hold (torch keeps TORCH_FR_BUFFER_SIZE a ring, 2,000 by default): a
#: small pickle can name one entry a million times, and each becomes a record.
MAX_ENTRIES = 250_000

_RANK = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle|bin))?$")


#: Frames of torch's own wrappers (and hangwatch's), left out of a call site.
_LIBRARY = (f"{os.sep}torch{os.sep}", f"{os.sep}hangwatch{os.sep}")
#: Entries per group, per rank, whose stack frames are kept once read (the history the rules
#: look at and the slots an incident is about); older entries keep only their call site.
KEEP_FRAMES = 128


#: Texts of an entry are cut to this long (sent to a coordinator, named as a group).
SEND_TEXT = 512
TIME_KEYS = ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns")
#: A time in ns past this (the year 2096) is no clock's: read as unknown, like NaN.
LAST_NS = 4e18


def time_ok(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < LAST_NS


#: The fields of an entry kept once read (and sent in an import), its frames and call site apart.
ENTRY_KEYS = (
    "collective_seq_id",
    "p2p_seq_id",
    "is_p2p",
    "process_group",
    "profiling_name",
    "input_sizes",
    "input_dtypes",
    "output_sizes",
    "output_dtypes",
    "state",
    "retired",
    "time_created_ns",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "timeout_ms",
)


def site_of(frames: Any) -> str:
    """``file:line in function`` of the innermost frame outside torch ("" when none is)."""
    if isinstance(frames, list):
        for f in frames:
            if isinstance(f, dict):
                filename = str(f.get("filename", ""))
                if not any(part in filename for part in _LIBRARY):
                    return f"{os.path.basename(filename)}:{f.get('line', 0)} in {f.get('name', '')}"
    return ""


def user_site(frames: Any) -> tuple[str, list[str]]:
    """(``site_of(frames)``, every frame as text)."""
    if not isinstance(frames, list):
        return "", []
    lines = [f"{f.get('name', '')} ({f.get('filename', '')}:{f.get('line', 0)})" for f in frames if isinstance(f, dict)]
    return site_of(frames), lines


def _slim(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fields analysis reads, each entry's call site (one string per distinct site), and
    stack frames only for each group's last :data:`KEEP_FRAMES` entries: a 1,024-rank folder of
    2,000-entry rings with frames is gigabytes as read, and mostly frames."""
    sites: dict[str, str] = {}
    seen: dict[str, int] = {}
    out: list[dict[str, Any]] = []
    for entry in reversed(entries):
        slim = {k: entry[k] for k in ENTRY_KEYS if k in entry and (k not in TIME_KEYS or time_ok(entry[k]))}
        try:  # (group, collective seq), read once
            slim["_key"] = (group_of(entry), int(entry.get("collective_seq_id") or 0))
        except (TypeError, ValueError):
            pass
        frames = entry.get("frames")
        if frames:
            site = site_of(frames)
            slim["call_site"] = sites.setdefault(site, site)
            group = slim["_key"][0] if "_key" in slim else group_of(entry)
            seen[group] = seen.get(group, 0) + 1
            if seen[group] <= KEEP_FRAMES:
                slim["frames"] = frames
        out.append(slim)
    out.reverse()
    return out


class DumpError(Exception):
    """A file that is not a readable Flight Recorder dump (the message says why)."""


@dataclass
class RankDump:
    """One rank's dump: its entries, its process groups' status and config, and when it was
    written: the file's modification time, the moment the entries were read from the ring (a
    copy that did not keep it, ``cp`` without ``-p``, makes it the copy's time: calls in flight
    then look as old as the copy, which ``hangwatch analyze`` says), never before the latest
    moment its own entries record."""

    rank: int
    path: str
    format: str  # "pickle" or "json"
    version: str
    entries: list[dict[str, Any]]
    pg_config: dict[str, Any]
    pg_status: dict[str, dict[str, int]]
    written: float
    frames: bool  # whether its entries carry stack frames
    ring: str  # "cpu" (c10::Event ring) or "nccl" (the CUDA ring)


@dataclass
class Folder:
    """What a folder of dumps held: the ranks read, the files refused and why."""

    dumps: dict[int, RankDump] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # path -> why
    duplicates: dict[int, list[str]] = field(default_factory=dict)  # rank -> files not used


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles containers and scalars only: ``find_class`` is how a pickle reaches code."""

    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(f"names {module}.{name}: a Flight Recorder dump holds only plain data")


def status_of(raw: Any) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    if not isinstance(raw, dict):
        return out
    for group, fields in raw.items():
        if isinstance(fields, dict):
            vals: dict[str, int] = {}
            for k, v in fields.items():
                try:
                    vals[str(k)] = int(v)
                except (TypeError, ValueError):
                    continue
            out[str(group)] = vals
    return out


def parse(data: bytes, path: str, rank: int, written: float) -> RankDump:
    """One dump's bytes (pickle or JSON, told by their first byte)."""
    try:
        return _parse(data, path, rank, written)
    except DumpError:
        raise
    except Exception as e:  # nesting past the recursion limit, a field of a foreign type...
        raise DumpError(f"not a Flight Recorder dump torch wrote ({type(e).__name__})") from None


def _parse(data: bytes, path: str, rank: int, written: float) -> RankDump:
    if data[:1] in (b"{", b"["):
        try:
            doc = untrusted.loads_json(data, "this JSON")
        except untrusted.Refused as e:
            raise DumpError(f"not a Flight Recorder dump torch wrote: {e}") from None
        fmt = "json"
    else:
        try:
            doc = _PlainUnpickler(io.BytesIO(data)).load()
        except DumpError:
            raise
        except Exception as e:  # a truncated or foreign pickle raises many kinds
            raise DumpError(f"not a pickle torch wrote ({type(e).__name__}: {e})") from None
        fmt = "pickle"
    if not isinstance(doc, dict) or "entries" not in doc or not isinstance(doc["entries"], list):
        raise DumpError("not a Flight Recorder dump (no list of entries)")
    if len(doc["entries"]) > MAX_ENTRIES:
        raise DumpError(f"{len(doc['entries'])} entries: more than any Flight Recorder ring keeps ({MAX_ENTRIES})")
    if fmt == "pickle":
        try:  # its memo can name one object wherever it likes: count it where it is used
            untrusted.check_size(doc, untrusted.object_limit(len(data)), "this pickle")
        except untrusted.Refused as e:
            raise DumpError(f"not a Flight Recorder dump torch wrote: {e}") from None
    entries = [e for e in doc["entries"] if isinstance(e, dict)]
    latest = max((latest_time(e) for e in entries), default=0.0)
    frames = any(e.get("frames") for e in entries)
    ring = "nccl" if doc.get("comm_lib_version") or _nccl(entries) else "cpu"
    entries = _slim(entries)
    ring = "nccl" if ("nccl_comm_state" in doc and doc.get("nccl_comm_state")) or _nccl(entries) else "cpu"
    return RankDump(
        rank=rank,
        path=path,
        format=fmt,
        version=doc["version"][:SEND_TEXT] if isinstance(doc.get("version"), str) else "",
        entries=entries,
        pg_config=doc["pg_config"] if isinstance(doc.get("pg_config"), dict) else {},
        pg_status=status_of(doc.get("pg_status")),
        written=max(written, latest),  # a clock or a copy that put the file before its own entries
        frames=frames,
        ring=ring,
    )


def latest_time(entry: dict[str, Any]) -> float:
    """The latest moment an entry records (seconds), 0 when it records none."""
    return max((float(entry[k]) / 1e9 for k in TIME_KEYS if time_ok(entry.get(k))), default=0.0)


def _nccl(entries: list[dict[str, Any]]) -> bool:
    return any(str(e.get("profiling_name", "")).startswith("nccl:") for e in entries)


def rank_of(name: str, prefix: str) -> int | None:
    """The rank a dump's file name gives (``nccl_trace_rank_3``, ``fr_3.json``), or None."""
    if prefix and not name.startswith(prefix):
        return None
    m = _RANK.search(name[len(prefix) :] if prefix else name)
    return int(m.group(1)) if m else None


def read_file(path: str) -> tuple[bytes, float]:
    """A dump file's bytes and modification time: a regular file that is not empty, read
    without waiting (a FIFO, a device or ``/proc/kmsg`` behind a link is refused, never read),
    at most :data:`MAX_DUMP_BYTES`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DumpError("not a regular file")
        if st.st_size == 0:
            raise DumpError("not a pickle torch wrote: an empty file (as a file of /proc or /sys says it is)")
        if st.st_size > MAX_DUMP_BYTES:
            raise DumpError(f"{st.st_size} bytes: bigger than any Flight Recorder dump")
        chunks = []
        left = MAX_DUMP_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise DumpError(f"grew past {MAX_DUMP_BYTES} bytes while read")
        return b"".join(chunks), st.st_mtime
    finally:
        os.close(fd)


def _read(item: tuple[str, int]) -> RankDump | str:
    """One file, read and parsed: its dump, or why it is not one."""
    path, rank = item
    try:
        data, written = read_file(path)
        return parse(data, path, rank, written)
    except DumpError as e:
        return str(e)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"


def load(folder: str | os.PathLike[str], prefix: str = "") -> Folder:
    """Every dump in ``folder`` whose name starts with ``prefix`` and ends with a rank number,
    one per rank (both its rings' dumps merged). (Read in one process: a pool of two on a 2-core
    VM read 128 ranks' 2,000-entry dumps in 7.7 s against 6.7, shipping the parsed entries back
    costing what the second core saved.)"""
    out = Folder()
    root = Path(folder)
    if not root.is_dir():
        raise DumpError(f"{folder}: not a folder")
    items = [
        (str(path), rank)
        for path in sorted(root.iterdir())
        if path.is_file() and (rank := rank_of(path.name, prefix)) is not None
    ]
    results = [
        _read(item) if item[1] < MAX_RANKS else f"rank {item[1]}: beyond the {MAX_RANKS} ranks a job may have"
        for item in items
    ]
    found: dict[int, list[RankDump]] = {}
    for (path, rank), result in zip(items, results, strict=True):
        if isinstance(result, str):
            out.refused[path] = result
        else:
            found.setdefault(rank, []).append(result)
    for rank, dumps in found.items():
        # one dump per ring (the CPU ring and NCCL's are separate files): of two of a ring (a
        # pickle and its JSON twin, two dumps of one run), the one with frames, else the fuller,
        # else the newest; the others are listed
        best: dict[str, RankDump] = {}
        for dump in sorted(dumps, key=lambda d: (d.frames, len(d.entries), d.written), reverse=True):
            if dump.ring in best:
                out.duplicates.setdefault(rank, []).append(dump.path)
            else:
                best[dump.ring] = dump
        out.dumps[rank] = _merged(list(best.values()))
    return out


def group_of(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    return str(pg[0])[:SEND_TEXT] if isinstance(pg, list | tuple) and pg else ""


def _merged(rings: list[RankDump]) -> RankDump:
    """A rank's dumps of both rings as one. A group known to both (a default group made with
    ``"cpu:gloo,cuda:nccl"``: one group id, each backend numbering its own collectives) is kept
    apart as ``<id> (cpu ring)`` for the CPU ring's entries, the same on every rank."""
    if len(rings) == 1:
        return rings[0]
    first = rings[0]
    nccl = {group_of(e) for d in rings if d.ring == "nccl" for e in d.entries}
    for d in rings:
        if d.ring != "cpu":
            continue
        for i, e in enumerate(d.entries):
            group = group_of(e)
            if group in nccl:
                pg = e.get("process_group")
                name = str(pg[1]) if isinstance(pg, list | tuple) and len(pg) > 1 else ""
                apart = f"{group} (cpu ring)"
                d.entries[i] = {**e, "process_group": (apart, name)}
                if "_key" in e:
                    d.entries[i]["_key"] = (apart, e["_key"][1])
    status: dict[str, dict[str, int]] = {}
    config: dict[str, Any] = {}
    for d in rings:
        status.update(d.pg_status)
        config.update(d.pg_config)
    return RankDump(
        rank=first.rank,
        path=", ".join(d.path for d in rings),
        format="+".join(sorted({d.format for d in rings})),
        version=first.version,
        entries=[e for d in rings for e in d.entries],
        pg_config=config,
        pg_status=status,
        written=min(d.written for d in rings),
        frames=any(d.frames for d in rings),
        ring="+".join(sorted(d.ring for d in rings)),
    )
