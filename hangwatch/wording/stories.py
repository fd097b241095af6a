"""Every sentence an incident tells: the model's edits, the wait-for graph's lines, the sinks'
stories (a death, a freeze, a node stopped), the waits and the mismatches."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from hangwatch import catalogue
from hangwatch.records import SEND_OPS, CallRecord, ProcessStatus, ProcState, RankEnd
from hangwatch.records import EndKind as RankEndKind
from hangwatch.wording import conj, format_ranks, gpu_faults, in_step, ranks_label

# --------------------------------------------------------------------------------------------
# Stories of the model (``hangwatch.model``): where a rank's trace parted from the others'


def call_at(c: CallRecord) -> str:
    """``all_reduce at train.py:9 in step`` / ``all_gather issued from C++ (gloo:all_gather)``."""
    op = catalogue.canonical_op(c.op)
    if not c.call_site:
        return op
    return f"{op} {c.call_site}" if c.call_site.startswith("issued from") else f"{op} at {c.call_site}"


def _step(step: int, more: str = "") -> str:
    parts = [f"step {step}"] if step > 0 else []
    parts += [more] if more else []
    return f" ({', '.join(parts)})" if parts else ""


def never_called(culprits: Sequence[int], theirs: CallRecord, others: Sequence[int], mine: CallRecord) -> str:
    """Ranks at one place of the program in another call than the others', nothing yet showing
    which of the two calls is the program's own: only what is seen."""
    site = f" ({theirs.call_site})" if theirs.call_site else ""
    return (
        f"{ranks_label(culprits)} never called {catalogue.canonical_op(theirs.op)}{site}, which {ranks_label(others)} "
        f"{'is' if len(set(others)) == 1 else 'are'} in (group {theirs.group}, seq {theirs.seq}); "
        f"{'it is' if len(set(culprits)) == 1 else 'they are'} in {call_at(mine)}"
    )


def skipped_went_on(culprit: int, skipped: CallRecord, step: int, went_on: CallRecord, seq: int) -> str:
    """A rank that skipped a call and went on to the next, which met the others' skipped one."""
    return (
        f"rank {culprit} skipped {call_at(skipped)}{_step(step)} and went on to its next call, "
        f"{call_at(went_on)}, which met it (group {skipped.group}, seq {seq})"
    )


def skipped_ran_out(
    culprit: int, skipped: CallRecord, step: int, forward: int, others: Sequence[int], behind: int
) -> str:
    """A rank that skipped a call, carried on with its calls meeting the others' next ones, and
    ran out of calls before them. A call DDP's backward issues (from C++) skipped after a
    forward pass is told as that forward pass without its backward."""
    who = ranks_label(others)
    count = "one" if behind <= 1 else str(behind)
    op = catalogue.canonical_op(skipped.op)
    if forward and skipped.source != "python":
        return (
            f"rank {culprit} ran forward pass {forward}{_step(step)} without its backward and carried on: it never "
            f"made that step's gradient {call_at(skipped)}, so from there on each of its {op}s met {who}'s next one "
            f"and it ran out of them {count} before {who}"
        )
    return (
        f"rank {culprit} skipped {call_at(skipped)}{in_step(step)} (seq {skipped.seq}) and carried on: from there on "
        f"each of its calls met {who}'s next one, so it ran out of them {count} before {who}"
    )


def fewer_calls(culprit: int, call: CallRecord, others: Sequence[int], behind: int) -> str:
    """A rank one call short where every round looks alike: a skip and an early end read the same."""
    count = "one" if behind <= 1 else str(behind)
    return (
        f"rank {culprit} made {count} {catalogue.canonical_op(call.op)} fewer than {ranks_label(others)} "
        f"({call_at(call)}): it skipped {'one' if behind <= 1 else 'some'}, or left its loop early; where, its calls "
        f"cannot tell (every round makes the same ones)"
    )


def extra_call(culprit: int, extra: CallRecord, step: int, others: Sequence[int], behind: int) -> str:
    """A rank that made a call the others did not, its later calls lining up after it."""
    who = ranks_label(others)
    count = "one" if behind <= 1 else str(behind)
    return (
        f"rank {culprit} made an extra {call_at(extra)}{_step(step, f'seq {extra.seq}')}; every later call "
        f"on rank {culprit} met {who}'s call before, so {who} ran out of calls {count} before it"
    )


# ---- the wait-for graph (``status``) ----------------------------------------------------------

#: How a sink stops the waits that reach it.
_SINK_WORDS = {
    "died": "died",
    "frozen": "is frozen (silent)",
    "ended": "ended",
    "busy": "is busy outside the call",
    "unknown": "was never heard from",
}


def wait_line(waiters: Sequence[int], op: str, group: str, seq: int, on: Sequence[int]) -> str:
    """``"ranks 0, 2 wait in all_reduce (group 1, seq 5) for rank 1"``."""
    return f"{ranks_label(waiters)} {conj('wait', waiters)} in {op} (group {group}, seq {seq}) for {ranks_label(on)}"


def hang_line(ranks: Sequence[int], stand: str, upstream: Sequence[int]) -> str:
    """One sink or cycle, and whom it holds up."""
    held = f"holding up {ranks_label(upstream)}"
    if stand == "cycle":
        return f"{ranks_label(ranks)} wait for each other (a cycle), {held}"
    return f"{ranks_label(ranks)} {_SINK_WORDS.get(stand, stand)}, {held}"


# --------------------------------------------------------------------------------------------
# Deaths, freezes, stragglers: the sinks' stories


def then_failed(ranks: Sequence[int], them: str = "them") -> str:
    """``"; ranks 0, 1 then failed or wait for them"`` (empty for no ranks)."""
    if not ranks:
        return ""
    return f"; rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} then failed or wait for {them}"


def died(rank: int, how: str, in_call: str, affected: Sequence[int]) -> str:
    """``"rank 2 died: its process was killed by SIGKILL inside broadcast ...; ranks 0, 1 then ..."``."""
    return f"rank {rank} died: {how}{in_call}" + then_failed(affected, "it")


def same_error(culprits: Sequence[int], detail: str, site: str, rest: Sequence[int]) -> str:
    """Several ranks raised one exception at one place: a cause they share, not a chain."""
    where = f" at {site}" if site else ""
    return f"ranks {format_ranks(culprits)} each raised {detail}{where}: the same error on each, not a chain" + (
        then_failed(rest)
    )


def node_stopped(host: str, stopped: Sequence[int], signal: str, rest: Sequence[int]) -> str:
    """Every rank of one node ended by a stop signal together while the other nodes' ran on."""
    return (
        f"node {host} was stopped from outside: its rank{'s' if len(stopped) > 1 else ''} "
        f"{format_ranks(stopped)} got {signal} together while the other nodes' ranks ran on" + then_failed(rest)
    )


def frozen(rank: int, pid: int, host: str, how: str, silence_s: float, last: CallRecord | None,
           waiting: Sequence[int]) -> str:  # fmt: skip
    """A live rank silent past the threshold. The text stays the same while the silence grows
    (its length is in the incident's details): an open incident is not rewritten every tick."""
    where = f"; last seen {'in' if last.exit_time is None else 'after'} {last.op} at {last.call_site}" if last else ""
    text = f"rank {rank} (pid {pid} on {host}) {how}; no heartbeat for over {silence_s:.0f} s{where}"
    if waiting:
        text += f"; rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} wait for it"
    return text


def straggler(rank: int, count: int, recent: int, group: str, margin_s: float) -> str:
    return (
        f"rank {rank} arrived last at {count} of the last {recent} collectives of group {group}, "
        f"{margin_s:.1f} s after the median rank on average"
    )


def p2p_unmatched(c: CallRecord, theirs: str, waited_s: float) -> str:
    """A blocked send or recv whose peer is doing something else (``theirs``)."""
    mine = f"rank {c.rank} {'sends to' if c.op in SEND_OPS else 'receives from'} rank {c.peer}"
    return f"p2p mismatch in group {c.group}: {mine}, but rank {c.peer} is {theirs} (for {waited_s:.0f} s)"


def death(end: RankEnd | None, proc: ProcessStatus | None, signal: str) -> str:
    """How a rank ended, from its own word (``end``) or else what its node agent saw of its
    process (``signal``: the name of the signal that killed it, if one did)."""
    if end is None:
        how = "its process disappeared without a word (SIGKILL, the OOM killer, or a native crash)"
        if proc is not None and proc.oom_killed:
            how = "it was killed by the OOM killer (its cgroup's oom_kill count went up)"
            if proc.signal:
                how += f": {signal} (signal {proc.signal})"
        elif proc is not None and proc.signal:
            how = f"its process was killed by {signal} (signal {proc.signal})"
        elif proc is not None and proc.exit_code is not None:
            how = f"its process exited with code {proc.exit_code}"
        return how + gpu_faults(proc)
    where = f" at {end.call_site}" if end.call_site else ""
    if end.kind is RankEndKind.EXCEPTION:
        return f"it raised {end.detail}{where}{gpu_faults(proc)}"
    if end.kind is RankEndKind.SIGNAL:
        return f"it received {end.detail}{where}{gpu_faults(proc)}"
    return f"it ended ({end.kind.value}){where}"


def _ended(end: RankEnd) -> str:
    """``"exited at train.py:40"``: how a rank left, where it says."""
    action = "called destroy_process_group()" if end.kind is RankEndKind.DESTROYED else "exited"
    return action + (f" at {end.call_site}" if end.call_site else "")


def left_early(rank: int, step: int, end: RankEnd, waiting: Sequence[int], op: str, group: str, seq: int) -> str:
    """A rank that ended cleanly while others entered a collective of the next step."""
    return (
        f"rank {rank} left the training loop after step {step} and {_ended(end)}, while "
        f"rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} entered {op} "
        f"(group {group}, seq {seq}) of the next step and never got an answer"
    )


def ran_out_then_ended(
    waiting: Sequence[int], op: str, group: str, seq: int, rank: int, clause: str, end: RankEnd
) -> str:
    """A rank that skipped a call (or that the others made one more than), ran out, and ended."""
    return (
        f"rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} wait{'' if len(waiting) > 1 else 's'} in "
        f"{op} (group {group}, seq {seq}) and rank {rank} will never make it: {clause}; rank {rank} then "
        f"{_ended(end)}"
    )


# --------------------------------------------------------------------------------------------
# Mismatches: what the rules found, as the detector tells it


def provisional(arrived: int, size: int) -> str:
    """Appended to a mismatch whose sides cannot be told apart yet."""
    return (
        f" ({arrived} of {size} ranks have arrived: which side is wrong is not known yet, "
        "it is told as the others arrive)"
    )


def in_final_barrier(
    culprits: Sequence[int], others: Sequence[int], other_op: str, group: str, seq: int, step: int, mismatch: str
) -> str:
    """One side waits in a barrier the others never reach: it left the loop early."""
    return (
        f"rank{'s' if len(culprits) > 1 else ''} {format_ranks(culprits)} left the loop and wait in a final "
        f"barrier while rank{'s' if len(others) > 1 else ''} {format_ranks(others)} entered {other_op} "
        f"(group {group}, seq {seq}){in_step(step, ' at step {}')}: {mismatch}"
    )


def repeated(repeats: int, last_seq: int, last_step: int) -> str:
    """Appended to a mismatch a loop made again."""
    times = "time" if repeats == 1 else "times"
    return f"; the same mismatch came back {repeats} {times} since, the latest at seq {last_seq}" + in_step(
        last_step, " (step {})"
    )


def group_members_differ(name: str, views: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str:
    """One group name bound to different members on different ranks (``views``: (ranks, members))."""
    lines = "; ".join(
        f"rank{'s' if len(rks) > 1 else ''} {format_ranks(rks)}: {list(members)}" for rks, members in views
    )
    return (
        f"process group {name} has different members on different ranks ({lines}): "
        "new_group was called in a different order"
    )


# --------------------------------------------------------------------------------------------
# Waits: a slot some members never reached


def then(clause: str) -> str:
    """``"; clause"``, or nothing for no clause."""
    return f"; {clause}" if clause else ""


def waiting_in(waiting: Sequence[int], where: str, waited_s: float, site: str = "") -> str:
    """``"ranks 0, 2 wait in all_reduce (group 0, seq 5) at train.py:9 for 12 s"``."""
    at = f" at {site}" if site else ""
    return f"{ranks_label(waiting)} {conj('wait', waiting)} in {where}{at} for {waited_s:.0f} s"


def entered_and_wait(waiting: Sequence[int], where: str, site: str, waited_s: float) -> str:
    at = f" at {site}" if site else ""
    return f"{ranks_label(waiting)} entered {where}{at} and {conj('wait', waiting)} for {waited_s:.0f} s"


def no_dump(ranks: Sequence[int]) -> str:
    return f"; rank(s) {format_ranks(ranks)} wrote no Flight Recorder dump: what they did instead is unknown"


def never_registered(ranks: Sequence[int]) -> str:
    return f"; rank(s) {format_ranks(ranks)} never registered with hangwatch"


NO_DUMP_HINT = (
    "Look at those ranks' logs: a rank that died or was killed writes no dump, nor may one frozen "
    "holding the GIL; a rank that wrote its dump elsewhere (TORCH_FR_DUMP_TEMP_FILE) can be added."
)
NEVER_REGISTERED_HINT = "Check that every rank started and has HANGWATCH_ADDR set; look at its launcher's logs."
TRANSPORT_STALL_HINT = (
    "The ranks agree, so the backend is stuck: check the network (NCCL_DEBUG=INFO, "
    "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), a failed NIC or switch, or a GPU that stopped "
    "responding; the native stacks show where each rank waits."
)


def never_reached_hint(absent: Sequence[int], op: str) -> str:
    plural = len(absent) > 1
    return (
        f"Rank{'s' if plural else ''} {format_ranks(absent)} never reached this {op}. Look at "
        f"{'their' if plural else 'its'} stack below: work that only some ranks do (a checkpoint save or "
        "evaluation on rank 0, a data loader that stalls, a conditional branch) must either be done by every "
        "rank or finish before the others' next collective; if it is legitimately long, raise --stuck-after."
    )


def transport_stalled(members: int, group: str, op: str, seq: int, how: str, waited_s: float, device: str) -> str:
    return (
        f"all {members} ranks of group {group} entered {op} (seq {seq}) with matching arguments and none has "
        f"{how} after {waited_s:.0f} s: the transport is stalled" + then(device)
    )


def inside_unread(ranks: Sequence[int], group: str) -> str:
    """Ranks inside a C++-issued collective whose Flight Recorder entries were overwritten unread."""
    plural = len(ranks) > 1
    return (
        f"; rank{'s' if plural else ''} {format_ranks(ranks)} {'are' if plural else 'is'} inside a collective "
        f"of group {group} that C++ issued, {'their' if plural else 'its'} Flight Recorder entr"
        f"{'ies' if plural else 'y'} overwritten before {'they were' if plural else 'it was'} read (a busy ring)"
    )


def held_on_gpu(hosts: Mapping[int, str], timeout_at: float, now: float) -> str:
    """Ranks whose call was enqueued on the GPU and has not completed there, their host threads
    gone on (``hosts``: where each waits now), and when torch's own timeout fires (0: unknown)."""
    many = len(hosts) > 1
    places = "; ".join(f"rank {rk} in {where}" for rk, where in sorted(hosts.items()))
    text = (
        f"rank{'s' if many else ''} {format_ranks(sorted(hosts))} enqueued it on the GPU, where it has not "
        f"completed; {'their' if many else 'its'} host thread{'s' if many else ''} returned and "
        f"{'wait' if many else 'waits'} at the next synchronisation ({places})"
    )
    if timeout_at:
        fires = time.strftime("%H:%M:%S", time.localtime(timeout_at))
        text += f"; torch's own timeout fires at {fires}, in {max(0.0, timeout_at - now):.0f} s"
    return text


def left_its_loop(rank: int, steps: str, function: str, last: CallRecord, doing: str) -> str:
    """A live rank out of the function its loop's calls came from."""
    return (
        f"rank {rank} left its loop at step {steps}: it returned from {function}, where its last "
        f"{last.op} ({last.call_site}, step {last.step}) came from, and {doing}"
    )


def left_the_loop(ranks: Sequence[int], steps: str, doing: str) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} left the training loop at step {steps} ({doing})"


SAME_ERROR_HINT = (
    "The same exception on several ranks is a cause they share (configuration, input data, an "
    "environment difference from what the code expects): fix it once from the traceback above."
)

NODE_STOPPED_HINT = (
    "Nothing in the training code: the node or its launcher was stopped by something outside the job "
    "(a spot or preemptible instance reclaimed, a node drained, its torchrun killed). Look at the "
    "scheduler's and the node's logs; an elastic launcher (torchrun --max-restarts) can outlive it."
)

DIED_HINT = (
    "Fix the error on the culprit rank (its exception and frame are above); the other ranks only "
    "failed because it left. If it was killed without a word, check dmesg for the OOM killer and "
    "the launcher's logs."
)


# --------------------------------------------------------------------------------------------
# Hints and states the detectors and the engine pick among

SKIPPED_HINT = (
    "Every rank must make the same collectives in the same order. A rank that skips a step on its own "
    "(a NaN or inf loss, an empty batch, a condition only it sees) must agree on the skip with the others: "
    "all_reduce the skip flag (ReduceOp.MAX) and let every rank skip together, or skip only local work."
)

EXTRA_HINT = (
    "Every rank must make the same collectives in the same order. A collective only some ranks make (a "
    "metric or a norm logged on one rank, a debug check) must be made by every rank of its group, or by none."
)

#: How a silent rank's process is, by its kernel state.
FROZEN_STATE = {
    ProcState.STOPPED: "is stopped (SIGSTOP or a debugger)",
    ProcState.DISK_SLEEP: "is in uninterruptible sleep (D state: I/O or a driver call)",
    ProcState.RUNNING: "is running but its Python threads cannot run (likely the GIL held in native code)",
    ProcState.SLEEPING: "is sleeping while holding the interpreter (likely the GIL held in a native wait)",
}


def frozen_how(state: ProcState | None) -> str:
    if state is None:
        return "has gone silent and no node agent reports on its process"
    return FROZEN_STATE.get(state, f"is alive ({state.value}) but silent")


def will_never_make_it(rank: int, clause: str, doing: str) -> str:
    return f" and rank {rank} will never make it: {clause}; rank {rank} {doing}"


def p2p_hint(rank: int, peer: int, both_send: bool, both_recv: bool, sites: Sequence[tuple[str, int]]) -> str:
    """``sites``: (call site, rank) of the call and of the peer's."""
    where = " and ".join(f"{site} on rank {rk}" if site else f"rank {rk}" for site, rk in sites)
    if both_send:
        return (
            f"ranks {rank} and {peer} both send first and wait for the other to receive: order the calls "
            "so one side receives first (e.g. even ranks send first, odd ranks receive first) or use "
            f"batch_isend_irecv; check {where}"
        )
    if both_recv:
        return f"ranks {rank} and {peer} both wait to receive from each other: one side must send first; check {where}"
    return (
        "every send needs a matching recv on the peer, in the same group and in the same order; "
        f"check the order of the send/recv calls at {where}"
    )


def aftermath_of(root_id: str, kind: str) -> str:
    return f"the aftermath of {root_id} ({kind}), which tells it"


def told_again(verdict_id: str, kind: str) -> str:
    return f"told again as {verdict_id} ({kind}) once the calls at its slot were read"


def went_past(op: str, seq: int, late: str) -> str:
    return f"the ranks went past {op} (seq {seq}); late rank(s): {late or '-'}"


def all_completed(op: str, seq: int, late: str) -> str:
    return f"every rank completed {op} (seq {seq}); late rank(s): {late or '-'}"


# --------------------------------------------------------------------------------------------
# A rank waiting on its own processes; a NCCL communicator made in a first collective


def waits_for_own(where_user: str, children: Sequence[tuple[int, str, str]]) -> str:
    """A rank waiting for its own processes (pid, what, where each): a DataLoader's worker."""
    at = f" in {where_user}" if where_user else ""
    told = "; ".join(f"{what} (pid {pid}), which is in {where}" for pid, what, where in children)
    return f"waits{at} for its {told}"


COMMUNICATOR_CLAUSE = (
    " (the group's first collective: NCCL creates its communicator in it, so the ranks inside may "
    "wait on one that never forms)"
)
