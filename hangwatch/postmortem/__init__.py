"""Post-mortem: a hang diagnosed from torch's Flight Recorder dumps, for jobs hangwatch was not
attached to (``hangwatch analyze DIR``)."""
