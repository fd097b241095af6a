"""The words of the verdict table's rows: what each rule of ``diagnosis.rules`` says a
disagreement is and what to check. The rules compute the values; the sentences are here.

``check`` arguments are already phrased: "check the code at train.py:9 on rank 1, which uses"
(``SlotCalls.which``). ``ref`` is a ranks label ("ranks 0, 2") and ``ref_verb`` its verb."""

from __future__ import annotations

from hangwatch.wording import ranks_label

# --------------------------------------------------------------------------------------------
# Cross-rank rows (``rules.collective``), in the table's order


def op_hint(group: str, culprits: str, bad_ops: str, bad_sites: str, ref: str, ref_op: str, ref_sites: str) -> str:
    return (
        f"every rank of group {group} must call the same collectives in the same order; "
        f"{culprits} called {bad_ops}{bad_sites} where {ref} called {ref_op}{ref_sites}; look for a "
        "collective inside a rank-dependent branch, an early exit, or a loop that runs a different "
        "number of times on some ranks"
    )


def op_summary(group: str, seq: int, listing: str) -> str:
    return f"op mismatch in group {group} seq {seq}: {listing}"


def group_ranks_hint(group: str, check: str) -> str:
    return (
        f"ranks disagree on which ranks form group {group}; every rank must create its process "
        f"groups with the same ranks and in the same order (new_group is collective even for "
        f"non-members); {check} a different group"
    )


def root_hint(name: str, op: str, ref: str, ref_verb: str, root: int, check: str) -> str:
    return (
        f"every rank must pass the same {name} to {op}; {ref} {ref_verb} {name}={root}; "
        f"{check} a different one ({name} is a global rank, even in a subgroup: use "
        "group_src/group_dst or get_global_rank to convert)"
    )


def dtype_hint(label: str, op: str, ref: str, ref_verb: str, dtypes: str, check: str) -> str:
    return (
        f"every rank must pass {label}tensors of the same dtype to {op} ({ref} {ref_verb} {dtypes}); "
        f"{check} a different dtype (a missing .to(dtype), autocast, or a dtype taken from "
        "rank-dependent data)"
    )


def length_hint(label: str, op: str, ref: str, ref_verb: str, length: int, check: str) -> str:
    return (
        f"every rank must pass {label}lists of the same length to {op} ({ref} {ref_verb} {length}); "
        f"{check} a different number"
    )


def shape_hint(needs: str, op: str, check: str, objects: bool) -> str:
    if objects:
        return f"every rank must pass {needs} to {op}; {check} a different length"
    return f"every rank must pass {needs} to {op}; {check} a different shape"


def reduce_hint(op: str, ref: str, ref_verb: str, reduce_op: str, check: str) -> str:
    return f"every rank must use the same reduce op for {op} ({ref} {ref_verb} {reduce_op}); {check} a different one"


def intrinsic_summary(head: str, problems: dict[int, str]) -> str:
    return f"{head}: " + "; ".join(f"rank {r} {text}" for r, text in problems.items())


def check_where(hint: str, where: str) -> str:
    return f"{hint}; check {where}"


# --------------------------------------------------------------------------------------------
# All-to-all pairing (``rules.alltoall``)

SPLIT_PAIRING = (
    "rank i's output_split_sizes[j] must equal rank j's input_split_sizes[i]; compute the split "
    "sizes from the same data on every rank (e.g. exchange counts with an all_to_all_single first)"
)
LIST_PAIRING = "rank i's output tensor j must have the shape of rank j's input tensor i in all_to_all"


def even_split_hint(what: str, check: str) -> str:
    return (
        f"without split sizes, every rank must pass an {what} with the same number of elements to "
        f"all_to_all_single; {check} a different size (or pass input_split_sizes/output_split_sizes)"
    )


def pair_text(receiver: int, expects: str, sender: int, sends: str, more: int) -> str:
    text = f"rank {receiver} expects {expects} from rank {sender}, but rank {sender} sends {sends} to rank {receiver}"
    if more:
        text += f" ({more} more pair{'s disagree' if more > 1 else ' disagrees'})"
    return text


def chunk_amount(k: int, row: int, flat: bool) -> str:
    if flat:
        return f"{k} element{'' if k == 1 else 's'}"
    return f"{k} row{'' if k == 1 else 's'} of {row} element{'' if row == 1 else 's'}"


# --------------------------------------------------------------------------------------------
# Point-to-point (``rules.p2p``)


def p2p_summary(group: str, seq: int, sender: int, sends: str, receiver: int, receives: str, problem: str) -> str:
    return (
        f"p2p mismatch in group {group} (pair seq {seq}): rank {sender} sends {sends} to rank "
        f"{receiver}, but rank {receiver} receives {receives} ({problem})"
    )


def p2p_hint(fix: str, sites: list[tuple[str, str, int]]) -> str:
    """``sites``: (which side, call site, rank) of the send and the recv."""
    where = " and ".join(
        f"{what} at {site} on rank {rank}" if site else f"{what} on rank {rank}" for what, site, rank in sites
    )
    return f"a send and its matching recv must carry {fix}; check {where}"


def by_site(sites: dict[str, list[int]]) -> str:
    """``"the code at train.py:42 on rank 1 and at x.py:3 on ranks 2, 3"``."""
    parts = [f"at {site} on {ranks_label(rs)}" if site else f"on {ranks_label(rs)}" for site, rs in sites.items()]
    return "the code " + " and ".join(parts)


# --------------------------------------------------------------------------------------------
# One rank's call against itself and the group size (``rules.checks``): (text, hint), the
# text completing "rank 3 ..."


def list_length(op: str, name: str, tensors: str, gs: int) -> tuple[str, str]:
    return (
        f"passes {tensors} in its {name} list, but the group has {gs} ranks",
        f"{op} needs exactly one {name} tensor per rank in the group ({gs})",
    )


def list_dtype(op: str, name: str, k: int, dtype: str, ref_name: str, ref_dtype: str) -> tuple[str, str]:
    return (
        f"has {name} tensor {k} of dtype {dtype}, but its {ref_name} is {ref_dtype}",
        f"{op} needs every {name} tensor to have the {ref_name}'s dtype",
    )


def list_shape(op: str, name: str, k: int, shape: str, ref_name: str, ref_shape: str) -> tuple[str, str]:
    return (
        f"has {name} tensor {k} of shape {shape}, but its {ref_name} has shape {ref_shape}",
        f"{op} needs every {name} tensor to have the {ref_name}'s shape",
    )


def ratio_dtype(op: str, big: str, big_dtype: str, small: str, small_dtype: str, which: str) -> tuple[str, str]:
    """``which``: " 0" for the first pair of a coalesced list, else ""."""
    return (
        f"has {big}{which} of dtype {big_dtype}, but its {small}{which} is {small_dtype}",
        f"{op} needs the input and output tensors to have the same dtype",
    )


def ratio_size(
    op: str, big: str, big_shape: str, n_big: int, small: str, small_shape: str, which: str, gs: int, needs: int
) -> tuple[str, str]:
    return (
        f"has {big}{which} {big_shape} ({n_big} elements), but its {small}{which} {small_shape} x {gs} ranks "
        f"needs {needs}",
        f"{op} needs the {big} to hold group size x the {small}'s elements",
    )


def ratio_multiple(
    op: str, big: str, big_shape: str, n_big: int, small: str, small_shape: str, which: str, n_small: int
) -> tuple[str, str]:
    return (
        f"has {big}{which} {big_shape} ({n_big} elements), not a multiple of its {small}{which} {small_shape} "
        f"({n_small} elements)",
        f"{op} needs the {big} to hold group size x the {small}'s elements",
    )


def uneven_split(name: str, shape: str, key: str, dim0: int, gs: int) -> tuple[str, str]:
    return (
        f"has {name} {shape} with no {key}, but dim 0 ({dim0}) does not divide evenly over {gs} ranks",
        f"without {key}, all_to_all_single splits dim 0 evenly over the group",
    )


def split_count(key: str, n: int, gs: int) -> tuple[str, str]:
    return (
        f"passes {n} {key}, but the group has {gs} ranks",
        f"{key} needs one entry per rank in the group ({gs})",
    )


def split_sum(key: str, splits: list[int], name: str, shape: str, dim0: int) -> tuple[str, str]:
    return (
        f"has {key} {splits} summing to {sum(splits)}, but its {name} {shape} has {dim0} rows",
        f"{key} must add up to dim 0 of the {name} tensor",
    )
