"""Dropping a delivery the coordinator sent again.

After a restart the coordinator sends the deliveries of the leases it restored once more,
unchanged: it cannot know which of them were written before it stopped (a lease is persisted
before its delivery is written; docs/protocol.md, "Deliveries sent again"). Every lease has its
own token, so a delivery whose token this consumer has already received is such a repeat.
"""

from __future__ import annotations

from collections import deque

#: The fewest tokens remembered, whatever the backlog.
MIN_REMEMBERED = 4096


class SeenLeases:
    """The lease tokens of the deliveries received last, oldest forgotten first.

    A repeat can only be of a lease the consumer held when the coordinator stopped, or
    settled while it was down: at most its backlog of each, since no new lease comes meanwhile.
    So a few times the backlog is remembered (`remember_for`), and never fewer than
    `MIN_REMEMBERED`.
    """

    def __init__(self, backlog: int = 0) -> None:
        self._tokens: set[str] = set()
        self._order: deque[str] = deque()
        self._capacity = MIN_REMEMBERED
        self.remember_for(backlog)

    @property
    def capacity(self) -> int:
        return self._capacity

    def remember_for(self, backlog: int) -> None:
        """Remember enough tokens for a backlog of ``backlog`` leases (never fewer)."""
        self._capacity = max(self._capacity, 4 * backlog)

    def first_time(self, token: str) -> bool:
        """True for a token not seen before (it is remembered); False for a repeat."""
        tokens = self._tokens
        if token in tokens:
            return False
        tokens.add(token)
        order = self._order
        order.append(token)
        if len(order) > self._capacity:
            tokens.discard(order.popleft())
        return True

    def __len__(self) -> int:
        return len(self._order)
