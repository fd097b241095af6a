"""Load generator: N simulated ranks speaking the real wire protocol to a coordinator.

    .venv/bin/python bench/loadgen.py --addr 127.0.0.1:PORT --ranks 1024 --rate 10 --seconds 20
    .venv/bin/python bench/loadgen.py ... --pattern mixed --fault shape --fault-rank 7 --fault-at 5

Each simulated rank owns a session and its own ``hangwatch.client.transport.Transport`` (its own
gRPC channel), registers, then sends one ``Report`` batch every 0.2 s like the real sender
(``SEND_INTERVAL_S``): the ``CallRecord`` (enter) and ``CallExit`` (exit) events of the
collectives whose scheduled time has passed, plus ``StepEvent``/``GroupEvent``/``RankEnd`` where
the pattern has them. A rank has at most one batch in flight (the real sender is one thread);
a failed batch is resent with the next one, as the real sender does.

All ranks follow one global schedule: collective ``i`` is entered at ``t0 + i / rate`` and left
half a period later, so sequence numbers agree per group across ranks exactly like torch's
process groups number their collectives. Patterns:

* ``ddp``      bucketed ``all_reduce`` on group "0" (4 buckets per step)
* ``fsdp``     per layer ``all_gather_into_tensor`` (forward) then ``reduce_scatter_tensor``
               (backward, reverse layer order) on group "0", 8 layers
* ``pipeline`` a ring of ``send``/``recv`` between neighbouring pipeline stages (4 stages per
               pipeline group, announced with ``GroupEvent``); pair seqs count per (src, dst)
* ``mixed``    tensor-parallel groups of 8 and strided data-parallel groups (announced), plus
               the world group: all_reduce tp, all_reduce tp, all_reduce dp, all_reduce world

Faults (rank ``--fault-rank``, from ``--fault-at`` seconds after t0, at collective index i_f):

* ``stuck``      rank K issues nothing from i_f on; the others enter i_f and never leave it
                 (calls on groups without K complete) and issue nothing after it
* ``shape`` / ``op`` / ``dtype``   rank K's call at the first index >= i_f on one of its groups
                 differs in shape / op / dtype; everyone carries on
* ``early_exit`` rank K finishes i_f - 1, sends a clean ``RankEnd`` and stops sending; the
                 others enter i_f and block

Ranks are spread over ``--procs`` OS processes (spawned before any gRPC channel exists); each
uses a thread pool to keep many batches in flight. Prints one JSON object (and writes it to
``--json``): offered/accepted events, RPC latency percentiles, how far behind its schedule the
generator itself ran, and the fault's onset time. Only talks to the address given (use
127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hangwatch.agent.relay import DEFAULT_INTERVAL_S as RELAY_INTERVAL_S
from hangwatch.agent.relay import MAX_INTERVAL_S as RELAY_MAX_INTERVAL_S
from hangwatch.client.sender import MAX_BATCH, SEND_INTERVAL_S
from hangwatch.columns import CallEncoder

PATTERNS = ("ddp", "fsdp", "pipeline", "mixed", "tp")
FAULTS = ("none", "stuck", "shape", "op", "dtype", "early_exit")
DDP_BUCKETS = 4
FSDP_LAYERS = 8
PP_STAGES = 4
TP_SIZE = 8
TP_LAYERS = 32  # tp: two all_reduces a layer, one step of 64
LATENCY_SAMPLES = 20_000  # per process, reservoir
REPLAY_BASE = 1_000_000.0  # replay mode: batches are built on this time base
#: A replayed rank's monotonic clock at ``REPLAY_BASE`` (a host up for a day).
REPLAY_MONO = 86_400.0
DEVICE_READ_S = 1.0  # --device: a rank's Flight Recorder read for its progress (the agent's interval)
DEVICE_LAG_S = 0.05  # --device: from a collective's enqueue to its completion on the device


@dataclass(frozen=True)
class Config:
    addr: str
    token: str
    ranks: int
    rate: float
    seconds: float
    pattern: str
    fault: str
    fault_rank: int
    fault_at: float
    job_id: str
    threads: int
    timeout_s: float
    relay: bool = False  # ranks report through one in-process node-agent Relay per node
    ranks_per_node: int = 8
    replay: bool = False  # build every batch before t0, then only send bytes on schedule
    relay_interval: float = RELAY_INTERVAL_S
    runs: bool = False  # calls alike as runs in one column entry (CallColumns.run), as agents send them
    #: a rank's calls that repeat a cycle folded before they go, across steps, as node agents
    #: fold them (``hangwatch.sendfold``); with ``runs``
    fold: bool = False
    #: NCCL ranks: a rank's batches carry its device progress on group "0" (``GroupProgress``), as
    #: a node agent reads it from Flight Recorder (at most every ``DEVICE_READ_S``); the device
    #: completes a collective ``DEVICE_LAG_S`` after it was enqueued
    device: bool = False
    #: each rank's batches this far apart (0: as the coordinator asks, ``report_interval_for``)
    interval_s: float = 0.0
    #: a node's ranks send on one beat, and a beat's batches go in one call at once (a node
    #: agent's shipper reads its steady ranks on one tick and sends them together, ``outbox``);
    #: replay only, with ``relay``
    together: bool = False


@dataclass(frozen=True)
class OpSpec:
    op: str
    group: str
    seq: int
    shape_in: tuple[int, ...]
    shape_out: tuple[int, ...] | None
    dtype: str
    reduce_op: str | None = None
    peer: int | None = None
    members: tuple[int, ...] | None = None  # None: the world


# ---- call patterns ----------------------------------------------------------------------------


class Pattern:
    """The op rank ``rank`` issues at global collective index ``i`` (0-based), and its groups."""

    def __init__(self, name: str, world: int) -> None:
        self.name = name
        self.world = world
        self.stages = min(PP_STAGES, world)
        self.tp = min(TP_SIZE, world)
        if name == "pipeline" and world % self.stages:
            raise SystemExit(f"pipeline needs a world size divisible by {self.stages}")
        if name == "mixed" and world % self.tp:
            raise SystemExit(f"mixed needs a world size divisible by {self.tp}")

    def ops_per_step(self) -> int:
        return {"ddp": DDP_BUCKETS, "fsdp": 2 * FSDP_LAYERS, "pipeline": 2, "mixed": 4, "tp": 2 * TP_LAYERS}[self.name]

    # groups: (name, members, creation index) for the groups a rank announces
    def groups_of(self, rank: int) -> list[tuple[str, tuple[int, ...], int]]:
        if self.name == "pipeline":
            lanes = self.world // self.stages
            lane = rank % lanes
            return [(str(1 + lane), tuple(lane + lanes * s for s in range(self.stages)), 1 + lane)]
        if self.name == "mixed":
            ntp = self.world // self.tp
            k = rank // self.tp
            j = rank % self.tp
            tp = (str(1 + k), tuple(range(k * self.tp, (k + 1) * self.tp)), 1 + k)
            dp = (str(1 + ntp + j), tuple(j + self.tp * m for m in range(ntp)), 1 + ntp + j)
            return [tp, dp]
        return []

    def op(self, rank: int, i: int) -> OpSpec:
        if self.name == "tp":  # the same activation all_reduce twice a layer, from one line
            return OpSpec("all_reduce", "0", i + 1, (4096, 1024), None, "bfloat16", "sum")
        if self.name == "ddp":
            bucket = i % DDP_BUCKETS
            return OpSpec("all_reduce", "0", i + 1, (6_553_600 - 1_000_000 * bucket,), None, "float32", "sum")
        if self.name == "fsdp":
            pos = i % (2 * FSDP_LAYERS)
            layer = pos if pos < FSDP_LAYERS else 2 * FSDP_LAYERS - 1 - pos
            shard = 65_536 + 4_096 * layer
            full = (shard * self.world,)
            if pos < FSDP_LAYERS:
                return OpSpec("all_gather_into_tensor", "0", i + 1, (shard,), full, "bfloat16")
            return OpSpec("reduce_scatter_tensor", "0", i + 1, full, (shard,), "bfloat16", "sum")
        if self.name == "pipeline":
            name, members, _ = self.groups_of(rank)[0]
            stage = members.index(rank)
            microbatch = i // 2
            if i % 2 == 0:
                peer = members[(stage + 1) % self.stages]
                return OpSpec("send", name, microbatch + 1, (8, 4096), None, "bfloat16", None, peer, members)
            peer = members[(stage - 1) % self.stages]
            return OpSpec("recv", name, microbatch + 1, (8, 4096), None, "bfloat16", None, peer, members)
        # mixed: cycle of 4 = tp, tp, dp, world
        cycle, pos = divmod(i, 4)
        tp, dp = self.groups_of(rank)
        if pos < 2:
            return OpSpec("all_reduce", tp[0], 2 * cycle + pos + 1, (4096, 1024), None, "bfloat16", "sum", None, tp[1])
        if pos == 2:
            return OpSpec("all_reduce", dp[0], cycle + 1, (1_048_576,), None, "float32", "sum", None, dp[1])
        return OpSpec("all_reduce", "0", cycle + 1, (1,), None, "float32", "max")


# ---- one simulated rank ----------------------------------------------------------------------


@dataclass
class RankSim:
    rank: int
    identity: Any  # records.RankIdentity
    transport: Any  # client.transport.Transport
    relay: Any = None  # agent.relay.Relay of its node, in relay mode
    encoder: Any = None  # columns.CallEncoder: calls in columns, as a rank's batches carry them
    interval: float = SEND_INTERVAL_S  # what the coordinator asked for at registration
    next_enter: int = 0
    next_exit: int = 0
    batch_seq: int = 0
    pending: list[Any] = field(default_factory=list)
    busy: bool = False
    next_due: float = 0.0
    announced: bool = False
    stopped: bool = False  # no more batches at all (early_exit culprit)
    ended: bool = False
    held: list[Any] = field(default_factory=list)  # --runs: a trailing call under way, held back once
    progress_due: float = 0.0  # --device: when its next device progress is read


@dataclass
class Stats:
    batches: int = 0
    batches_failed: int = 0
    reregistered: int = 0
    events_sent: int = 0  # events in batches the server answered
    events_offered: int = 0  # events in every attempt, including failed ones
    events_accepted: int = 0
    calls_sent: int = 0
    dropped: int = 0
    latencies: list[float] = field(default_factory=list)
    server_lags: list[float] = field(default_factory=list)  # reply.server_time - send start
    behind: list[float] = field(default_factory=list)  # how late a batch left vs its due time
    samples_seen: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class Worker:
    """Simulates ``ranks`` in one OS process."""

    def __init__(self, cfg: Config, ranks: list[int]) -> None:
        import grpc

        from hangwatch import records as r
        from hangwatch.agent.relay import CHANNEL_OPTIONS as RELAY_OPTIONS
        from hangwatch.client.transport import CHANNEL_OPTIONS, Transport

        # gRPC shares one connection among a process's channels to the same address; real ranks
        # and agents are separate processes, each with its own connection: so is every simulated one
        OWN_CONNECTION = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        RELAY_CONNECTION = [*RELAY_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]

        self.r = r
        self.cfg = cfg
        self.pattern = Pattern(cfg.pattern, cfg.ranks)
        self.period = 1.0 / cfg.rate
        self.duration = 0.5 * self.period
        self.t0 = 0.0
        self.fault_index = -1
        self.fault_target = -1  # index where the culprit's call differs (mismatch faults)
        self.stats = Stats()
        self.lock = threading.Lock()
        self.rng = random.Random(os.getpid())
        host = "sim-node-%d"
        now = time.time()
        self.sims: list[RankSim] = []
        for rk in ranks:
            ident = r.RankIdentity(
                job_id=cfg.job_id,
                rank=rk,
                world_size=cfg.ranks,
                host=host % (rk // 8),
                pid=100_000 + rk,
                local_rank=rk % 8,
                start_time=now,
                session=uuid.uuid4().hex,
                backend="nccl",
                torch_version="2.5.0",
                hook_version="loadgen",
            )
            transport = Transport(cfg.addr, cfg.token, timeout_s=cfg.timeout_s, options=OWN_CONNECTION)
            encoder = CallEncoder()
            encoder.send_runs = cfg.runs
            if cfg.runs and cfg.fold:
                from hangwatch.sendfold import SenderFold  # (not in a tree before it: ``batchcost --baseline``)

                encoder.fold = SenderFold()
            self.sims.append(RankSim(rk, ident, transport, encoder=encoder))
        self.relays: dict[int, Any] = {}
        self.replay_calls = 0
        if cfg.relay and not cfg.replay:  # a replay builds what relays would send itself
            from hangwatch.agent.relay import Relay

            for sim in self.sims:
                node = sim.rank // cfg.ranks_per_node
                if node not in self.relays:
                    self.relays[node] = Relay(
                        cfg.addr,
                        cfg.token,
                        host % node,
                        interval_s=cfg.relay_interval,
                        channel_factory=lambda: grpc.insecure_channel(cfg.addr, options=RELAY_CONNECTION),
                    )
                    self.relays[node].start()
                sim.relay = self.relays[node]

    # ---- schedule -----------------------------------------------------------------------

    def set_start(self, t0: float) -> None:
        self.t0 = t0
        if self.cfg.fault != "none":
            self.fault_index = max(1, int(self.cfg.fault_at * self.cfg.rate))
            self.fault_target = self.fault_index
            if self.cfg.fault in ("shape", "op", "dtype"):
                k = self.cfg.fault_rank
                while True:  # the first index on a group that has the culprit and >1 member
                    spec = self.pattern.op(k, self.fault_target)
                    if spec.op not in ("send", "recv"):
                        break
                    self.fault_target += 1
        for sim in self.sims:
            sim.next_due = t0 + sim.interval * self.beat(sim.rank)

    def beat(self, rank: int) -> float:
        """Where in its interval a rank sends (0 to 1): its own, or its node's (``together``)."""
        key = rank // self.cfg.ranks_per_node if self.cfg.together else rank
        return (key * 0.618) % 1.0

    def enter_time(self, i: int) -> float:
        return self.t0 + i * self.period

    def last_index(self, rank: int) -> int | None:
        """The last index a rank enters (inclusive), or None for no limit."""
        fault, k = self.cfg.fault, self.cfg.fault_rank
        if fault == "stuck":
            return self.fault_index - 1 if rank == k else self.fault_index
        if fault == "early_exit":
            return self.fault_index - 1 if rank == k else self.fault_index
        return None

    def never_exits(self, rank: int, i: int) -> bool:
        if self.cfg.fault not in ("stuck", "early_exit") or i != self.fault_index or self.cfg.device:
            return False  # (NCCL: the host returns from it; the device never completes it)
        spec = self.pattern.op(rank, i)
        k = self.cfg.fault_rank
        if spec.op in ("send", "recv"):
            return spec.peer == k
        return spec.members is None or k in spec.members

    def call(self, sim: RankSim, i: int) -> Any:
        r = self.r
        spec = self.pattern.op(sim.rank, i)
        op, shape_in, dtype, reduce_op = spec.op, spec.shape_in, spec.dtype, spec.reduce_op
        root: int | None = None
        if sim.rank == self.cfg.fault_rank and i == self.fault_target:
            if self.cfg.fault == "shape":
                shape_in = tuple(d + 1 for d in shape_in)
            elif self.cfg.fault == "dtype":
                dtype = "float16" if dtype != "float16" else "float32"
            elif self.cfg.fault == "op":
                op = "broadcast" if op != "broadcast" else "all_reduce"
                reduce_op = None
                root = 0 if spec.members is None else spec.members[0]
        outputs: tuple[Any, ...] = ()
        if spec.shape_out is not None:
            outputs = (r.TensorMeta(spec.shape_out, dtype, "cuda"),)
        extra: dict[str, str] = {}
        if spec.members is not None and op not in ("send", "recv"):
            extra["group_ranks"] = ",".join(map(str, spec.members))
        return r.CallRecord(
            rank=sim.rank,
            call_id=i + 1,
            op=op,
            group=spec.group,
            seq=spec.seq,
            inputs=(r.TensorMeta(shape_in, dtype, "cuda"),),
            outputs=outputs,
            reduce_op=reduce_op,
            root=root,
            peer=spec.peer,
            async_op=self.pattern.name == "ddp",
            step=i // self.pattern.ops_per_step(),
            call_site="layers.py:88 in forward"
            if self.pattern.name == "tp"
            else f"train.py:{120 + i % self.pattern.ops_per_step()}",
            enter_time=self.enter_time(i),
            source="python",
        )

    def events_until(self, sim: RankSim, now: float) -> list[Any]:
        r = self.r
        out: list[Any] = []
        if not sim.announced:
            sim.announced = True
            for idx, (name, members, index) in enumerate(self.pattern.groups_of(sim.rank)):
                info = r.GroupInfo(name, members, "nccl", index, f"group {idx}")
                out.append(r.GroupEvent(sim.rank, r.GroupEventKind.CREATED, info, self.t0, "train.py:40"))
        last = self.last_index(sim.rank)
        per_step = self.pattern.ops_per_step()
        while True:
            te = self.enter_time(sim.next_enter)
            if last is not None and sim.next_enter > last:
                te = float("inf")
            tx = float("inf")
            if sim.next_exit < sim.next_enter and not self.never_exits(sim.rank, sim.next_exit):
                tx = self.enter_time(sim.next_exit) + self.duration
            t = min(te, tx)
            if t > now:
                break
            if tx <= te:
                out.append(r.CallExit(sim.rank, sim.next_exit + 1, tx))
                sim.next_exit += 1
            else:
                i = sim.next_enter
                if i % per_step == 0:
                    out.append(r.StepEvent(sim.rank, i // per_step, te))
                out.append(self.call(sim, i))
                sim.next_enter += 1
        if (
            self.cfg.fault == "early_exit"
            and sim.rank == self.cfg.fault_rank
            and not sim.ended
            and now >= self.enter_time(self.fault_index)
        ):
            sim.ended = True
            out.append(r.RankEnd(sim.rank, r.EndKind.CLEAN_EXIT, self.enter_time(self.fault_index), "exit code 0"))
        if self.cfg.runs:  # as a node agent holds back a trailing call under way once (RingEncoder._hold)
            fresh = len(out)
            out, sim.held = sim.held + out, []
            if fresh and len(out) > 1 and isinstance(out[-1], r.CallRecord):
                sim.held = [out.pop()]
        if self.cfg.device and now >= sim.progress_due:
            sim.progress_due = now + DEVICE_READ_S
            out.append(self.progress(sim, now))
        return out

    def progress(self, sim: RankSim, now: float) -> Any:
        """Where group "0" stands on ``sim``'s device at ``now``: what it enqueued (the calls it
        entered), and completed those enqueued ``DEVICE_LAG_S`` ago; the device never gets past
        a collective some member never enqueued (``stuck`` and ``early_exit``)."""
        enqueued = sim.next_enter  # index i is seq i + 1 on group "0"
        done = int((now - DEVICE_LAG_S - self.t0) / self.period) + 1 if now - DEVICE_LAG_S >= self.t0 else 0
        completed = max(0, min(enqueued, done))
        if self.cfg.fault in ("stuck", "early_exit") and self.fault_index >= 0:
            completed = min(completed, self.fault_index)
        return self.r.GroupProgress(sim.rank, "0", enqueued, -1, completed, now, timeout_ms=600_000)

    # ---- sending ------------------------------------------------------------------------

    def register_all(self) -> None:
        def reg(sim: RankSim) -> None:
            for attempt in range(20):
                try:
                    reply = self._register(sim)
                    sim.interval = reply.report_interval_s or SEND_INTERVAL_S
                    return
                except Exception as exc:
                    if attempt == 19:
                        raise RuntimeError(f"rank {sim.rank} could not register: {exc}") from exc
                    time.sleep(0.2 * (attempt + 1))

        with ThreadPoolExecutor(self.cfg.threads) as pool:
            list(pool.map(reg, self.sims))

    def _register(self, sim: RankSim) -> Any:
        if self.cfg.replay:  # the batches are built: register the sessions they carry, nothing else
            from hangwatch import wire
            from hangwatch.protos import hangwatch_pb2 as pb

            request = pb.RegisterRequest(token=self.cfg.token)
            wire.identity_to_pb(sim.identity, request.identity)
            reply = sim.transport._get_stub().Register(request, timeout=self.cfg.timeout_s)
            if not self.cfg.interval_s and abs(reply.report_interval_s - sim.interval) > 1e-9:
                raise RuntimeError(
                    f"coordinator asked for {reply.report_interval_s} s, batches built for {sim.interval}"
                )
            return reply
        sim.encoder.reset()  # whatever the outcome, the coordinator's table for this rank starts empty
        if sim.relay is None:
            return sim.transport.register(sim.identity)
        from hangwatch import wire
        from hangwatch.protos import hangwatch_pb2 as pb

        request = pb.RegisterRequest(token=self.cfg.token)
        wire.identity_to_pb(sim.identity, request.identity)
        return sim.relay.register(request, timeout=self.cfg.timeout_s)

    def heartbeat_all(self) -> None:
        """One empty batch per rank, straight to the coordinator (setup, not measured)."""
        from hangwatch.protos import hangwatch_pb2 as pb

        def beat(sim: RankSim) -> None:
            # replayed batches are timed on their own base: a heartbeat on the real clock would
            # make the coordinator think the rank's clock jumped (no sent_time: no clock sample)
            sent = 0.0 if self.cfg.replay else time.time()
            batch = pb.ReportBatch(token=self.cfg.token, rank=sim.rank, session=sim.identity.session, sent_time=sent)
            try:
                sim.transport._get_stub().Report(batch, timeout=self.cfg.timeout_s)
            except Exception:
                pass  # the run's own batches follow

        with ThreadPoolExecutor(self.cfg.threads) as pool:
            list(pool.map(beat, self.sims))
        if self.cfg.relay or self.cfg.replay:  # from now on ranks hold no connection of their own
            for sim in self.sims:
                sim.transport.close()

    def _build(self, sim: RankSim, events: list[Any]) -> Any:
        """The batch a rank sends: the header, then its calls in columns (what the rank's ring
        becomes on the wire, ``hangwatch.ringwire``), built from typed events here."""
        batch = sim.transport.build_report(sim.identity, sim.batch_seq, [], 0, 0, "train.py:120", "")
        sim.encoder.encode(events, batch)
        return batch

    def _report(self, sim: RankSim, events: list[Any]) -> Any:
        batch = self._build(sim, events)
        if sim.relay is None:
            return sim.transport._get_stub().Report(batch, timeout=self.cfg.timeout_s)
        batch.token = ""
        reply = sim.relay.submit(batch, min(1.8, self.cfg.timeout_s))
        if isinstance(reply, str):
            self._register(sim)  # as the real sender does after a failure: register again
            raise RuntimeError(reply)
        return reply

    def send(self, sim: RankSim, due: float) -> None:
        stats = self.stats
        try:
            started = time.time()
            fresh = self.events_until(sim, started)
            events = sim.pending + fresh
            if len(events) > MAX_BATCH:
                with self.lock:
                    stats.dropped += len(events) - MAX_BATCH
                events = events[-MAX_BATCH:]
            sim.batch_seq += 1
            reply = None
            error = ""
            try:
                reply = self._report(sim, events)
                if reply.reregister:
                    self._register(sim)
                    reply = self._report(sim, events)
            except Exception as exc:
                code = getattr(exc, "code", None)
                error = str(code()) if callable(code) else type(exc).__name__
            done = time.time()
            ncalls = sum(1 for e in events if isinstance(e, self.r.CallRecord))
            with self.lock:
                stats.events_offered += len(events)
                if len(stats.behind) < LATENCY_SAMPLES:
                    stats.behind.append(started - due)
                if reply is None:
                    stats.batches_failed += 1
                    stats.errors[error] = stats.errors.get(error, 0) + 1
                    sim.pending = events  # resent with the next batch, like the real sender
                else:
                    sim.pending = []
                    stats.batches += 1
                    stats.events_sent += len(events)
                    stats.calls_sent += ncalls
                    stats.events_accepted += reply.accepted
                    stats.samples_seen += 1
                    lat, lag = done - started, reply.server_time - started
                    if len(stats.latencies) < LATENCY_SAMPLES:
                        stats.latencies.append(lat)
                        stats.server_lags.append(lag)
                    else:  # reservoir: keep a uniform sample of the whole run
                        j = self.rng.randrange(stats.samples_seen)
                        if j < LATENCY_SAMPLES:
                            stats.latencies[j] = lat
                            stats.server_lags[j] = lag
            if sim.ended:
                sim.stopped = True
        finally:
            sim.next_due = max(due + sim.interval, time.time())
            sim.busy = False

    # ---- replay: everything built before t0 ------------------------------------------------

    def generate(self) -> None:
        """Build every batch (or relay call) of the run with the real encoder, timed from a fixed
        base; ``replay`` then sends the bytes on schedule. Each batch's ``sent_time`` is in the
        same base as its events, so the coordinator's clock-offset mapping puts them in real time."""
        import grpc

        from hangwatch.protos import hangwatch_pb2 as pb

        self.sends = self.build_sends()
        method, reply_type = (
            ("/hangwatch.v1.Coordinator/ReportMany", pb.RelayReply)
            if self.cfg.relay
            else ("/hangwatch.v1.Coordinator/Report", pb.ReportReply)
        )
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 64 * 1024 * 1024)]
        self.channels = {
            key: grpc.insecure_channel(self.cfg.addr, options=options) for key in {x[1] for x in self.sends}
        }
        self.methods = {
            key: ch.unary_unary(method, request_serializer=None, response_deserializer=reply_type.FromString)
            for key, ch in self.channels.items()
        }

    def build_sends(self) -> list[tuple[float, int, bytes, int, int, int]]:
        """Every call of the run, ordered: (seconds after t0, the rank or node sending it, its
        bytes (a ``ReportBatch``, or a ``RelayBatch`` in relay mode), reports, events, calls)."""
        from hangwatch.coordinator.daemon import report_interval_for
        from hangwatch.coordinator.options import steady_read_for
        from hangwatch.protos import hangwatch_pb2 as pb

        cfg = self.cfg
        base = REPLAY_BASE
        interval = cfg.interval_s or report_interval_for(cfg.ranks)
        # a node agent reads a steady rank's ring this far apart where the coordinator asks for
        # longer than the interval (``RegisterReply.steady_read_s``), and between says it alive
        # unread; from a fault's onset the ranks are read at every interval (each goes quiet,
        # waits, or writes a call of a new kind: an agent reads those at once)
        steady = steady_read_for(cfg.ranks) if cfg.together and not cfg.interval_s else 0.0
        for sim in self.sims:
            sim.interval = interval
        self.set_start(base)
        onset = self.enter_time(min(self.fault_index, self.fault_target)) if self.fault_index >= 0 else float("inf")
        reports: list[tuple[float, int, Any, int, int]] = []  # (offset, rank, batch, events, calls)
        for sim in self.sims:
            # a rank's first batch leaves at once (real ranks flush their first, new calls), then
            # one per interval on its own phase
            due = base + 0.25 * self.beat(sim.rank)
            read = -float("inf")
            # its node's reads follow the periods of the node's own clock, whose phase is any
            phase = base + steady * self.beat(sim.rank)
            while due < base + cfg.seconds and not sim.ended:
                if steady > interval and due < onset and (due - phase) // steady == (read - phase) // steady:
                    sim.batch_seq += 1
                    batch = self._build(sim, [])
                    batch.unread = True
                    batch.sent_time = due
                    batch.mono_time = REPLAY_MONO + (due - base)
                    reports.append((due - base, sim.rank, batch, 0, 0))
                    due = sim.next_due if due < sim.next_due else due + sim.interval
                    continue
                read = due
                events = self.events_until(sim, due)
                sim.batch_seq += 1
                batch = self._build(sim, events)
                batch.sent_time = due
                # the sender's monotonic clock, in step with its wall clock (stamped as it is built,
                # it moved with the build, not the run: every batch looked like a step of the
                # rank's wall clock, so each late one moved the rank's times)
                batch.mono_time = REPLAY_MONO + (due - base)
                ncalls = sum(1 for e in events if isinstance(e, self.r.CallRecord))
                reports.append((due - base, sim.rank, batch, len(events), ncalls))
                due = sim.next_due if due < sim.next_due else due + sim.interval
        sends: list[tuple[float, int, bytes, int, int, int]] = []
        if not cfg.relay:
            for offset, rank, batch, nev, ncalls in reports:
                sends.append((offset, rank, batch.SerializeToString(), 1, nev, ncalls))
        else:  # what each node's relay sends: its ranks' batches of one relay interval together
            window = max(cfg.relay_interval, min(interval / 2, RELAY_MAX_INTERVAL_S))  # as Relay.register sets it
            calls: dict[tuple[int, int], list[tuple[Any, int, int]]] = {}

            def phase(node: int) -> float:  # relays are not in step: each gathers on its own beat
                return window * ((node * 0.618) % 1.0)

            for offset, rank, batch, nev, ncalls in reports:
                batch.token = ""
                node = rank // cfg.ranks_per_node
                # an agent's beat goes at once; a relay's window when it closes
                w = round(offset * 1e6) if cfg.together else int((offset - phase(node)) // window)
                calls.setdefault((node, w), []).append((batch, nev, ncalls))
            for (node, w), items in calls.items():
                sent = w / 1e6 if cfg.together else phase(node) + (w + 1) * window
                for b, _, _ in items:  # what the relay would have measured holding it
                    b.relay_held_s = sent - (b.sent_time - base)
                relayed = pb.RelayBatch(token=cfg.token, relay_host=f"sim-node-{node}")
                relayed.reports.extend(b for b, _, _ in items)
                nev = sum(n for _, n, _ in items)
                ncalls = sum(c for _, _, c in items)
                sends.append((sent, node, relayed.SerializeToString(), len(items), nev, ncalls))
        sends.sort(key=lambda x: x[0])
        return sends

    def replay(self, t0: float) -> None:
        stats, lock = self.stats, self.lock
        outstanding = threading.Semaphore(0)
        issued = 0

        def done(fut: Any, started: float, nrep: int, nev: int, ncalls: int) -> None:
            finished = time.time()
            try:
                reply = fut.result()
                replies = list(reply.replies) if self.cfg.relay else [reply]
                accepted = sum(x.accepted for x in replies)
                with lock:
                    stats.batches += nrep
                    stats.events_sent += nev
                    stats.calls_sent += ncalls
                    stats.events_accepted += accepted
                    if len(stats.latencies) < LATENCY_SAMPLES:
                        stats.latencies.append(finished - started)
                        stats.server_lags.append(reply.server_time - started)
            except Exception as exc:
                code = getattr(exc, "code", None)
                with lock:
                    stats.batches_failed += nrep
                    err = str(code()) if callable(code) else type(exc).__name__
                    stats.errors[err] = stats.errors.get(err, 0) + 1
            outstanding.release()

        for sim in self.sims:  # registration is over: only the replay's own connections remain
            sim.transport.close()
        for offset, key, payload, nrep, nev, ncalls in self.sends:
            due = t0 + offset
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            started = time.time()
            with lock:
                stats.events_offered += nev
                if len(stats.behind) < LATENCY_SAMPLES:
                    stats.behind.append(started - due)
            fut = self.methods[key].future(payload, timeout=self.cfg.timeout_s)
            self.replay_calls += 1
            fut.add_done_callback(lambda f, s=started, a=nrep, b=nev, c=ncalls: done(f, s, a, b, c))
            issued += 1
        for _ in range(issued):
            outstanding.acquire(timeout=self.cfg.timeout_s + 5)
        for ch in self.channels.values():
            ch.close()

    def run(self, end: float) -> None:
        # relay mode: a batch waits for its relay's next upstream call, so allow one per rank
        pool = ThreadPoolExecutor(max(self.cfg.threads, len(self.sims)) if self.cfg.relay else self.cfg.threads)
        try:
            while True:
                now = time.time()
                if now >= end:
                    break
                soonest = end
                for sim in self.sims:
                    if sim.busy or sim.stopped:
                        continue
                    if sim.next_due <= now:
                        sim.busy = True
                        pool.submit(self.send, sim, sim.next_due)
                    else:
                        soonest = min(soonest, sim.next_due)
                time.sleep(max(0.001, min(0.01, soonest - time.time())))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for sim in self.sims:
                sim.transport.close()
            for relay in self.relays.values():
                relay.stop()


def _worker_main(cfg: Config, ranks: list[int], barrier: Any, start: Any, results: Any) -> None:
    worker = Worker(cfg, ranks)
    try:
        if cfg.replay:
            worker.generate()
        worker.register_all()
    except Exception as exc:
        results.put({"error": str(exc)})
        barrier.abort()
        return
    barrier.wait()  # every process has registered its ranks
    worker.heartbeat_all()  # as real ranks do right after registering: none looks silent at t0
    barrier.wait()
    barrier.wait()  # the parent has set the start time
    t0 = start.value
    if cfg.replay:
        worker.replay(t0)
    else:
        worker.set_start(t0)
        while time.time() < t0:
            time.sleep(0.001)
        worker.run(t0 + cfg.seconds)
    s = worker.stats
    results.put(
        {
            "batches": s.batches,
            "batches_failed": s.batches_failed,
            "events_offered": s.events_offered,
            "events_sent": s.events_sent,
            "events_accepted": s.events_accepted,
            "calls_sent": s.calls_sent,
            "dropped": s.dropped,
            "latencies": s.latencies,
            "server_lags": s.server_lags,
            "behind": s.behind,
            "errors": s.errors,
            "interval_s": max((sim.interval for sim in worker.sims), default=SEND_INTERVAL_S),
            "upstream_calls": worker.replay_calls or sum(relay.upstream_calls for relay in worker.relays.values()),
        }
    )


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    data = sorted(values)
    return data[min(len(data) - 1, int(q * len(data)))]


def run(cfg: Config, procs: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # no gRPC state may cross a fork
    procs = max(1, min(procs, cfg.ranks))
    if cfg.relay:  # a node's ranks (and its relay) live in one process
        nodes = range((cfg.ranks + cfg.ranks_per_node - 1) // cfg.ranks_per_node)
        chunks = [
            [
                rk
                for n in nodes
                if n % procs == p
                for rk in range(n * cfg.ranks_per_node, min(cfg.ranks, (n + 1) * cfg.ranks_per_node))
            ]
            for p in range(procs)
        ]
    else:
        chunks = [list(range(p, cfg.ranks, procs)) for p in range(procs)]
    barrier = ctx.Barrier(procs + 1)
    start = ctx.Value("d", 0.0)
    results = ctx.Queue()
    children = [
        ctx.Process(target=_worker_main, args=(cfg, chunk, barrier, start, results), daemon=True) for chunk in chunks
    ]
    reg_started = time.time()
    for child in children:
        child.start()
    try:
        barrier.wait(timeout=240)
    except Exception:
        for child in children:
            child.kill()
        raise SystemExit("loadgen: registration failed or timed out") from None
    registered = time.time()
    barrier.wait(timeout=240)  # heartbeats sent
    start.value = time.time() + 0.5
    barrier.wait()
    t0 = start.value
    outs = [results.get(timeout=cfg.seconds + 120) for _ in children]
    t_end = t0 + cfg.seconds
    for child in children:
        child.join(30)
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise SystemExit(f"loadgen: {errors[0]}")
    agg: dict[str, Any] = {
        k: sum(o[k] for o in outs)
        for k in (
            "batches",
            "batches_failed",
            "events_offered",
            "events_sent",
            "events_accepted",
            "calls_sent",
            "dropped",
        )
    }
    lat = [x for o in outs for x in o["latencies"]]
    lags = [x for o in outs for x in o["server_lags"]]
    behind = [x for o in outs for x in o["behind"]]
    errs: dict[str, int] = {}
    for o in outs:
        for k, v in o["errors"].items():
            errs[k] = errs.get(k, 0) + v
    secs = cfg.seconds
    per_step = Pattern(cfg.pattern, cfg.ranks).ops_per_step()
    target_calls = cfg.ranks * cfg.rate
    fault_index = max(1, int(cfg.fault_at * cfg.rate)) if cfg.fault != "none" else None
    result = {
        "ranks": cfg.ranks,
        "rate": cfg.rate,
        "pattern": cfg.pattern,
        "procs": procs,
        "seconds": secs,
        "register_s": round(registered - reg_started, 2),
        "t0": t0,
        "t_end": t_end,
        # scheduled load: enter + exit per collective, plus a StepEvent per step
        "target_events_per_s": round(target_calls * (2 + 1 / per_step)),
        "target_calls_per_s": round(target_calls),
        "offered_events_per_s": round(agg["events_offered"] / secs),
        "sent_events_per_s": round(agg["events_sent"] / secs),
        "accepted_events_per_s": round(agg["events_accepted"] / secs),
        "calls_per_s": round(agg["calls_sent"] / secs),
        "batches_per_s": round(agg["batches"] / secs),
        **agg,
        "rpc_p50_ms": _ms(_pct(lat, 0.5)),
        "rpc_p99_ms": _ms(_pct(lat, 0.99)),
        "rpc_max_ms": _ms(max(lat) if lat else None),
        "server_lag_p50_ms": _ms(_pct(lags, 0.5)),
        "server_lag_p99_ms": _ms(_pct(lags, 0.99)),
        "gen_behind_p50_ms": _ms(_pct(behind, 0.5)),
        "gen_behind_p99_ms": _ms(_pct(behind, 0.99)),
        "errors": errs,
        "relay": cfg.relay,
        "replay": cfg.replay,
        "relay_interval_s": cfg.relay_interval if cfg.relay else None,
        "report_interval_s": max(o["interval_s"] for o in outs),
        # RPCs the coordinator received for batches: one per batch, or the relays' calls
        "coordinator_rpcs_per_s": round(
            (
                sum(o["upstream_calls"] for o in outs)
                if cfg.relay or cfg.replay
                else agg["batches"] + agg["batches_failed"]
            )
            / secs
        ),
        "fault": cfg.fault,
        "fault_rank": cfg.fault_rank if cfg.fault != "none" else None,
        "fault_onset": (t0 + fault_index / cfg.rate) if fault_index is not None else None,
    }
    return result


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", required=True, help="coordinator host:port (127.0.0.1 only for benchmarks)")
    ap.add_argument("--token", default="")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rate", type=float, default=10.0, help="collectives per second per rank")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--pattern", choices=PATTERNS, default="ddp")
    ap.add_argument("--runs", action="store_true", help="send calls alike as runs (CallColumns.run), as node agents do")
    ap.add_argument(
        "--device",
        action="store_true",
        help="NCCL ranks: batches carry device progress (GroupProgress), as node agents read it from Flight Recorder",
    )
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-rank", type=int, default=-1, help="default: ranks // 2 + 1")
    ap.add_argument("--fault-at", type=float, default=5.0, help="seconds after t0")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=32, help="batches in flight per process")
    ap.add_argument("--timeout", type=float, default=2.0, help="RPC deadline (the real transport's: 2 s)")
    ap.add_argument("--job-id", default="loadgen")
    ap.add_argument("--relay", action="store_true", help="report through one node-agent relay per 8 ranks (in-process)")
    ap.add_argument(
        "--replay",
        action="store_true",
        help="build every batch first (same encoder, same schedule), then only send bytes: offers loads "
        "this machine could not generate live next to the coordinator",
    )
    ap.add_argument("--relay-interval", type=float, default=RELAY_INTERVAL_S, help="the agents' --relay-interval")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    if not 1 <= args.ranks <= 65_536 or args.rate <= 0 or not 0 < args.seconds <= 600:
        ap.error("need 1 <= ranks <= 65536, rate > 0, 0 < seconds <= 600")
    fault_rank = args.fault_rank if args.fault_rank >= 0 else min(args.ranks - 1, args.ranks // 2 + 1)
    cfg = Config(
        addr=args.addr,
        token=args.token,
        ranks=args.ranks,
        rate=args.rate,
        seconds=args.seconds,
        pattern=args.pattern,
        fault=args.fault,
        fault_rank=fault_rank,
        fault_at=args.fault_at,
        job_id=args.job_id,
        threads=args.threads,
        timeout_s=args.timeout,
        relay=args.relay,
        replay=args.replay,
        relay_interval=args.relay_interval,
        runs=args.runs,
        device=args.device,
    )
    if args.device and args.pattern not in ("tp", "ddp", "fsdp"):
        ap.error("--device: patterns on the world group only (tp, ddp, fsdp)")
    result = run(cfg, args.procs)
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
