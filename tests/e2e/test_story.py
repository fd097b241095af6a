"""The story table: for every edit and sink of the model, a program a user could have written, the
exact story hangwatch must tell of it, and the healthy program that looks most like it, which must
raise nothing. Real torchrun gloo jobs attached by ``HANGWATCH_ADDR`` alone, a real coordinator.

A story names the rank, the call (its op and the line that made it), the step and where the
rank is instead; what the evidence cannot tell yet it does not claim. What the root cause
brought after it (a death, a wait on another group) is its aftermath, told after the story in
the same incident. In ``summary``, ``{X}`` stands for ``<script>:<line> in <function>`` of the
line marked ``# @X`` in the program, ``{n}`` for a number (of seconds, of a line of the standard
library), ``{g}`` for the name torch gave a group, ``{rest}`` for what more an aftermath says.
BENCHMARKS.md ("The story table") lists the rows with what the tree before the model said of each.
"""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from hangwatch.coordinator.daemon import Coordinator
from hangwatch.testing import Job, wait_for
from tests.conftest import PRELUDE
from tests.e2e.test_fault_classes import _brief

pytestmark = pytest.mark.slow

INIT = """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
"""


@dataclass(frozen=True)
class Story:
    """One row: the program, what must be said of it, and its healthy look-alike."""

    name: str
    program: str
    nproc: int
    kind: str
    culprits: list[int]
    waiting: list[int]
    summary: str
    lookalike: str
    today: str  # what the tree before the model said
    told_today: bool = False  # whether that tree already told this story
    #: what the model does not tell yet, and why (the row is expected to fail until it does)
    pending: str = ""
    #: what its aftermath must say (a death the root cause brought): told after the story
    aftermath: str = ""
    functions: dict[str, str] = field(default_factory=dict)  # marker -> the function its line is in
    #: the story is told from a stack the agent dumps once the incident opens (a rank's own
    #: processes): it is awaited, a py-spy dump or two, before the story is read
    from_stacks: bool = False


def _site(script: str, program: str, marker: str, function: str) -> str:
    lines = (PRELUDE + textwrap.dedent(program)).splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if re.search(rf"# @{marker}\b", line)]
    return f"{script}.py:{number} in {function}"


def expected(story: Story, script: str, text: str | None = None) -> re.Pattern[str]:
    """``story.summary`` (or ``text``) as a pattern: sites resolved, numbers of seconds free, the
    rest literal."""
    parts = re.split(r"(\{[A-Za-z]+\})", story.summary if text is None else text)
    out = []
    for part in parts:
        if part == "{n}":
            out.append(r"\d+")
        elif part == "{g}":  # a group's name where torch numbers it by its own order of creation
            out.append(r"\w+")
        elif part == "{rest}":  # what more an aftermath says, as far as the reads got
            out.append(r".*")
        elif part.startswith("{line"):  # a site as a frame names it: file and line alone
            out.append(re.escape(_site(script, story.program, part[5:-1], "").removesuffix(" in ")))
        elif part.startswith("{") and part.endswith("}"):
            marker = part[1:-1]
            out.append(re.escape(_site(script, story.program, marker, story.functions.get(marker, "<module>"))))
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


SKIPPED_OBJECT = Story(
    name="skipped_object_collective",
    program=INIT
    + """
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)  # @W a warm-up every rank runs
config = [{"lr": 0.1}] if rank == 0 else [None]
if rank != 2:  # rank 2 found the config in its node-local cache
    dist.broadcast_object_list(config, src=0)  # @B
for step in range(100):
    dist.all_reduce(t)  # @T
    time.sleep(0.05)
""",
    nproc=3,
    kind="op_mismatch",
    culprits=[2],
    waiting=[0, 1],
    summary="rank 2 never called broadcast_object_list ({B}), which ranks 0, 1 are in (group 0, seq 4); "
    "it is in all_reduce at {T}",
    lookalike=INIT
    + """
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
config = [{"lr": 0.1}] if rank == 0 else [None]
dist.broadcast_object_list(config, src=0)  # every rank takes the config from rank 0
for step in range(30):
    dist.all_reduce(t)
    time.sleep(0.05)
""",
    today="op_mismatch on rank 2, 'rank 2 made an extra all_reduce at {W} (seq 3)': the warm-up, run in step",
)

DDP_NAN = """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    if {bad}:  # a NaN loss: skip the batch
        opt.zero_grad()
        continue
    loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
dist.barrier()  # @E
"""

SKIPPED_BACKWARD = Story(
    name="skipped_backward_under_ddp",
    program=INIT + DDP_NAN.replace("{bad}", "rank == 1 and step == 6"),
    nproc=2,
    kind="op_mismatch",
    culprits=[1],
    waiting=[0],
    summary="rank 1 ran forward pass 7 (step 6) without its backward and carried on: it never made that step's "
    "gradient all_reduce issued from C++ (gloo:all_reduce), so from there on each of its all_reduces met rank 0's "
    "next one and it ran out of them one before rank 0; it is in barrier at {E}",
    # the skip agreed on: every rank learns of the NaN and skips together
    lookalike=INIT
    + DDP_NAN.replace(
        "{bad}",
        "(lambda f: (dist.all_reduce(f, op=dist.ReduceOp.MAX), bool(f))[1])"
        "(torch.tensor([float(rank == 1 and step == 6)]))",
    ),
    today="early_exit on rank 1, 'rank 1 left the loop and wait in a final barrier ... at step 19'",
)

ASYNC_SKIP = """
param = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([param], lr=0.1)
for step in range(20):
    loss = torch.tensor([float("nan") if rank == 1 and step == 6 else 1.0])
    logged = loss.clone()
    dist.all_reduce(logged)  # @L the loss, for the log
    if torch.isnan({checked}).any():
        continue
    grad = torch.ones(4)
    work = dist.all_reduce(grad, async_op=True)  # @G the gradients, overlapped
    work.wait()
    opt.step()
    time.sleep(0.05)
"""

SKIPPED_ASYNC = Story(
    name="skipped_async_all_reduce",
    program=INIT + ASYNC_SKIP.replace("{checked}", "loss"),  # its own loss: rank 1 alone skips
    nproc=2,
    kind="shape_mismatch",
    culprits=[1],
    waiting=[0],
    summary="rank 1 skipped all_reduce at {G} (step 6) and went on to its next call, all_reduce at {L}, which "
    "met it (group 0, seq 14): rank 0: [4]; rank 1: [1]",
    lookalike=INIT + ASYNC_SKIP.replace("{checked}", "logged"),  # the all-reduced loss: every rank skips
    today="shape_mismatch on rank 1 at seq 14, 'rank 0: [4]; rank 1: [1]': the shapes, no word of the skip",
)

MESH = """
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
param = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([param], lr=0.1)
x = torch.ones(4)
for step in range(20):
    if {tp_now}:
        dist.all_reduce(x, group=tp)  # @P the tensor-parallel reduce
    dist.all_reduce(x, group=dp)  # @D
    opt.step()
    time.sleep(0.05)
"""

SKIPPED_ON_A_MESH = Story(
    name="skipped_on_a_device_mesh_dimension",
    program=INIT + MESH.replace("{tp_now}", "not (rank == 3 and step == 6)"),
    nproc=4,
    kind="stuck_collective",
    culprits=[3],
    waiting=[2],
    summary="rank 2 waits in all_reduce (group {g}, seq 20) and rank 3 will never make it: rank 3 skipped "
    "all_reduce at {P} in step 6 (seq 7) and carried on: from there on each of its calls met rank 2's next one, "
    "so it ran out of them one before rank 2; rank 3 then exited",
    lookalike=INIT + MESH.replace("{tp_now}", "step != 6"),  # every rank skips that step's reduce
    today="nothing in 60 s: rank 3 finished, rank 2 raised on the closed connection, torchrun stopped the rest",
)

FSDP = """
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    loss = model(torch.randn(8, 16)).pow(2).mean()  # @F
    if {bad}:  # a NaN loss: skip the backward
        opt.zero_grad()
        continue
    loss.backward()  # @K
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
"""

SKIPPED_UNDER_FSDP = Story(
    name="skipped_backward_under_fsdp2",
    program=INIT + FSDP.replace("{bad}", "rank == 1 and step == 5"),
    nproc=3,
    kind="shape_mismatch",
    culprits=[1],
    waiting=[0],
    # FSDP2's collectives are issued from C++: Flight Recorder names no line and keeps no step
    summary="rank 1 skipped all_gather issued from C++ (gloo:all_gather) and went on to its next call, all_gather "
    "issued from C++ (gloo:all_gather), which met it (group 0, seq 33): rank 0: [34]; rank 1: [102]",
    aftermath="rank 2 then died: its process was killed by SIGABRT (signal 6){rest}",
    lookalike=INIT
    + FSDP.replace(
        "{bad}",
        "(lambda f: (dist.all_reduce(f, op=dist.ReduceOp.MAX), bool(f))[1])"
        "(torch.tensor([float(rank == 1 and step == 5)]))",
    ),
    today="rank_died first ('rank 2 died: killed by SIGABRT'), then a provisional shape_mismatch naming ranks 0 and 1",
)

EXTRA = """
param = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([param], lr=0.1)
grad = torch.ones(4)
for step in range(12):
    dist.all_reduce(grad)  # @A
    if {extra}:
        norm = grad.clone()
        dist.all_reduce(norm)  # @X the gradient norm, for its own log
    opt.step()
    time.sleep(0.05)
"""

EXTRA_CALL = Story(
    name="extra_call",
    program=INIT + EXTRA.replace("{extra}", "rank == 1 and step == 4"),
    nproc=2,
    kind="stuck_collective",
    culprits=[1],
    waiting=[0],
    summary="rank 1 waits in all_reduce (group 0, seq 13) and rank 0 will never make it: rank 1 made an extra "
    "all_reduce at {X} (step 4, seq 6); every later call on rank 1 met rank 0's call before, so rank 0 ran out of "
    "calls one before it; rank 0 then exited",
    lookalike=INIT + EXTRA.replace("{extra}", "step == 4"),  # every rank logs it
    today="early_exit on rank 0, 'rank 0 left the training loop after step 12 and exited, while rank 1 entered "
    "all_reduce (seq 13) of the next step': the rank one call short blamed for leaving",
)

EARLY = """
param = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([param], lr=0.1)

def export_model():
    time.sleep({export})  # @M writing the model out takes a while

def train():
    g = torch.ones(4)
    for step in range(20):
        dist.all_reduce(g)  # @R
        opt.step()
        if {stop}:  # its own early-stop test: the loss plateaued
            break
        time.sleep(0.05)

train()
export_model()
dist.barrier()
"""

LEFT_THE_LOOP = Story(
    name="left_the_loop_busy_after_it",
    program=INIT + EARLY.replace("{stop}", "rank == 1 and step == 8").replace("{export}", "600"),
    nproc=2,
    kind="early_exit",
    culprits=[1],
    waiting=[0],
    summary="rank 1 left its loop at step 9: it returned from train, where its last all_reduce ({R}, step 8) came "
    "from, and is busy in {M} while rank 0 entered all_reduce (group 0, seq 10) at {R} and waits for {n} s",
    functions={"R": "train", "M": "export_model"},
    lookalike=INIT + EARLY.replace("{stop}", "step == 19").replace("{export}", "1"),  # every rank stops, exports
    today="stuck_collective, 'rank 1 is busy in train.py in export_model': the story of a slow checkpoint",
)

METRIC = """
import minilight
for step in range(20):
    minilight.log("loss", torch.tensor([float(step)]), sync_dist=True)
    if {rank0}:
        minilight.log("lr", torch.tensor([0.1]), sync_dist=True)  # @Z
    else:
        minilight.log("tokens", torch.tensor([3], dtype=torch.int64), sync_dist=True)  # @Y
    time.sleep(0.05)
"""

RANK0_METRIC = Story(
    name="rank0_only_metric_inside_a_framework_helper",
    program=INIT + METRIC.replace("{rank0}", "rank == 0"),
    nproc=3,
    kind="dtype_mismatch",
    culprits=[0],
    waiting=[1, 2],
    summary="all_reduce dtype mismatch in group 0 seq 4: rank 0: float32; ranks 1, 2: int64",
    aftermath="rank 0 then died: its process was killed by SIGABRT (signal 6) inside all_reduce(op=SUM) [1] "
    "float32 at {Z}",
    lookalike=INIT + METRIC.replace("{rank0}", "False"),
    today="dtype_mismatch on rank 0, its call site 'minilight/__init__.py:8 in _sync_ddp' (the framework's), "
    "not the user's line",
)

LOADER = """
class Shards(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        if {stall} and i == 40:
            read_shard(i)
        return torch.ones(4)


def read_shard(i):
    time.sleep(600)  # @R a stalled network filesystem


loader = torch.utils.data.DataLoader(Shards(), batch_size=4, num_workers=1)
t = torch.ones(4)
for step, batch in enumerate(loader):  # @I
    dist.all_reduce(t)  # @S
    if step == 30:
        break
    time.sleep(0.02)
"""

DATALOADER = Story(
    name="waits_for_its_dataloader",
    program=INIT + LOADER.replace("{stall}", "rank == 1"),
    nproc=2,
    kind="stuck_collective",
    culprits=[1],
    waiting=[0],
    summary="rank 0 waits in all_reduce (group 0, seq 11) at {S} for {n} s; rank 1 waits in {I} for its DataLoader "
    "worker (pid {n}), which is in read_shard at {lineR}",
    lookalike=INIT + LOADER.replace("{stall}", "False"),
    from_stacks=True,
    today="stuck_collective, 'rank 1 is busy in selectors.py:415 in select': a frame of the standard library",
)

SEND_SEND = Story(
    name="send_send_deadlock",
    program=INIT
    + """
t = torch.ones(4)
for step in range(3):
    dist.all_reduce(t)
peer = 1 - rank
{first}
""".replace("{first}", "dist.send(t, dst=peer)  # @P both stages send first\ndist.recv(t, src=peer)"),
    nproc=2,
    kind="p2p_mismatch",
    culprits=[0, 1],
    waiting=[],
    summary="p2p mismatch in group 0: rank 0 sends to rank 1, but rank 1 is also sending to rank 0 (for {n} s)",
    lookalike=INIT
    + """
t = torch.ones(4)
for step in range(3):
    dist.all_reduce(t)
peer = 1 - rank
if rank == 0:  # one side receives first
    dist.send(t, dst=peer)
    dist.recv(t, src=peer)
else:
    dist.recv(t, src=peer)
    dist.send(t, dst=peer)
""",
    today="the same",
    told_today=True,
)

TWO_GROUPS = """
tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
t = torch.ones(4)
for step in range(40):
    if {stuck}:
        time.sleep(600)  # @U stuck in its own work
    dist.all_reduce(t, group=tp)  # @V
    dist.barrier()  # @Q
    time.sleep(0.05)
"""

HOLDS_UP_ANOTHER = Story(
    name="a_hang_on_one_group_holds_up_another",
    program=INIT + TWO_GROUPS.replace("{stuck}", "rank == 1 and step == 4"),
    nproc=4,
    kind="stuck_collective",
    culprits=[1],
    waiting=[0],
    summary="rank 0 waits in all_reduce (group 1, seq 5) at {V} for {n} s; rank 1 is busy in {U}",
    aftermath="ranks 2, 3 wait in barrier (group 0, seq 5) at {Q} for {n} s; rank 0 is waiting in all_reduce "
    "(group 1, seq 5) at {V} for {n} s; rank 1 is busy in {U}",
    lookalike=INIT + TWO_GROUPS.replace("{stuck}", "rank == 1 and step == 4").replace("600", "1"),
    today="the same",
    told_today=True,
)

SHAPE_KILLS = """
for step in range(10):
    n = 20 if {bad} else 10
    t = torch.ones(n)
    dist.all_reduce(t)  # @H
    time.sleep(0.05)
"""

MISMATCH_KILLS_A_RANK = Story(
    name="a_mismatch_that_makes_gloo_abort_a_rank",
    program=INIT + SHAPE_KILLS.replace("{bad}", "rank == 1 and step == 4"),
    nproc=2,
    kind="shape_mismatch",
    culprits=[1],
    waiting=[0],
    summary="all_reduce shape mismatch in group 0 seq 5: rank 0: [10]; rank 1: [20]",
    aftermath="rank 0 then died: its process was killed by SIGABRT (signal 6) inside all_reduce(op=SUM) [10] "
    "float32 at {H}",
    lookalike=INIT + SHAPE_KILLS.replace("{bad}", "step == 4"),  # every rank's batch is bigger then
    today="the same",
    told_today=True,
)

SHARED = """
t = torch.ones(4)
dist.all_reduce(t)
if {bad}:
    raise ValueError("device_ids can only be None or contain a single element for CPU modules")  # @V
"""

SHARED_CAUSE = Story(
    name="the_same_error_on_every_rank",
    program=INIT + SHARED.replace("{bad}", "True"),
    nproc=2,
    kind="rank_died",
    culprits=[0, 1],
    waiting=[],
    summary="ranks 0, 1 each raised ValueError: device_ids can only be None or contain a single element for CPU "
    "modules at {V}: the same error on each, not a chain",
    lookalike=INIT + SHARED.replace("{bad}", "False"),
    today="the same",
    told_today=True,
)

STORIES = [
    SKIPPED_OBJECT,
    SKIPPED_BACKWARD,
    SKIPPED_ASYNC,
    SKIPPED_ON_A_MESH,
    SKIPPED_UNDER_FSDP,
    EXTRA_CALL,
    LEFT_THE_LOOP,
    RANK0_METRIC,
    DATALOADER,
    SEND_SEND,
    HOLDS_UP_ANOTHER,
    MISMATCH_KILLS_A_RANK,
    SHARED_CAUSE,
]


def _incidents(c: Coordinator, job: str) -> list[dict[str, Any]]:
    return [i for i in c.incidents_json() if i["job"] == job]


def _param(story: Story) -> Any:
    """A row the model does not tell yet is expected to fail until it does."""
    marks = [pytest.mark.xfail(strict=True, reason=story.pending)] if story.pending else []
    return pytest.param(story, id=story.name, marks=marks)


@pytest.mark.parametrize("story", [_param(s) for s in STORIES])
def test_the_story_told(
    story: Story, coordinator: Coordinator, torchrun: Callable[..., Job], framework: dict[str, str]
) -> None:
    job = torchrun(
        story.program,
        addr=f"127.0.0.1:{coordinator.port}",
        nproc=story.nproc,
        name=story.name,
        env={**framework, "HANGWATCH_JOB_ID": story.name},
    )
    inc = wait_for(lambda: next(iter(_incidents(coordinator, story.name)), None), 60, 0.2, f"{story.name}'s story")
    time.sleep(3)  # what more it would say, it says by now (revisions, aftermath)
    if story.aftermath:  # a death the root cause brought: the agent's word of it may take longer loaded
        wait_for(
            lambda: (coordinator.incident_json(inc["id"]) or {}).get("details", {}).get("aftermath"),
            30,
            0.2,
            f"{story.name}'s aftermath",
        )
    if story.from_stacks:  # and what the culprits' stacks say, once dumped (loaded: seconds more)
        wait_for(
            lambda: all(
                str(rk) in (coordinator.incident_json(inc["id"]) or {}).get("stacks", {}) for rk in story.culprits
            ),
            30,
            0.2,
            f"{story.name}'s stacks",
        )
        time.sleep(0.5)
    job.kill()
    incs = _incidents(coordinator, story.name)
    inc = incs[0]
    assert (inc["kind"], inc["culprit_ranks"], inc["waiting_ranks"]) == (
        story.kind,
        story.culprits,
        story.waiting,
    ), _brief(incs)
    aftermath = inc["details"].get("aftermath") or {}
    told = inc["summary"].removesuffix(f"; {aftermath['summary']}") if aftermath else inc["summary"]
    assert expected(story, story.name).fullmatch(told), inc["summary"]
    if story.aftermath:
        assert aftermath and expected(story, story.name, story.aftermath).fullmatch(aftermath["summary"]), aftermath
    assert len(incs) == 1, _brief(incs)  # one root cause, one incident: the rest is its aftermath
    assert not inc["details"].get("provisional"), inc["summary"]
