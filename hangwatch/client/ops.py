"""The hook's argument-extraction table: for each ``torch.distributed`` function it wraps, which
parameters hold inputs and outputs, which name the root or the peer (global rank, or
group-local rank for the ``group_*`` spellings).

Every row names its op in :mod:`hangwatch.catalogue`, where the op's other facts live (its
kind, its spellings, what ranks must agree on, its single-call check); whether a call is
point-to-point or moves objects comes from there. A row for a function the catalogue does not
list as one of its op's ``api`` fails at import. Argument extraction reads parameters by name
from this table, never through ``inspect`` on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hangwatch import catalogue


@dataclass(frozen=True, slots=True, eq=False)  # one per op: hashed by identity (the hot path keys on it)
class OpSpec:
    name: str  # the torch.distributed function
    op: str  # its catalogue row
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    root: str | None = None  # global-rank parameter of a rooted collective
    group_root: str | None = None  # the same, as a rank within the group
    peer: str | None = None  # global-rank parameter of a p2p call
    group_peer: str | None = None
    reduce: str | None = None
    splits: bool = False  # all_to_all_single split sizes
    extra: bool = False  # op-specific arguments go into CallRecord.extra
    always_async: bool = False  # returns a Work whatever async_op says (isend, irecv)
    p2p: bool = field(init=False, default=False)  # from the catalogue
    objects: bool = field(init=False, default=False)  # lists of Python objects, not tensors

    def __post_init__(self) -> None:
        row = catalogue.BY_NAME.get(self.op)
        if row is None or self.name not in row.api:
            raise ValueError(f"hook table row {self.name!r}: the catalogue has no op {self.op!r} listing it")
        object.__setattr__(self, "p2p", row.kind is catalogue.Kind.P2P)
        object.__setattr__(self, "objects", row.objects)


OPS: tuple[OpSpec, ...] = (
    OpSpec("all_reduce", "all_reduce", inputs=("tensor",), reduce="op"),
    OpSpec("reduce", "reduce", inputs=("tensor",), root="dst", group_root="group_dst", reduce="op"),
    OpSpec("broadcast", "broadcast", inputs=("tensor",), root="src", group_root="group_src"),
    OpSpec("all_gather", "all_gather", inputs=("tensor",), outputs=("tensor_list",)),
    OpSpec("all_gather_into_tensor", "all_gather_into_tensor", inputs=("input_tensor",), outputs=("output_tensor",)),
    OpSpec("_all_gather_base", "all_gather_into_tensor", inputs=("input_tensor",), outputs=("output_tensor",)),
    OpSpec("gather", "gather", inputs=("tensor",), outputs=("gather_list",), root="dst", group_root="group_dst"),
    OpSpec("scatter", "scatter", inputs=("scatter_list",), outputs=("tensor",), root="src", group_root="group_src"),
    OpSpec("reduce_scatter", "reduce_scatter", inputs=("input_list",), outputs=("output",), reduce="op"),
    OpSpec("reduce_scatter_tensor", "reduce_scatter_tensor", inputs=("input",), outputs=("output",), reduce="op"),
    OpSpec("_reduce_scatter_base", "reduce_scatter_tensor", inputs=("input",), outputs=("output",), reduce="op"),
    OpSpec("all_to_all", "all_to_all", inputs=("input_tensor_list",), outputs=("output_tensor_list",), extra=True),
    OpSpec("all_to_all_single", "all_to_all_single", inputs=("input",), outputs=("output",), splits=True, extra=True),
    OpSpec("barrier", "barrier"),
    OpSpec("monitored_barrier", "monitored_barrier"),
    OpSpec("all_reduce_coalesced", "all_reduce_coalesced", inputs=("tensors",), reduce="op"),
    OpSpec(
        "all_gather_coalesced", "all_gather_coalesced", inputs=("input_tensor_list",), outputs=("output_tensor_lists",)
    ),
    OpSpec("send", "send", inputs=("tensor",), peer="dst", group_peer="group_dst"),
    OpSpec("recv", "recv", outputs=("tensor",), peer="src", group_peer="group_src"),
    OpSpec("isend", "isend", inputs=("tensor",), peer="dst", group_peer="group_dst", always_async=True),
    OpSpec("irecv", "irecv", outputs=("tensor",), peer="src", group_peer="group_src", always_async=True),
    OpSpec("batch_isend_irecv", "batch_isend_irecv", inputs=("p2p_op_list",), extra=True, always_async=True),
    OpSpec(
        "broadcast_object_list", "broadcast_object_list", inputs=("object_list",), root="src", group_root="group_src"
    ),
    OpSpec("all_gather_object", "all_gather_object", inputs=("obj",), outputs=("object_list",)),
    OpSpec(
        "gather_object",
        "gather_object",
        inputs=("obj",),
        outputs=("object_gather_list",),
        root="dst",
        group_root="group_dst",
    ),
    OpSpec(
        "scatter_object_list",
        "scatter_object_list",
        inputs=("scatter_object_input_list",),
        outputs=("scatter_object_output_list",),
        root="src",
        group_root="group_src",
    ),
    OpSpec(
        "send_object_list",
        "send_object_list",
        inputs=("object_list",),
        peer="dst",
        group_peer="group_dst",
    ),
    OpSpec(
        "recv_object_list",
        "recv_object_list",
        outputs=("object_list",),
        peer="src",
        group_peer="group_src",
    ),
)

OPS_BY_NAME = {spec.name: spec for spec in OPS}

if OPS_BY_NAME.keys() != catalogue.BY_API.keys():  # every function the catalogue names is hooked, and only those
    raise ValueError(f"hook table and catalogue disagree on {sorted(OPS_BY_NAME.keys() ^ catalogue.BY_API.keys())}")
