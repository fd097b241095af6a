"""One model of a hang: where the ranks' traces part, and who waits for whom.

Diagnosis answers two questions, the same way for every fault:

1. *Where do the ranks' traces part?* (:mod:`hangwatch.model.align`) A rank's trace is what it
   did in program order; ranks of one program make the same calls in the same order. Where a
   rank's trace parts from the others', the smallest edit that makes it theirs says what
   happened: a call skipped, a call extra, a call made differently, or the trace short (the
   rank ended, or stopped outside any call).
2. *Who waits for whom?* (:mod:`hangwatch.model.waitfor`) A rank inside a collective waits for
   the members that have not come; a rank that died, froze, ended or is busy waits for no one.
   Each such sink, or each cycle of ranks waiting on each other, is one incident; everything
   upstream of it is its aftermath.

The model reads plain records (``hangwatch.records``), never the coordinator's job state, so the
post-mortem of Flight Recorder dumps uses it the same way.
"""
