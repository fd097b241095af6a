"""The diagnosis: a job's state, the detectors that read it and the incidents they raise.

The coordinator feeds it live; ``hangwatch.postmortem`` feeds it Flight Recorder dumps. It
imports neither of them."""
