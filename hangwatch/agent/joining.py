"""Processes linked before they are ranks: what the agent keeps of each until it joins or goes.

A process its launcher started as a rank links from its first line (``client.joining``) with a
hello that says ``"phase": "starting"`` and hands over no ring. The kernel proves who it is, as
for a rank; it says when it enters ``init_process_group`` and when it joined, and its link
closes when it is done or gone. The shipper tells the coordinator each change
(``JoiningLink.phase``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from hangwatch import records as r
from hangwatch.link import IN_INIT, JOINED, Peer


@dataclass
class JoiningLink:
    """One starting process: proven identity, what its launcher said, and where it is."""

    peer: Peer
    hello: dict[str, Any]
    connected_at: float
    sock: socket.socket | None = field(default=None, repr=False)
    in_init_at: float | None = None  # when it said it entered init_process_group
    joined: bool = False  # it said init returned (its rank's own link follows)
    closed_at: float | None = None
    told: str = ""  # the phase the coordinator was last told

    @property
    def phase(self) -> str:
        """What the coordinator is to be told ("": nothing more: it joined)."""
        if self.joined:
            return ""
        if self.closed_at is not None:
            return r.GONE
        return r.IN_INIT if self.in_init_at is not None else r.STARTING

    def said(self, data: bytes, now: float) -> None:
        """What came on the link after the hello."""
        if IN_INIT in data and self.in_init_at is None:
            self.in_init_at = now
        if JOINED in data:
            self.joined = True

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None
