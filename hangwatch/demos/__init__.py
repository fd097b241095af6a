"""Built-in fault scenarios for ``hangwatch demo`` (need torch)."""
