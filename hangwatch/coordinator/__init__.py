"""The coordinator daemon (``hangwatch.coordinator``)."""
