"""The ``hangwatch`` command. One module per concern: ``parser`` (flags and environment),
``client`` (talking to a coordinator), ``render`` (tables and reports), ``commands`` (actions)."""

from __future__ import annotations

from hangwatch.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
