"""Human output: status tables, incident lists and reports. Plain and stable when piped;
colour only on a terminal (and never with NO_COLOR)."""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any, TextIO

from hangwatch import wording
from hangwatch.cli import graphs
from hangwatch.wording import KIND_TITLES, in_step, on_device, ranks_label


def use_colour(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ


def _c(text: str, code: str, colour: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if colour else text


def format_ranks(ranks: list[int]) -> str:
    """Rank ranges as everywhere else (``hangwatch.wording``), ``-`` for none."""
    return wording.format_ranks(ranks, empty="-")


def _ago(t: float | None, now: float) -> str:
    if not t:
        return "-"
    secs = max(0.0, now - t)
    if secs < 120:
        return f"{secs:.0f} s"
    if secs < 7200:
        return f"{secs / 60:.0f} min"
    return f"{secs / 3600:.1f} h"


def _rank_line(rank: dict[str, Any], now: float) -> str:
    state = str(rank["state"])
    since = _ago(rank.get("since"), now)
    if state == "waiting":
        text = f"waiting in {rank['last_op']} (group {rank['group']}, seq {rank['seq']}) for {since}"
        if rank.get("host_returned"):
            text += f" ({on_device(str(rank.get('where') or ''), '')})"
        return text
    if state == "running":
        where = rank.get("where") or ""
        last = f"last {rank['last_op']} seq {rank['seq']}" if rank.get("last_op") else "no collective yet"
        return f"running{' in ' + where if where else ''} ({last})"
    if state in ("exited", "died"):
        end = rank.get("end") or {}
        detail = end.get("detail") or state
        site = f" at {end['call_site']}" if end.get("call_site") else ""
        return f"{state}: {detail}{site} ({since} ago)"
    if state == "frozen":
        return f"frozen: silent for {since} (process {rank.get('process') or 'unknown'})"
    return state


#: The coordinator's lateness ``status`` mentions (``diagnosis.lag.BEHIND_S``).
BEHIND_SHOWN_S = 1.0
#: Waits shown by ``status``; the rest are counted (``status --json`` has them all).
WAITS_SHOWN = 12


def _render_waits(graph: dict[str, Any], out: TextIO) -> None:
    """Who waits for whom, then where the waits end (the sinks and cycles: each one hang)."""
    waits = graph.get("waits") or []
    if not waits:
        return
    out.write("who waits for whom:\n")
    lines = graphs.text({**graph, "waits": waits[:WAITS_SHOWN]})
    told = min(len(waits), WAITS_SHOWN)
    for line in lines[:told]:
        out.write(f"  {line}\n")
    if len(waits) > WAITS_SHOWN:
        out.write(f"  ... and {len(waits) - WAITS_SHOWN} more waits (status --json)\n")
    for line in lines[told:]:
        out.write(f"  {line}\n")


def render_status(data: dict[str, Any], out: TextIO = sys.stdout) -> None:
    colour = use_colour(out)
    now = data["job"].get("time") or time.time()
    job = data["job"]
    out.write(
        f"job {job.get('id') or '?'}: {job.get('registered', 0)}/{job.get('world_size', 0)} ranks registered, "
        f"stuck threshold {job.get('stuck_after', '?')} s\n"
    )
    behind = float(job.get("behind_s") or 0.0)
    if behind >= BEHIND_SHOWN_S:
        out.write(
            f"coordinator: {behind:.1f} s behind its batches (saturated): silences that long are its own, "
            "and judgements allow for them\n"
        )
    joining: dict[str, list[int]] = {}
    for rank, j in (job.get("joining") or {}).items():
        word = {"init": "in init_process_group", "starting": "not in init_process_group yet", "gone": "ended unjoined"}
        where = f" ({j['where']})" if j.get("where") else ""
        joining.setdefault(word.get(j.get("phase"), str(j.get("phase"))) + where, []).append(int(rank))
    if joining:
        out.write("joining: " + "; ".join(f"{ranks_label(sorted(r))} {w}" for w, r in joining.items()) + "\n")
    paths: dict[str, list[int]] = {}
    for rank in data["ranks"]:
        paths.setdefault(str(rank.get("via") or "direct"), []).append(rank["rank"])
    if paths:
        told = {"agent": "read by their node agent", "direct": "shipped by the rank itself (no agent linked)"}
        out.write(
            "records: "
            + "; ".join(f"{ranks_label(sorted(r))} {told.get(v, v)}" for v, r in sorted(paths.items()))
            + "\n"
        )
    budgets: dict[str, list[int]] = {}
    for rank in data["ranks"]:
        if rank.get("budget"):
            budgets.setdefault(str(rank["budget"]), []).append(rank["rank"])
    for note, ranks in sorted(budgets.items(), key=lambda kv: kv[1][0]):
        out.write(f"budget: {ranks_label(sorted(ranks))}: {note}\n")
    hooks: dict[str, list[int]] = {}  # ranks whose hook records in Python, by why
    offs: dict[str, list[int]] = {}  # ranks whose hook stopped recording calls, by why
    for rank in data["ranks"]:
        hook = str(rank.get("hook") or "")
        if hook.startswith("python"):
            hooks.setdefault(hook.removeprefix("python").lstrip(": ") or "unknown", []).append(rank["rank"])
        if rank.get("capture_off"):
            offs.setdefault(str(rank["capture_off"]), []).append(rank["rank"])
    for why, ranks in sorted(hooks.items(), key=lambda kv: kv[1][0]):
        out.write(f"hook: {ranks_label(sorted(ranks))} record calls in Python, not C: {why}\n")
    for why, ranks in sorted(offs.items(), key=lambda kv: kv[1][0]):
        out.write(_c(f"capture off: {ranks_label(sorted(ranks))} stopped recording calls: {why}", "31", colour) + "\n")
    groups: dict[str, list[int]] = {}
    for rank in data["ranks"]:
        groups.setdefault(_rank_line(rank, now), []).append(rank["rank"])
    for line, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        label = ranks_label(ranks)
        state_colour = "31" if ("died" in line or "frozen" in line) else ("33" if "waiting" in line else "32")
        out.write(f"  {_c(label.ljust(14), state_colour, colour)} {line}\n")
    _render_waits(data.get("graph") or {}, out)
    incidents = data.get("incidents") or []
    if incidents:
        out.write(_c(f"{len(incidents)} open incident(s):\n", "1;31", colour))
        for inc in incidents:
            out.write(f"  {inc['id']}  {inc['kind']:<17} {inc['summary']}\n")
    else:
        out.write("no open incidents\n")
    others = [j for j in data.get("jobs") or [] if not j.get("shown")]
    if others:
        out.write(f"{len(others)} other job(s) on this coordinator (status --job KEY):\n")
        for other in others:
            states = ", ".join(f"{n} {word}" for word, n in sorted((other.get("states") or {}).items()))
            opened = other.get("open_incidents") or 0
            out.write(
                f"  {other.get('key') or other.get('id') or '?'}  {other.get('registered', 0)}/"
                f"{other.get('world_size', 0)} ranks ({states or 'none yet'})"
                + (_c(f", {opened} open incident(s)", "1;31", colour) if opened else "")
                + "\n"
            )
    store = job.get("store") or {}
    if store.get("write_errors"):
        out.write(
            _c(
                f"warning: {store['write_errors']} incident write(s) failed: {store.get('last_error')}\n",
                "31",
                colour,
            )
        )


def render_incidents(incidents: list[dict[str, Any]], out: TextIO = sys.stdout) -> None:
    if not incidents:
        out.write("no incidents\n")
        return
    for inc in incidents:
        when = time.strftime("%H:%M:%S", time.localtime(inc["detected_time"]))
        out.write(
            f"{inc['id']}  {when}  {inc['status']:<8} {inc['kind']:<17} culprit {format_ranks(inc['culprit_ranks'])}"
            f"  {inc['summary']}\n"
        )


def without_hook(text: str) -> str:
    """A py-spy dump as a person wants to read it: hangwatch's own thread and wrapper frames out."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.startswith(("Process ", "Python v")):
            continue
        if line.startswith("Thread "):
            skipping = '"hangwatch-' in line
        if skipping or "hangwatch/client/" in line:
            continue
        out.append(line)
    return "\n".join(out)


def group_stacks(stacks: dict[str, str]) -> list[tuple[list[int], str]]:
    """Identical stacks across ranks shown once, with their rank list (thread ids aside)."""
    groups: dict[str, tuple[list[int], str]] = {}
    for rank, text in sorted(stacks.items(), key=lambda kv: int(kv[0])):
        shown = without_hook(text)
        key = re.sub(r"^Thread \d+ ", "Thread ", shown, flags=re.M)
        groups.setdefault(key, ([], shown))[0].append(int(rank))
    return sorted(groups.values(), key=lambda item: item[0][0])


def render_report(inc: dict[str, Any], out: TextIO = sys.stdout) -> None:
    colour = use_colour(out)
    title = KIND_TITLES.get(inc["kind"], inc["kind"])
    out.write(_c(f"{inc['id']}: {title}", "1;31" if inc.get("severity") == "error" else "1;33", colour) + "\n")
    out.write(f"  {inc['summary']}\n\n")
    lag = inc["detected_time"] - inc["onset_time"] if inc.get("onset_time") else 0.0
    rows = [
        ("status", inc["status"] + (f" ({inc['resolution']})" if inc.get("resolution") else "")),
        ("culprit ranks", format_ranks(inc["culprit_ranks"])),
        ("waiting ranks", format_ranks(inc["waiting_ranks"])),
        ("operation", inc.get("op") or "-"),
        ("group / seq", f"{inc.get('group') or '-'} / {inc.get('seq') or '-'}"),
        ("step", str(inc["step"]) if int(inc.get("step", -1)) >= 0 else "unknown"),
        (
            "onset",
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(inc["onset_time"])) if inc.get("onset_time") else "-",
        ),
        ("detected", f"{lag:.1f} s after onset"),
    ]
    for key, value in rows:
        out.write(f"  {key:<14} {value}\n")
    calls = (inc.get("details") or {}).get("calls") or {}
    if calls:
        out.write("\nper-rank calls:\n")
        for rank, text in sorted(calls.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
            out.write(f"  rank {rank}: {text}\n")
    absent = (inc.get("details") or {}).get("absent") or {}
    if absent:
        out.write("\nranks that did not arrive:\n")
        for rank, text in sorted(absent.items()):
            out.write(f"  rank {rank} {text}\n")
    details = inc.get("details") or {}
    skipped = details.get("skipped")
    if skipped:
        out.write(
            f"\nskipped call: rank {skipped.get('rank')} never made {skipped.get('op')} at "
            f"{skipped.get('call_site') or '?'} "
            f"({in_step(int(skipped.get('step', -1)), 'step {}, ')}seq {skipped.get('seq')})\n"
        )
    hosts = details.get("host") or {}
    if hosts:
        out.write("\non the GPU, not completed; where each host thread is:\n")
        for rank, where in sorted(hosts.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
            out.write(f"  rank {rank}: {where}\n")
    if details.get("timeout_at"):
        fires = time.strftime("%H:%M:%S", time.localtime(details["timeout_at"]))
        out.write(f"torch's own timeout fires at {fires}\n")
    if details.get("gpus"):
        out.write(f"GPUs: {details['gpus']}\n")
    repeats = details.get("repeats")
    if repeats:
        out.write(
            f"\nrepeated: {repeats.get('count')} more time(s) since, the latest at seq {repeats.get('last_seq')} "
            f"{in_step(int(repeats.get('last_step', -1)), '(step {})')}\n"
        )
    aftermath = details.get("aftermath")
    if aftermath:
        out.write(f"\naftermath (what this caused): {aftermath.get('summary', '')}\n")
    graph = details.get("graph")
    if graph:
        lines = graphs.text(graph)
        out.write("\nwho waited for whom (report --graph; --format dot to draw it):\n")
        out.write("".join(f"  {line}\n" for line in lines[:WAITS_SHOWN]))
        if len(lines) > WAITS_SHOWN:
            out.write(f"  ... and {len(lines) - WAITS_SHOWN} more lines (report --graph)\n")
    doing = details.get("stack_summary") or {}
    if doing:
        out.write("\nwhat the stacks show:\n")
        for rank, text in sorted(doing.items(), key=lambda kv: int(kv[0])):
            out.write(f"  rank {rank}: {text}\n")
    out.write(_c("\nhint: ", "1", colour) + inc["hint"] + "\n")
    stacks = inc.get("stacks") or {}
    if stacks:
        out.write("\nstacks:\n")
        for ranks, text in group_stacks(stacks):
            out.write(_c(f"--- {ranks_label(ranks)} ---", "1", colour) + "\n")
            out.write(text.rstrip() + "\n")
    for rank, note in sorted((inc.get("stack_notes") or {}).items()):
        out.write(f"(no stack for rank {rank}: {note})\n")


def render_analysis(analysis: Any, folder: Any, out: TextIO = sys.stdout) -> None:
    """``hangwatch analyze``: what was read, what it lacks, then each incident's full report."""
    ranks = analysis.ranks
    formats = sorted({f"{d.format} ({d.ring} ring{', with stack frames' if d.frames else ''})"
                      for d in folder.dumps.values()})  # fmt: skip
    out.write(
        f"Flight Recorder dumps of {len(ranks)} rank{'s' if len(ranks) != 1 else ''} of {analysis.world_size}: "
        f"{format_ranks(ranks)}; {', '.join(formats)}\n"
    )
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(analysis.as_of)) if analysis.as_of else "?"
    out.write(
        f"analysed as of the earliest dump, written {written} (the files' modification times: "
        "copies that did not keep them make calls in flight look as old as the copy)\n"
    )
    for rank, paths in sorted(folder.duplicates.items()):
        out.write(f"rank {rank}: {len(paths)} other dump(s) not used: {', '.join(paths)}\n")
    for note in analysis.notes:
        out.write(f"note: {note}\n")
    out.write("\n")
    if not analysis.incidents:
        out.write("no hang or mismatch in these dumps\n")
        return
    for i, inc in enumerate(analysis.incidents):
        if i:
            out.write("\n")
        render_report(inc.to_json(), out)


def render_import(result: dict[str, Any], out: TextIO = sys.stdout) -> None:
    """``hangwatch analyze --import``: what the coordinator did with the dumps."""
    out.write(f"imported the Flight Recorder dumps of ranks {result.get('ranks')} into job {result.get('job')}\n")
    if result.get("missing_ranks"):
        out.write(f"no dump of ranks {result['missing_ranks']}\n")
    if result.get("not_added"):
        out.write(f"  {result['not_added']} incident(s) the dumps show not added: imported before, or past the bound\n")
    for ident in result.get("attached") or []:
        out.write(f"  {ident}: the dumps' entries attached (hangwatch report {ident})\n")
    for ident in result.get("added") or []:
        out.write(f"  {ident}: found in the dumps only, added as found post-mortem (hangwatch report {ident})\n")
    if not result.get("attached") and not result.get("added"):
        out.write("  no incident of the job is in the dumps, and the dumps show none\n")
    for note in result.get("notes") or []:
        out.write(f"note: {note}\n")
