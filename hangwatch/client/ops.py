"""The table of ``torch.distributed`` calls the hook records, and what to read from each.

One row per public API: which parameters hold inputs and outputs, which name the root or the
peer (global rank, or group-local rank for the ``group_*`` spellings), and whether the call is
point-to-point. Argument extraction reads parameters by name from this table, never through
``inspect`` on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OpSpec:
    name: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    root: str | None = None  # global-rank parameter of a rooted collective
    group_root: str | None = None  # the same, as a rank within the group
    peer: str | None = None  # global-rank parameter of a p2p call
    group_peer: str | None = None
    reduce: str | None = None
    p2p: bool = False
    objects: bool = False  # lists of Python objects, not tensors
    splits: bool = False  # all_to_all_single split sizes
    extra: bool = False  # op-specific arguments go into CallRecord.extra
    always_async: bool = False  # returns a Work whatever async_op says (isend, irecv)


OPS: tuple[OpSpec, ...] = (
    OpSpec("all_reduce", inputs=("tensor",), reduce="op"),
    OpSpec("reduce", inputs=("tensor",), root="dst", group_root="group_dst", reduce="op"),
    OpSpec("broadcast", inputs=("tensor",), root="src", group_root="group_src"),
    OpSpec("all_gather", inputs=("tensor",), outputs=("tensor_list",)),
    OpSpec("all_gather_into_tensor", inputs=("input_tensor",), outputs=("output_tensor",)),
    OpSpec("_all_gather_base", inputs=("input_tensor",), outputs=("output_tensor",)),
    OpSpec("gather", inputs=("tensor",), outputs=("gather_list",), root="dst", group_root="group_dst"),
    OpSpec("scatter", inputs=("scatter_list",), outputs=("tensor",), root="src", group_root="group_src"),
    OpSpec("reduce_scatter", inputs=("input_list",), outputs=("output",), reduce="op"),
    OpSpec("reduce_scatter_tensor", inputs=("input",), outputs=("output",), reduce="op"),
    OpSpec("_reduce_scatter_base", inputs=("input",), outputs=("output",), reduce="op"),
    OpSpec("all_to_all", inputs=("input_tensor_list",), outputs=("output_tensor_list",), extra=True),
    OpSpec("all_to_all_single", inputs=("input",), outputs=("output",), splits=True, extra=True),
    OpSpec("barrier"),
    OpSpec("monitored_barrier"),
    OpSpec("all_reduce_coalesced", inputs=("tensors",), reduce="op"),
    OpSpec("all_gather_coalesced", inputs=("input_tensor_list",), outputs=("output_tensor_lists",)),
    OpSpec("send", inputs=("tensor",), peer="dst", group_peer="group_dst", p2p=True),
    OpSpec("recv", outputs=("tensor",), peer="src", group_peer="group_src", p2p=True),
    OpSpec("isend", inputs=("tensor",), peer="dst", group_peer="group_dst", p2p=True, always_async=True),
    OpSpec("irecv", outputs=("tensor",), peer="src", group_peer="group_src", p2p=True, always_async=True),
    OpSpec("batch_isend_irecv", inputs=("p2p_op_list",), p2p=True, extra=True, always_async=True),
    OpSpec("broadcast_object_list", inputs=("object_list",), root="src", group_root="group_src", objects=True),
    OpSpec("all_gather_object", inputs=("obj",), outputs=("object_list",), objects=True),
    OpSpec(
        "gather_object",
        inputs=("obj",),
        outputs=("object_gather_list",),
        root="dst",
        group_root="group_dst",
        objects=True,
    ),
    OpSpec(
        "scatter_object_list",
        inputs=("scatter_object_input_list",),
        outputs=("scatter_object_output_list",),
        root="src",
        group_root="group_src",
        objects=True,
    ),
    OpSpec(
        "send_object_list",
        inputs=("object_list",),
        peer="dst",
        group_peer="group_dst",
        p2p=True,
        objects=True,
    ),
    OpSpec(
        "recv_object_list",
        outputs=("object_list",),
        peer="src",
        group_peer="group_src",
        p2p=True,
        objects=True,
    ),
)

OPS_BY_NAME = {spec.name: spec for spec in OPS}

#: Flight Recorder ``profiling_name`` suffixes (after ``backend:``) mapped to the Python op names.
FR_OP_NAMES = {
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
}

#: Flight Recorder dtype spellings (c10 ScalarType names) mapped to torch's names.
FR_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
}
