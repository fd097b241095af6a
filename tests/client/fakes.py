"""Fakes for the hook's own seams, shared by the client unit tests.

- :class:`FakeProcessGroup` / :class:`FakeC10d`: what ``Recorder`` reads of torch's c10d (a
  group's name and sequence number; its members, backend and rank translation). Injected through
  ``Recorder(rank, sink, c10d)`` and the ``group=`` argument, as ``capture`` does.
- :class:`FakeWork`: an async work handle (``is_completed``).
- :class:`FakeTensor` (``ones``), :class:`FakeDtype`, :class:`FakeReduceOp`: what the hook reads of
  tensors and reduce ops, so that the hook's own tests need no torch (``scripts/check_native.py``
  runs them on every Python, where torch is not installed).
- :func:`make_session`: a real ``Session`` (real ring and recorder) over :class:`FakeC10d`.
- :class:`RingTap`: reads a rank's ring back as typed events, one per record (a call and its
  exit apart), as a reader outside the rank would find them.

Nothing here replaces hangwatch code: only torch and the network are faked.
"""

from __future__ import annotations

import weakref
from typing import Any

from hangwatch import records as r
from hangwatch import wire
from hangwatch.client.recorder import Recorder
from hangwatch.client.ringsink import RingSink
from hangwatch.client.session import Session
from hangwatch.protos import hangwatch_pb2 as pb
from hangwatch.ring import Batch, Kind, RingReader
from hangwatch.ringwire import TAG_CALL, TAG_EVENT, TAG_TEXT


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


class FakeDtype:
    """A tensor dtype as torch spells it (``torch.float32``); one object per dtype, compared by
    identity, as torch's are."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


FLOAT32, FLOAT64 = FakeDtype("float32"), FakeDtype("float64")


class FakeTensor:
    """What the hook reads of a tensor: its shape, dtype and device (``ones(4)``, ``ones(2, 3)``)."""

    def __init__(self, *shape: int, dtype: FakeDtype = FLOAT32) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.is_cuda = False


def ones(*shape: int, dtype: FakeDtype = FLOAT32) -> FakeTensor:
    return FakeTensor(*shape, dtype=dtype)


class FakeReduceOp:
    """A reduce op, as torch's ``ReduceOp.MAX`` reads: its ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name


REDUCE_MAX = FakeReduceOp("MAX")


class FakeWork:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def identity(rank: int = 0) -> r.RankIdentity:
    return r.RankIdentity(job_id="job", rank=rank, world_size=2, host="node", pid=1234, session="s1")


class SlotDecoder:
    """Typed events from ring slots, one per record (a call and its exit apart)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.blobs: dict[int, bytes] = {}

    def decode(self, batch: Batch) -> list[r.RankEvent]:
        self.blobs.update(batch.blobs)
        out: list[r.RankEvent] = []
        for s in batch.slots:
            blob = self.blobs.get(s.ref, b"")
            if s.kind == Kind.ENTER:
                assert blob.startswith(TAG_CALL), f"call {s.call_id} names no signature"
                call = wire.call_from_pb(self.rank, pb.Call.FromString(blob[1:]))
                call.call_id, call.seq, call.step, call.enter_time = s.call_id, s.seq, s.step, s.time
                out.append(call)
            elif s.kind == Kind.EXIT:
                error = blob[1:].decode() if blob.startswith(TAG_TEXT) else None
                out.append(r.CallExit(self.rank, s.call_id, s.time, error, s.aux or 1))
            elif s.kind == Kind.STEP:
                out.append(r.StepEvent(self.rank, s.step, s.time))
            elif s.kind == Kind.EVENT and blob.startswith(TAG_EVENT):
                out.append(wire.event_from_pb(self.rank, pb.Event.FromString(blob[1:])))
        return out


class RingTap:
    """Reads what a rank wrote into its ring, as typed events: what an agent would find there."""

    def __init__(self, sink: RingSink, rank: int = 0) -> None:
        self.reader = RingReader(sink.fd)
        self.decoder = SlotDecoder(rank)

    @property
    def lost(self) -> int:
        return self.reader.lost

    def drain(self, limit: int = 100_000) -> list[r.RankEvent]:
        return self.decoder.decode(self.reader.poll(limit))


_TAPS: weakref.WeakKeyDictionary[Recorder, RingTap] = weakref.WeakKeyDictionary()


def recorded(rec: Recorder) -> list[r.RankEvent]:
    """What ``rec`` wrote into its ring since the last look, one event per record."""
    tap = _TAPS.get(rec)
    if tap is None:
        tap = _TAPS[rec] = RingTap(rec.sink, rec.rank)
    return tap.drain()


def lost(rec: Recorder) -> int:
    """Records of ``rec`` overwritten before :func:`recorded` got to them."""
    return _TAPS[rec].lost


def make_session(
    rank: int = 0, c10d: FakeC10d | None = None, *, announce: bool = True, ring: int | None = None
) -> Session:
    """A real Session (its Sender is built, not started; no node agent) over a fake c10d, its
    default group known and announced in its ring (as ``session.after_init`` leaves it), or,
    with ``announce=False``, announced by the first call. ``ring``: its ring's size."""
    session = Session(identity(rank), "127.0.0.1:1", None, c10d or FakeC10d(rank), None)
    if ring is not None:
        session.sink = session.recorder.sink = RingSink(ring, rank=rank)
    session.recorder.default_pg = session.recorder.c10d._get_default_group()
    if announce:
        session.recorder.group_info(session.recorder.default_pg)
    return session
