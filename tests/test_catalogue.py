"""The op catalogue (hangwatch.catalogue): one row per op, and everything that names ops
derived from it. These tests fail when an op the hook or Flight Recorder can record has no
row or no rule, or when a spelling does not resolve to its row."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hangwatch import catalogue, records
from hangwatch.catalogue import Agree, Kind, Op, canonical_op
from hangwatch.client.ops import OPS, OpSpec
from hangwatch.diagnosis.detectors.stuck import BARRIERS
from hangwatch.diagnosis.rules.checks import CHECKS
from hangwatch.diagnosis.rules.slot import SPECS, UNKNOWN, spec

COMPARED = {Kind.COLLECTIVE, Kind.ROOTED, Kind.BARRIER, Kind.OBJECT}


@pytest.mark.parametrize(
    ("op", "canon"),
    [
        ("allreduce", "all_reduce"),
        ("all_reduce", "all_reduce"),
        ("_allgather_base", "all_gather_into_tensor"),
        ("all_gather_into_tensor", "all_gather_into_tensor"),
        ("_reduce_scatter_base", "reduce_scatter_tensor"),
        ("nccl:all_reduce", "all_reduce"),
        ("gloo:alltoall_base", "all_to_all_single"),
        ("torch.distributed.broadcast", "broadcast"),
        ("monitored_barrier", "monitored_barrier"),
        ("_all_gather_base", "all_gather_into_tensor"),
        ("nccl:_all_gather_base", "all_gather_into_tensor"),
        ("ALLREDUCE", "all_reduce"),
        ("_c10d_functional::all_gather_into_tensor", "all_gather_into_tensor"),
        ("_c10d_functional::reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced"),
        ("nccl:_broadcast_oop", "broadcast"),
        ("nccl:all_reduce_barrier", "barrier"),
        ("all_reduce_async", "all_reduce"),
        ("nccl:send 0->1", "send"),
        ("my_custom_collective", "my_custom_collective"),
    ],
)
def test_canonical_op(op: str, canon: str) -> None:
    assert canonical_op(op) == canon


def test_every_hooked_function_has_a_row_and_a_rule() -> None:
    """Each row of the hook's table names a catalogue row listing it, and that row has a rule:
    what ranks must agree on (collectives) or a side to be paired on (p2p)."""
    assert {s.name for s in OPS} == set(catalogue.BY_API)
    for s in OPS:
        row = catalogue.BY_NAME[s.op]
        assert s.name in row.api
        assert canonical_op(s.name) == row.name
        assert s.p2p == (row.kind is Kind.P2P) and s.objects == row.objects
        if row.kind is Kind.P2P:
            assert row.direction is not None or row.name == "batch_isend_irecv", row.name
        else:
            assert spec(row.name) is SPECS[row.name] is not UNKNOWN, row.name


def test_every_flight_recorder_name_maps_to_a_row_with_a_rule() -> None:
    assert catalogue.FR_OP_NAMES
    for fr, name in catalogue.FR_OP_NAMES.items():
        row = catalogue.BY_NAME[name]
        assert fr in row.fr_names
        assert name in SPECS or (row.kind is Kind.P2P and row.direction is not None), fr


@pytest.mark.parametrize("row", catalogue.OPS, ids=lambda op: op.name)
def test_every_spelling_resolves_to_its_row(row: Op) -> None:
    if row.kind is Kind.MARKER:
        return  # markers are events, never compared; their names carry a module prefix
    for spelling in row.spellings:
        assert canonical_op(spelling) == row.name, spelling
        assert canonical_op(spelling.upper()) == row.name, spelling


def test_checks_and_specs_come_from_the_rows() -> None:
    assert {op.check for op in catalogue.OPS if op.check} == set(CHECKS)
    for op in catalogue.OPS:
        if op.kind in COMPARED:
            assert op.agree is not None and SPECS[op.name].agree is op.agree
            assert SPECS[op.name].intrinsic is (CHECKS[op.check] if op.check else None)
        else:
            assert op.name not in SPECS


def test_derived_op_sets() -> None:
    """The sets other modules used to spell out by hand, now read from the catalogue."""
    assert {
        "send",
        "recv",
        "isend",
        "irecv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
    } == records.P2P_OPS
    assert {"send", "isend", "send_object_list"} == records.SEND_OPS
    assert {"recv", "irecv", "recv_object_list"} == records.RECV_OPS
    assert {"accelerate.set_trigger", "accelerate.check_trigger"} == records.MARKER_OPS
    assert BARRIERS == ("barrier", "monitored_barrier")
    assert records.op_kind("isend") is records.OpKind.P2P
    assert records.op_kind("_all_gather_base") is records.OpKind.COLLECTIVE
    assert catalogue.FR_OP_NAMES["_allgather_base"] == "all_gather_into_tensor"
    assert catalogue.FR_OP_NAMES["alltoall_base"] == "all_to_all_single"


def test_a_hook_row_without_a_catalogue_row_fails() -> None:
    with pytest.raises(ValueError, match="no op"):
        OpSpec("all_reduce_new", "all_reduce_new")
    with pytest.raises(ValueError, match="no op"):
        OpSpec("all_reduce_new", "all_reduce")  # the row does not list the function


def test_a_collective_row_without_a_rule_fails() -> None:
    with pytest.raises(ValueError, match="need an Agree"):
        Op("my_collective", Kind.COLLECTIVE, api=("my_collective",))
    with pytest.raises(ValueError, match="root"):
        Op("my_rooted", Kind.ROOTED, agree=Agree())


def test_import_is_cheap() -> None:
    """The hook imports the catalogue (and its table) in every rank: no torch, no coordinator."""
    code = (
        "import sys, hangwatch.catalogue, hangwatch.client.ops; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('hangwatch.coordinator')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
