"""Wire contract (``hangwatch.protos``)."""
