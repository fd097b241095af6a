"""The command line: ``hangwatch run`` takes torchrun's arguments as torchrun does."""

from __future__ import annotations

import pytest

from hangwatch.cli.parser import parse_args


@pytest.mark.parametrize(
    ("argv", "torchrun"),
    [
        (["run", "--nproc-per-node", "4", "train.py"], ["--nproc-per-node", "4", "train.py"]),
        (["run", "--nproc-per-node=4", "--standalone", "train.py", "--lr", "0.1"],
         ["--nproc-per-node=4", "--standalone", "train.py", "--lr", "0.1"]),
        (["run", "--stuck-after", "20", "--nproc-per-node", "4", "train.py", "--stuck-after", "3"],
         ["--nproc-per-node", "4", "train.py", "--stuck-after", "3"]),  # after the script: the script's
        (["run", "--", "--nproc-per-node", "2", "train.py"], ["--nproc-per-node", "2", "train.py"]),
        (["run", "--port", "0", "--", "--standalone", "t.py"], ["--standalone", "t.py"]),
    ],
)  # fmt: skip
def test_run_passes_torchrun_its_arguments_in_order(argv: list[str], torchrun: list[str]) -> None:
    args = parse_args(argv)
    assert args.command == "run" and args.torchrun_args == torchrun


def test_run_keeps_its_own_options() -> None:
    args = parse_args(["run", "--stuck-after", "20", "--nproc-per-node", "4", "train.py"])
    assert args.stuck_after == 20.0


def test_other_verbs_still_refuse_unknown_options() -> None:
    with pytest.raises(SystemExit):
        parse_args(["status", "--nproc-per-node", "4"])
