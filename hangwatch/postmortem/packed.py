"""A folder of dumps sent to a coordinator (``hangwatch analyze --import``): bounded on both
sides. The sender keeps each rank's last entries on each group, cut and compressed (``pack``);
the coordinator inflates no more than it allows and checks every field as input from outside
(``unpack``), so that a payload too big, too deep or of the wrong shape is a ``DumpError``."""

from __future__ import annotations

import json
import zlib
from typing import Any

from hangwatch import untrusted
from hangwatch.postmortem.dumps import (
    ENTRY_KEYS,
    LAST_NS,
    MAX_RANKS,
    SEND_TEXT,
    TIME_KEYS,
    DumpError,
    Folder,
    RankDump,
    group_of,
    status_of,
    time_ok,
)

#: What is sent of a rank's ring: its last entries on each group (the slots a hang or a mismatch
#: is in, and the history the rules read), each call's frames cut to this many, texts to this long.
SEND_PER_GROUP = 32
SEND_FRAMES = 16
#: The most ranks one import carries (a bigger job: import a subset with --prefix).
SEND_RANKS = 4096
#: The most process groups one import may name (DeviceMesh jobs have tens).
SEND_GROUPS = 1024


def _text(value: Any) -> str:
    return untrusted.printable(str(value)[:SEND_TEXT], lines=False)


def _entry_out(entry: dict[str, Any]) -> dict[str, Any]:
    out = {k: entry[k] for k in ENTRY_KEYS if k in entry and (k not in TIME_KEYS or time_ok(entry[k]))}
    if isinstance(out.get("process_group"), list | tuple):
        out["process_group"] = [_text(x) for x in out["process_group"][:2]]
    if "profiling_name" in out:
        out["profiling_name"] = _text(out["profiling_name"])
    if "call_site" in entry:
        out["call_site"] = _text(entry["call_site"])
    frames = entry.get("frames")
    if isinstance(frames, list):
        out["frames"] = [
            {"filename": _text(f.get("filename", "")), "line": f.get("line", 0), "name": _text(f.get("name", ""))}
            for f in frames[:SEND_FRAMES]
            if isinstance(f, dict)
        ]
    return out


def compact(folder: Folder) -> dict[str, Any]:
    """What ``folder`` holds, as JSON-able data bounded in size: per rank its last
    :data:`SEND_PER_GROUP` entries on each group, their frames, its groups' status and config."""
    ranks: dict[str, Any] = {}
    for rank, dump in sorted(folder.dumps.items())[:SEND_RANKS]:
        by_group: dict[str, list[dict[str, Any]]] = {}
        for entry in dump.entries:
            by_group.setdefault(group_of(entry), []).append(entry)
        kept = [_entry_out(e) for entries in by_group.values() for e in entries[-SEND_PER_GROUP:]]
        ranks[str(rank)] = {
            "path": _text(dump.path),
            "format": dump.format,
            "ring": dump.ring,
            "version": _text(dump.version),
            "written": dump.written,
            "pg_status": dump.pg_status,
            "pg_config": {
                _text(k): {"ranks": _text(v.get("ranks", "")) if isinstance(v, dict) else ""}
                for k, v in list(dump.pg_config.items())[:64]
            },
            "entries": kept,
        }
    return {"ranks": ranks}


#: An import's bytes: ``compact``'s JSON, zlib-compressed (paths and names repeat in every entry),
#: at most this much once inflated: a bigger folder is imported in parts (``--prefix``).
MAX_IMPORT_BYTES = 64 << 20
#: What one import may send: under the coordinator's 16 MiB limit on a message.
MAX_SEND_BYTES = 15 << 20
#: What parsing an import holds at its peak, per byte of its JSON (measured: about 5).
IMPORT_PARSE_FACTOR = 8


def pack(folder: Folder) -> tuple[bytes, int]:
    """``compact``'s JSON, compressed, and its size before (both are bounded on receipt)."""
    raw = json.dumps(compact(folder)).encode()
    return zlib.compress(raw, 6), len(raw)


def inflate(data: bytes) -> bytes:
    """``pack``'s bytes inflated, at most :data:`MAX_IMPORT_BYTES` (a zip bomb is a
    :class:`DumpError`, refused before it is inflated past that)."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, MAX_IMPORT_BYTES)
    except zlib.error as e:
        raise DumpError(f"not an import of dumps ({e})") from None
    if inflater.unconsumed_tail:
        raise DumpError(f"an import of dumps bigger than {MAX_IMPORT_BYTES >> 20} MiB: import it in parts (--prefix)")
    return raw


def unpack(data: bytes) -> Folder:
    """``pack``'s bytes back, bounded: a payload that inflates past :data:`MAX_IMPORT_BYTES`,
    holds more objects than its size allows, or is not ``compact``'s JSON is a
    :class:`DumpError`."""
    return from_json(inflate(data))


def from_json(raw: bytes) -> Folder:
    """``compact``'s JSON as a :class:`Folder` (:func:`from_compact`), bounded as ``unpack`` says."""
    try:
        return from_compact(untrusted.loads_json(raw, "an import of dumps"))
    except DumpError:
        raise
    except untrusted.Refused as e:
        raise DumpError(str(e)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DumpError(f"not an import of dumps ({e})") from None
    except Exception as e:  # numbers past a float...
        raise DumpError(f"not an import of dumps ({type(e).__name__})") from None


def from_compact(data: Any) -> Folder:
    """The :class:`Folder` ``compact`` described, checked as any input from outside is: a field of
    the wrong type is a :class:`DumpError` naming it, never a crash, and the bounds hold."""
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), dict):
        raise DumpError("not a folder of dumps (no ranks)")
    if len(data["ranks"]) > SEND_RANKS:
        raise DumpError(f"{len(data['ranks'])} ranks: more than {SEND_RANKS} in one import")
    out = Folder()
    groups: set[str] = set()
    for key, raw in data["ranks"].items():
        try:
            rank = int(key)
            if not 0 <= rank < MAX_RANKS or not isinstance(raw, dict):
                raise ValueError("no such rank")
            entries = [e for e in raw.get("entries", []) if isinstance(e, dict)]
            mine = {group_of(e) for e in entries}
            if len(entries) > max(1, len(mine)) * SEND_PER_GROUP:
                raise DumpError(f"rank {rank}: {len(entries)} entries, more than {SEND_PER_GROUP} a group")
            groups |= mine
            if len(groups) > SEND_GROUPS:
                raise DumpError(f"more than {SEND_GROUPS} process groups in one import")
            written = float(raw.get("written", 0.0))
            if not 0 <= written < LAST_NS / 1e9:  # NaN fails too
                raise ValueError("no such time")
            out.dumps[rank] = RankDump(
                rank=rank,
                path=_text(raw.get("path", "")),
                format=_text(raw.get("format", "")),
                version=_text(raw.get("version", "")),
                entries=[_entry_out(e) for e in entries],
                pg_config=raw["pg_config"] if isinstance(raw.get("pg_config"), dict) else {},
                pg_status=status_of(raw.get("pg_status")),
                written=written,
                frames=any(e.get("frames") or e.get("call_site") for e in entries),
                ring=_text(raw.get("ring", "")),
            )
        except DumpError:
            raise
        except (TypeError, ValueError, AttributeError) as e:
            raise DumpError(f"rank {key!r}: not a dump as `hangwatch analyze --import` sends it ({e})") from None
    return out
