"""A real coordinator measures its own queue: batches that wait for its state say so."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from hangwatch import records as r
from hangwatch.coordinator.daemon import Coordinator
from hangwatch.protos import hangwatch_pb2 as pb


def test_batches_that_wait_for_the_state_show_the_coordinator_behind(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    c = coordinator_factory(embedded_agent=False)
    sessions = []
    for rank in range(4):
        identity = r.RankIdentity("lag", rank, 4, "host-a", 20_000 + rank, session=uuid.uuid4().hex)
        c.accept_registration(identity)
        sessions.append(identity.session)

    def send(rank: int) -> None:
        batch = pb.ReportBatch(job_id="lag", rank=rank, session=sessions[rank], sent_time=time.time())
        c.report(batch, [])

    for rank in range(4):  # prompt: nothing holds the state
        for _ in range(3):
            send(rank)
    assert c.jobs.lag.behind(time.time()) < 0.1
    senders = [threading.Thread(target=send, args=(rank % 4,)) for rank in range(36)]
    with c.lock:  # the state busy for 1.5 s (a saturated coordinator): every batch queues
        for s in senders:
            s.start()
        time.sleep(1.5)
    for s in senders:
        s.join(5)
    assert c.jobs.lag.behind(time.time() + 1.1) > 1.0  # the median wait of the latest batches
    status = c.status("lag")
    assert status is not None and status["job"]["behind_s"] > 1.0
