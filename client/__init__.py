"""The in-rank hook (installed as ``hangwatch.client``)."""
