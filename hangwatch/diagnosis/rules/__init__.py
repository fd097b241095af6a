"""Op-aware comparison rules: do the calls ranks made disagree, and how?

Pure functions on :class:`~hangwatch.records.CallRecord` values, one module per concern:

- :mod:`.collective`: :func:`compare_collective`, the rule chain for the calls of one
  (group, seq) slot (its docstring lists the rules in order);
- :mod:`.checks`: the single-call checks catalogue rows name (one rank's call against the
  group size);
- :mod:`.alltoall`: all-to-all pairing (rank i's output chunk j against rank j's input chunk i);
- :mod:`.p2p`: :func:`match_p2p`, a send against the recv paired with it;
- :mod:`.slot`: what they share (:class:`Mismatch`, each op's spec, the slot helpers).

What each op is and what ranks must agree on comes from :mod:`hangwatch.catalogue`; the words
from :mod:`hangwatch.wording` (re-exported here: ``describe_call``, ``format_ranks``, ...).
Blocked sends/recvs waiting on a busy peer are hang detection:
``hangwatch.diagnosis.detectors.p2p_unmatched``.
"""

from __future__ import annotations

from hangwatch.catalogue import GROUP_RANK, GROUP_RANKS, INPUT_SPLITS, OUTPUT_SPLITS, canonical_op
from hangwatch.diagnosis.rules.collective import compare_collective
from hangwatch.diagnosis.rules.p2p import match_p2p
from hangwatch.diagnosis.rules.slot import (
    ARG_MISMATCH,
    DTYPE_MISMATCH,
    OP_MISMATCH,
    P2P_MISMATCH,
    SHAPE_MISMATCH,
    Mismatch,
)
from hangwatch.wording import describe_call, format_ranks, format_shape

__all__ = [
    "ARG_MISMATCH",
    "DTYPE_MISMATCH",
    "GROUP_RANK",
    "GROUP_RANKS",
    "INPUT_SPLITS",
    "OP_MISMATCH",
    "OUTPUT_SPLITS",
    "P2P_MISMATCH",
    "SHAPE_MISMATCH",
    "Mismatch",
    "canonical_op",
    "compare_collective",
    "describe_call",
    "format_ranks",
    "format_shape",
    "match_p2p",
]
