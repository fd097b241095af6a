"""Fakes for the hook's own seams, shared by the client unit tests.

- :class:`FakeProcessGroup` / :class:`FakeC10d`: what ``Recorder`` reads of torch's c10d (a
  group's name and sequence number; its members, backend and rank translation). Injected through
  ``Recorder(rank, queue, c10d)`` and the ``group=`` argument, as ``capture`` does.
- :class:`FakeWork`: an async work handle (``is_completed``).
- :func:`make_session`: a real ``Session`` (real queue and recorder) over :class:`FakeC10d`.

Nothing here replaces hangwatch code: only torch and the network are faked.
"""

from __future__ import annotations

from typing import Any

from hangwatch import records as r
from hangwatch.client.session import Session


class FakeProcessGroup:
    """A process group whose sequence number the test advances, as the backend would."""

    def __init__(self, name: str, desc: str = "") -> None:
        self.group_name = name
        self.group_desc = desc
        self.seq = 0  # collectives and p2p ops issued so far (torch counts both)

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


class _World:
    def __init__(self) -> None:
        self.pg_group_ranks: dict[Any, dict[int, int]] = {}


class FakeC10d:
    """The few ``torch.distributed.distributed_c10d`` functions the recorder calls."""

    def __init__(self, rank: int = 0, world_size: int = 2, backend: str = "gloo") -> None:
        self.rank = rank
        self.backend = backend
        self._world = _World()
        self.default = self.new_group("0", list(range(world_size)), desc="default_pg")
        self.default_lookups = 0

    def new_group(self, name: str, ranks: list[int], desc: str = "") -> FakeProcessGroup:
        pg = FakeProcessGroup(name, desc)
        self._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}  # global -> group rank
        return pg

    def _get_default_group(self) -> FakeProcessGroup:
        self.default_lookups += 1
        return self.default

    def get_backend(self, pg: Any = None) -> str:
        return self.backend

    def get_global_rank(self, pg: Any, group_rank: int) -> int:
        for global_rank, local in self._world.pg_group_ranks[pg].items():
            if local == group_rank:
                return global_rank
        raise ValueError(f"group rank {group_rank} not in group")

    def get_group_rank(self, pg: Any, global_rank: int) -> int:
        return self._world.pg_group_ranks[pg][global_rank]


class FakeWork:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def identity(rank: int = 0) -> r.RankIdentity:
    return r.RankIdentity(job_id="job", rank=rank, world_size=2, host="node", pid=1234, session="s1")


def make_session(rank: int = 0, c10d: FakeC10d | None = None) -> Session:
    """A real Session (its Sender is built, not started) over a fake c10d, its default group known
    (as ``session.after_init`` leaves it) and its queue empty."""
    session = Session(identity(rank), "127.0.0.1:1", None, c10d or FakeC10d(rank))
    session.recorder.default_pg = session.recorder.c10d._get_default_group()
    session.recorder.group_info(session.recorder.default_pg)
    session.queue.drain(10)
    return session
