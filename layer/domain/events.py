"""Events: one small immutable record for every change the queue engine makes.

The coordinator persists the entry states they imply (see :class:`Outbox`), produces
deliveries from :class:`EntryLeased` and :class:`BarrierDelivered`, writes dead letters from
:class:`EntryExpired` (when ``dead_letter`` is set) *before* it marks the entry EXPIRED, and
publishes every event to the events topic for audit, metrics and the Spark pipeline.

Every entry that enters a queue (:class:`EntriesEnqueued`) reaches exactly one outcome:
:class:`EntryAcked` or :class:`EntryExpired`. Times are seconds, as passed in ``now``.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

from layer.domain.entries import EntryRecord
from layer.domain.states import AckSource, Bookmark, ExpiryReason, LeaveReason

__all__ = [
    "BacklogFreed",
    "BarrierDelivered",
    "ConsumerLeft",
    "ConsumerReplaced",
    "ConsumerSubscribed",
    "Delivery",
    "EntriesEnqueued",
    "EntryAcked",
    "EntryDelayed",
    "EntryExpired",
    "EntryLeased",
    "EntryReleased",
    "Event",
    "LeaseBroken",
    "LeaseExpired",
    "LeaseRenewed",
    "Outbox",
    "Recipient",
]


class EntriesEnqueued(NamedTuple):
    """Records of one journal partition became entries (one event per partition per call)."""

    queue: str
    topic: str
    partition: int
    offsets: tuple[int, ...]
    at: float


class EntryDelayed(NamedTuple):
    """An entry entered the queue with a deliver-at time in the future."""

    queue: str
    bookmark: Bookmark
    until: float
    at: float


class EntryLeased(NamedTuple):
    """An entry was delivered to a consumer; also the delivery order for the coordinator.

    For at-most-once queues the entry is ACKED at the same time (see ``EntryAcked`` with
    ``source=DELIVERY``); the lease then only holds the consumer's backlog slot.
    """

    queue: str
    bookmark: Bookmark
    consumer_id: str
    delivery_topic: str
    token: str
    deadline: float
    delivery_count: int
    at: float


class EntryAcked(NamedTuple):
    """An entry left the queue processed (ACKED). ``delivery_count``: the deliveries it had
    when it was acked (None for an entry acked without ever being delivered: by filter,
    before it was read, as a barrier)."""

    queue: str
    bookmark: Bookmark
    consumer_id: str | None
    source: AckSource
    at: float
    delivery_count: int | None = None


class EntryReleased(NamedTuple):
    """A consumer returned a leased entry unprocessed (RELEASE; AMPS ``cancel``).

    ``available_at`` is when it can be delivered again; None when the release made it leave
    the queue (an ``EntryExpired`` follows).
    """

    queue: str
    bookmark: Bookmark
    consumer_id: str
    cancel_count: int
    available_at: float | None
    at: float


class LeaseRenewed(NamedTuple):
    """The lease holder extended its lease (RENEW)."""

    queue: str
    bookmark: Bookmark
    consumer_id: str
    deadline: float
    at: float


class LeaseExpired(NamedTuple):
    """A lease reached its deadline without an acknowledgement; the entry was returned
    (``available_at`` set) or, past a limit, expired (an ``EntryExpired`` follows)."""

    queue: str
    bookmark: Bookmark
    consumer_id: str
    available_at: float | None
    at: float


class LeaseBroken(NamedTuple):
    """A lease ended because its consumer left; the entry is available again at once,
    unless a limit made it leave the queue (an ``EntryExpired`` follows)."""

    queue: str
    bookmark: Bookmark
    consumer_id: str
    reason: LeaveReason
    at: float


class EntryExpired(NamedTuple):
    """An entry left the queue unprocessed (EXPIRED).

    When ``dead_letter`` is set the coordinator writes the record to the queue's dead-letter
    topic, with these fields as headers, before it persists the EXPIRED state.
    """

    queue: str
    bookmark: Bookmark
    reason: ExpiryReason
    dead_letter: bool
    delivery_count: int
    cancel_count: int
    consumer_id: str | None
    detail: str | None
    at: float


class DeliveryRefused(EntryExpired):
    """An at-most-once delivery the broker refused as too large for its delivery topic (a
    topic's ``max.message.bytes`` under the producer's), learned an iteration after the entry
    left the queue as delivered. The entry stays done (its one outcome was
    DELIVERED_AT_MOST_ONCE); the coordinator dead-letters the record (reason ``too-large``),
    announced by one DEAD_LETTERED event, so it is not lost without a trace. Built by the shard
    core, not the engine, whose part in the entry ended at the delivery."""


class Recipient(NamedTuple):
    consumer_id: str
    delivery_topic: str


class BarrierDelivered(NamedTuple):
    """A barrier message went to every current consumer whose filter matches it, and left
    the queue (it needs no acknowledgement and takes no backlog)."""

    queue: str
    bookmark: Bookmark
    recipients: tuple[Recipient, ...]
    at: float


class BacklogFreed(NamedTuple):
    """At-most-once: the consumer acknowledged a delivery (or its lease period passed), so
    its backlog slot is free again. The entry itself was ACKED when it was delivered."""

    queue: str
    bookmark: Bookmark
    consumer_id: str
    at: float


class ConsumerSubscribed(NamedTuple):
    queue: str
    consumer_id: str
    session_id: str
    max_backlog: int  # the effective limit: min(requested or 1, queue's per-subscription limit)
    filter: str | None
    delivery_topic: str
    at: float


class ConsumerReplaced(NamedTuple):
    """An atomic replace of a subscription; its leases were kept."""

    queue: str
    consumer_id: str
    session_id: str
    max_backlog: int
    filter: str | None
    delivery_topic: str
    at: float


class ConsumerLeft(NamedTuple):
    """A consumer left (or was timed out or evicted); ``broken`` leases were broken at once."""

    queue: str
    consumer_id: str
    session_id: str
    reason: LeaveReason
    broken: int
    at: float


Event: TypeAlias = (
    EntriesEnqueued
    | EntryDelayed
    | EntryLeased
    | EntryAcked
    | EntryReleased
    | LeaseRenewed
    | LeaseExpired
    | LeaseBroken
    | EntryExpired
    | BarrierDelivered
    | BacklogFreed
    | ConsumerSubscribed
    | ConsumerReplaced
    | ConsumerLeft
)

Delivery: TypeAlias = EntryLeased | BarrierDelivered
"""What :meth:`QueueEngine.dispatch` asks the coordinator to produce to delivery topics."""


class Outbox(NamedTuple):
    """Everything the engine decided since the last :meth:`QueueEngine.drain`.

    ``entries`` holds the current persistent state of every entry whose state changed
    (the only entries the coordinator needs to write); ``events`` is in decision order.
    """

    events: list[Event]
    entries: list[EntryRecord]
