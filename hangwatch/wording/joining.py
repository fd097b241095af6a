"""The sentences of a rank before it joined: ranks waiting in ``init_process_group`` for one
not in it (``diagnosis.detectors.joins``), and the rendezvous that never completes."""

from __future__ import annotations

from collections.abc import Sequence

from hangwatch.wording import format_ranks, ranks_label


def joined() -> str:
    return "the ranks left init_process_group (the job's ranks joined, or those waiting gave up)"


def never_entered(rank: int, pid: int, host: str, where: str) -> str:
    if where:
        return f"rank {rank} never entered init_process_group: it is in {where} (pid {pid} on {host})"
    return f"rank {rank} never entered init_process_group: its process (pid {pid} on {host}) runs"


def inside_init(rank: int, pid: int, host: str) -> str:
    return f"rank {rank} is still inside init_process_group (pid {pid} on {host})"


def gone_unjoined(rank: int, pid: int, host: str) -> str:
    return f"rank {rank}'s process (pid {pid} on {host}) ended before it joined"


def never_seen(rank: int) -> str:
    return (
        f"rank {rank} never joined, and no process of it was seen (none linked to a node agent: it never "
        "started, or its node runs no agent)"
    )


def never_joined(waiting: Sequence[int], waited_s: float, absent: Sequence[str]) -> str:
    return f"{ranks_label(waiting)} wait in init_process_group for {waited_s:.0f} s; " + "; ".join(absent)


def rendezvous_stalled(ranks: Sequence[int], waited_s: float, launch: str) -> str:
    at = f" at {launch}" if launch else ""
    return (
        f"every rank ({format_ranks(ranks)}) waits in init_process_group for {waited_s:.0f} s and none has "
        f"left it: the rendezvous{at} does not complete"
    )


JOIN_HINT = (
    "A rank joins the job when its init_process_group returns, and every rank must enter it. Look at what "
    "the rank named does before init_process_group (a download, data preparation, a file lock): do that work "
    "before the launch, or on every rank after init_process_group. A rank never seen: look at its launcher's "
    "log on its node."
)

RENDEZVOUS_HINT = (
    "Every rank is in init_process_group and none leaves: check that MASTER_ADDR:MASTER_PORT is reachable "
    "from every node (a firewall; the right interface: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), that every "
    "launcher was given the same world size and rendezvous id, and that no other job holds the port."
)
