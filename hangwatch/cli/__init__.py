"""The ``hangwatch`` command. One module per concern: ``parser`` (flags and environment),
``client`` (talking to a coordinator), ``render`` (tables and reports), ``main`` (the verbs),
``launch`` (``run`` and ``demo``)."""

from __future__ import annotations

from hangwatch.cli.main import main
from hangwatch.cli.parser import build_parser

__all__ = ["build_parser", "main"]
