"""The node agent (``hangwatch.agent``)."""
