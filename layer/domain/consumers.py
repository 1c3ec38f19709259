"""Consumers of a queue and the delivery-fairness rules that choose among them.

Fairness (AMPS "Delivery Fairness", amps-understanding-queues.txt):

- ``fast``: the first subscription found that does not have a full backlog;
- ``round-robin``: the next available subscription (after the last one served) that does
  not have a full backlog;
- ``proportional``: the subscription with the lowest ratio of unacknowledged messages to
  its maximum backlog; ties go to the first subscription found with that ratio.

"Found" means subscription order: the order in which consumers subscribed (a replace keeps a
consumer's place). Every chooser receives only consumers that both want the entry and have
room for it, in that order.
"""

from __future__ import annotations

from collections.abc import Sequence

from layer.domain.expressions import Expression
from layer.domain.states import Bookmark

__all__ = [
    "BacklogShare",
    "Consumer",
    "choose_fast",
    "choose_proportional",
    "choose_round_robin",
    "effective_backlog",
]


def effective_backlog(requested: int | None, queue_limit: int) -> int:
    """min(the consumer's ``max_backlog``, the queue's ``max_per_subscription_backlog``).

    A consumer that asks for nothing gets 1 (AMPS: "an application must explicitly specify
    a backlog to be able to receive more than one message"); 0 is allowed and receives only
    barrier messages.
    """
    wanted = 1 if requested is None else requested
    if wanted < 0:
        raise ValueError(f"max_backlog must be 0 or more, got {wanted}")
    return min(wanted, queue_limit)


class BacklogShare:
    """One backlog shared by the consumers of one regex subscription across its queues.

    AMPS: a subscription that matches several queues has ONE backlog, "the minimum
    MaxPerSubscriptionBacklog setting for the queues matched by the subscription", and the
    subscriber's max_backlog counts across all of them. Each queue's engine keeps its own
    `Consumer` for the subscription; they all point at one share, whose room is the smallest
    of their limits less the leases they hold together. Every engine of one shard runs on one
    thread, so a share needs no lock.
    """

    __slots__ = ("_native", "members")

    def __init__(self) -> None:
        self.members: list[Consumer] = []
        self._native: object | None = None

    def native_share(self) -> object:
        """The same share for native engines (`layer.domain.native`), made on first use:
        the native engines keep their members' limits and leases there."""
        if self._native is None:
            import qlayer_native

            self._native = qlayer_native.Share()
        return self._native

    def room(self) -> int:
        """The smallest limit of the members still subscribed, less the leases every member
        holds (a member a replace took off its queue still holds its leases there: AMPS
        "does not ... adjust the number of currently-unacknowledged messages")."""
        if self._native is not None:
            return int(self._native.room())  # type: ignore[attr-defined]
        limits = [m.limit for m in self.members if not m.draining]
        if not limits:
            return 0
        return min(limits) - sum(len(m.leases) for m in self.members)

    def queue_count(self) -> int:
        """How many queues' consumers take part (Python and native engines alike)."""
        native = 0 if self._native is None else int(self._native.member_count)  # type: ignore[attr-defined]
        return len(self.members) + native

    def __repr__(self) -> str:
        return f"BacklogShare({self.queue_count()} queues, room={self.room()})"


class Consumer:
    """One subscription to one queue, with its leases and its place in the queue order.

    ``position`` is the consumer's pointer into the queue order (Qpid's per-subscription
    "last seen entry"): every AVAILABLE entry before it is known not to be deliverable to
    this consumer, so a dispatch looks at each entry once per consumer, not once per call.
    The engine moves pointers back whenever an entry before them becomes deliverable.
    """

    __slots__ = (
        "consumer_id",
        "delivery_topic",
        "draining",
        "filter",
        "last_seen",
        "leases",
        "limit",
        "order",
        "position",
        "position_matched",
        "requested_backlog",
        "session_id",
        "session_timeout",
        "share",
        "transactional",
    )

    def __init__(
        self,
        consumer_id: str,
        session_id: str,
        order: int,
        *,
        requested_backlog: int | None,
        limit: int,
        filter: Expression | None,
        delivery_topic: str,
        last_seen: float,
        session_timeout: float,
        position: int,
        share: BacklogShare | None = None,
    ) -> None:
        self.consumer_id = consumer_id
        self.session_id = session_id
        self.order = order
        self.requested_backlog = requested_backlog
        self.limit = limit
        self.filter = filter
        self.delivery_topic = delivery_topic
        self.last_seen = last_seen
        self.session_timeout = session_timeout
        # Bookmarks of this consumer's leases (and at-most-once backlog slots), in lease order.
        self.leases: dict[Bookmark, None] = {}
        self.position = position
        # True when the entry at ``position`` is known to match ``filter``.
        self.position_matched = False
        #: A replace took the subscription off this queue: it takes nothing new and leaves
        #: once its leases here are settled or ended (`QueueEngine.retire`).
        self.draining = False
        self.share = share
        if share is not None:
            share.members.append(self)
        #: Settles inside its own Kafka transactions: its leases are not broken (expiry,
        #: session timeout) until the coordinator has fenced its producer (`QueueEngine.fenced`).
        self.transactional = False

    @property
    def backlog(self) -> int:
        """Entries leased to this consumer and not acknowledged yet."""
        return len(self.leases)

    def room(self) -> int:
        """How many more entries it may take now: its own limit, and its subscription's
        shared backlog when it has one (none while it drains)."""
        if self.draining:
            return 0
        own = self.limit - len(self.leases)
        share = self.share
        if share is not None and own > 0:
            return min(own, share.room())
        return own

    @property
    def has_room(self) -> bool:
        return self.room() > 0

    def leave_share(self) -> None:
        if self.share is not None:
            self.share.members.remove(self)
            self.share = None

    def __repr__(self) -> str:
        return f"Consumer({self.consumer_id!r}, backlog={len(self.leases)}/{self.limit})"


def choose_fast(candidates: Sequence[Consumer]) -> Consumer:
    return candidates[0]


def choose_round_robin(candidates: Sequence[Consumer], last_order: int) -> Consumer:
    """The first candidate after the consumer served last, wrapping around."""
    for consumer in candidates:
        if consumer.order > last_order:
            return consumer
    return candidates[0]


def choose_proportional(candidates: Sequence[Consumer]) -> Consumer:
    """The candidate with the lowest leased/limit ratio; the first one found on a tie.

    Ratios are compared by cross-multiplication, so 1/2 and 2/4 tie exactly.
    """
    best = candidates[0]
    best_leased, best_limit = len(best.leases), best.limit
    for consumer in candidates[1:]:
        leased, limit = len(consumer.leases), consumer.limit
        if leased * best_limit < best_leased * limit:
            best, best_leased, best_limit = consumer, leased, limit
    return best
