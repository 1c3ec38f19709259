"""The protocol's records as Python values, one frozen dataclass per Avro record.

Field names are the Avro field names (see ``schemas/*.avsc``), so a record reads the same in
Python, in the schema and in ``docs/protocol.md``. Acknowledgement items keep ``bookmark`` as the
string the consumer sent: one bad item must be answered on its own (``AckStatus.INVALID``), not
make the whole batch undecodable. Events are written by the coordinator and always hold a valid
``Bookmark``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from layer.domain.states import AckType
from layer.protocol.bookmark import Bookmark
from layer.protocol.errors import ProtocolError

__all__ = [
    "MAX_RELEASE_DELAY_MS",
    "MAX_RENEW_MS",
    "AcceptGroup",
    "AcceptRecord",
    "AckItem",
    "AckItemResult",
    "AckRecord",
    "AckResult",
    "AckStatus",
    "AckType",
    "ControlMessage",
    "Event",
    "EventBatch",
    "EventRun",
    "EventType",
    "ExpiryReason",
    "GrantSemantics",
    "Heartbeat",
    "LeaseEndReason",
    "QueueGrant",
    "Replace",
    "ReplyMessage",
    "RequestKind",
    "SessionEndReason",
    "SessionEnded",
    "Subscribe",
    "SubscribeResult",
    "SubscribeStatus",
    "Unsubscribe",
    "ack_item_problem",
    "ack_item_shape_problem",
]

#: The longest lease a RENEW may ask for (``delay_ms``), as SQS bounds a visibility timeout.
MAX_RENEW_MS = 12 * 3600 * 1000
#: The longest a RELEASE may hold an entry back (``delay_ms``): a day, as a queue's
#: ``delivery_delay`` and ``redelivery_backoff``. Unbounded, a consumer could write a time the
#: store cannot hold (past the year 9999) and fail every commit of its shard.
MAX_RELEASE_DELAY_MS = 24 * 3600 * 1000


# --- enums -----------------------------------------------------------------------------------


class RequestKind(StrEnum):
    SUBSCRIBE = "SUBSCRIBE"
    REPLACE = "REPLACE"


class SubscribeStatus(StrEnum):
    OK = "OK"
    UNKNOWN_QUEUE = "UNKNOWN_QUEUE"
    INVALID_FILTER = "INVALID_FILTER"
    INVALID_REQUEST = "INVALID_REQUEST"


class GrantSemantics(StrEnum):
    AT_LEAST_ONCE = "AT_LEAST_ONCE"
    AT_MOST_ONCE = "AT_MOST_ONCE"


class AckStatus(StrEnum):
    """Outcome of one acknowledgement item, as answered in an ``AckResult``."""

    OK = "OK"
    LEASE_LOST = "LEASE_LOST"
    WRONG_TOKEN = "WRONG_TOKEN"
    UNKNOWN_ENTRY = "UNKNOWN_ENTRY"
    DUPLICATE = "DUPLICATE"
    INVALID = "INVALID"


class SessionEndReason(StrEnum):
    UNSUBSCRIBED = "UNSUBSCRIBED"
    TIMED_OUT = "TIMED_OUT"
    EVICTED = "EVICTED"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"


class EventType(StrEnum):
    """Every state change on the events topic. Terminal outcomes of an entry: ACKED, EXPIRED,
    DELIVERED_AT_MOST_ONCE and BARRIER_DELIVERED; exactly one per entry."""

    ENQUEUED = "ENQUEUED"
    LEASED = "LEASED"
    ACKED = "ACKED"
    RELEASED = "RELEASED"
    RENEWED = "RENEWED"
    REJECTED = "REJECTED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    EXPIRED = "EXPIRED"
    DEAD_LETTERED = "DEAD_LETTERED"
    BARRIER_DELIVERED = "BARRIER_DELIVERED"
    DELIVERED_AT_MOST_ONCE = "DELIVERED_AT_MOST_ONCE"
    REDRIVEN = "REDRIVEN"
    ACK_REFUSED = "ACK_REFUSED"
    CONSUMER_SUBSCRIBED = "CONSUMER_SUBSCRIBED"
    CONSUMER_REPLACED = "CONSUMER_REPLACED"
    CONSUMER_UNSUBSCRIBED = "CONSUMER_UNSUBSCRIBED"
    CONSUMER_TIMED_OUT = "CONSUMER_TIMED_OUT"
    CONSUMER_EVICTED = "CONSUMER_EVICTED"
    SUBSCRIBE_REFUSED = "SUBSCRIBE_REFUSED"
    OWNERSHIP_ACQUIRED = "OWNERSHIP_ACQUIRED"
    OWNERSHIP_LOST = "OWNERSHIP_LOST"


class ExpiryReason(StrEnum):
    """Wire spelling of why an entry left its queue unprocessed: the ``reason`` of an EXPIRED or
    DEAD_LETTERED event and the ``qlayer.dlq.reason`` header."""

    EXPIRATION = "expiration"
    MAX_DELIVERIES = "max_deliveries"
    MAX_CANCELS = "max_cancels"
    REJECTED = "rejected"
    RETENTION = "retention"
    PURGED = "purged"
    TOO_LARGE = "too_large"  # protocol 6
    JOURNAL_DELETED = "journal_deleted"  # protocol 6


class LeaseEndReason(StrEnum):
    """Wire spelling of why a lease ended without a settlement: the ``reason`` of a
    LEASE_EXPIRED event."""

    DEADLINE = "deadline"
    SESSION_TIMED_OUT = "session_timed_out"
    UNSUBSCRIBED = "unsubscribed"
    EVICTED = "evicted"
    OWNERSHIP_LOST = "ownership_lost"


# --- control topic ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Subscribe:
    consumer_id: str
    session_id: str
    request_id: str
    queue: str
    queue_is_regex: bool = False
    max_backlog: int | None = None
    filter: str | None = None
    delivery_topic: str
    session_timeout_ms: int
    client_name: str
    client_version: str
    sent_at_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Replace:
    consumer_id: str
    session_id: str
    request_id: str
    queue: str
    queue_is_regex: bool = False
    max_backlog: int | None = None
    filter: str | None = None
    delivery_topic: str
    sent_at_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    consumer_id: str
    session_id: str
    sent_at_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsubscribe:
    consumer_id: str
    session_id: str
    reason: str | None = None
    sent_at_ms: int


ControlMessage = Subscribe | Replace | Heartbeat | Unsubscribe


# --- ack topic -------------------------------------------------------------------------------


class AckItem(NamedTuple):
    """One acknowledgement in an `AckRecord`. A named tuple: consumers make one per message
    and the coordinator decodes one per message (a frozen dataclass cost three times more)."""

    queue: str
    bookmark: str
    lease: str
    type: AckType
    delay_ms: int | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AckRecord:
    consumer_id: str
    session_id: str
    sent_at_ms: int
    items: tuple[AckItem, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AcceptGroup:
    """Accepted entries of one queue on one journal partition, each with its lease token."""

    queue: str
    topic: str
    partition: int
    offsets: tuple[int, ...]
    leases: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AcceptRecord:
    """ACCEPT of many batch-delivered messages of one session (protocol 3)."""

    consumer_id: str
    session_id: str
    sent_at_ms: int
    groups: tuple[AcceptGroup, ...]

    def as_ack_record(self) -> AckRecord:
        """The same acknowledgements as AckRecord items, in order."""
        accept = AckType.ACCEPT
        return AckRecord(
            consumer_id=self.consumer_id, session_id=self.session_id,
            sent_at_ms=self.sent_at_ms,
            items=tuple(AckItem(g.queue, f"{g.topic}/{g.partition}/{offset}", lease, accept)
                        for g in self.groups
                        for offset, lease in zip(g.offsets, g.leases, strict=True)))


def ack_item_problem(item: AckItem) -> str | None:
    """Why the coordinator must answer ``item`` with ``AckStatus.INVALID``, or ``None``.

    Only what the protocol itself rules out; whether the entry and lease exist is the queue's
    business.
    """
    try:
        Bookmark.parse(item.bookmark)
    except ProtocolError as error:
        return error.message
    return ack_item_shape_problem(item)


def ack_item_shape_problem(item: AckItem) -> str | None:
    """`ack_item_problem` for an item whose bookmark was already parsed."""
    if not item.lease:
        return "lease token is empty"
    if item.delay_ms is not None:
        if item.type is AckType.RENEW:
            # Protocol 4: the lease's new length. SQS's ChangeMessageVisibility bounds it the
            # same way (at most 12 hours); ending a lease now is RELEASE's job.
            if not 1 <= item.delay_ms <= MAX_RENEW_MS:
                return (f"delay_ms of a RENEW must be between 1 and {MAX_RENEW_MS} "
                        f"(12 hours), got {item.delay_ms}")
        elif item.type is not AckType.RELEASE:
            return f"delay_ms is only allowed with RELEASE and RENEW, not {item.type.name}"
        elif not 0 <= item.delay_ms <= MAX_RELEASE_DELAY_MS:
            return (f"delay_ms of a RELEASE must be between 0 and {MAX_RELEASE_DELAY_MS} "
                    f"(24 hours), got {item.delay_ms}")
    if item.reason is not None and item.type is not AckType.REJECT:
        return f"reason is only allowed with REJECT, not {item.type.name}"
    return None


# --- replies (on the consumer's delivery topic) ----------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueGrant:
    queue: str
    max_backlog: int
    lease_period_ms: int
    semantics: GrantSemantics


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscribeResult:
    consumer_id: str
    session_id: str
    request_id: str
    request: RequestKind
    status: SubscribeStatus
    message: str | None = None
    queues: tuple[QueueGrant, ...] = ()
    session_timeout_ms: int
    heartbeat_interval_ms: int
    coordinator_id: str
    sent_at_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AckItemResult:
    queue: str
    bookmark: str
    type: AckType
    status: AckStatus
    lease_expires_ms: int | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AckResult:
    consumer_id: str
    session_id: str
    items: tuple[AckItemResult, ...]
    sent_at_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionEnded:
    consumer_id: str
    session_id: str
    reason: SessionEndReason
    message: str | None = None
    sent_at_ms: int


ReplyMessage = SubscribeResult | AckResult | SessionEnded


# --- events topic ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One state change. On the wire the bookmark is also split into ``topic``, ``partition``
    and ``offset`` columns, so Spark can join events with the journal without parsing."""

    type: EventType
    timestamp_ms: int
    coordinator_id: str
    coordinator_epoch: int
    queue: str | None = None
    bookmark: Bookmark | None = None
    consumer_id: str | None = None
    session_id: str | None = None
    delivery_count: int | None = None
    reason: str | None = None
    lease_expires_ms: int | None = None
    available_at_ms: int | None = None
    record_timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EventRun:
    """Events alike but for their entry, on the wire as one item of an `EventBatch`: what one
    iteration did to a run of entries of one journal partition (enqueued them, leased them to
    one consumer, accepted one consumer's acks). Three events per message, one by one, were
    a fifth of the coordinator's time; a run costs about what one event did."""

    type: EventType
    timestamp_ms: int
    coordinator_id: str
    coordinator_epoch: int
    queue: str
    topic: str
    partition: int
    offsets: tuple[int, ...]
    consumer_id: str | None = None
    session_id: str | None = None
    delivery_count: int | None = None
    reason: str | None = None
    lease_expires_ms: int | None = None
    #: The journal records' own timestamps, one per offset (ENQUEUED runs).
    record_timestamps_ms: tuple[int | None, ...] | None = None

    def events(self) -> list[Event]:
        """The run as the `Event`s it stands for, in the order of its offsets."""
        times = self.record_timestamps_ms
        if times is not None and len(times) != len(self.offsets):
            raise ValueError(f"an event run has {len(self.offsets)} offsets but "
                             f"{len(times)} record timestamps")
        return [Event(type=self.type, timestamp_ms=self.timestamp_ms,
                      coordinator_id=self.coordinator_id,
                      coordinator_epoch=self.coordinator_epoch, queue=self.queue,
                      bookmark=Bookmark(self.topic, self.partition, offset),
                      consumer_id=self.consumer_id, session_id=self.session_id,
                      delivery_count=self.delivery_count, reason=self.reason,
                      lease_expires_ms=self.lease_expires_ms,
                      record_timestamp_ms=times[i] if times is not None else None)
                for i, offset in enumerate(self.offsets)]


@dataclass(frozen=True, slots=True, kw_only=True)
class EventBatch:
    """The events of one coordinator iteration of one shard (protocol 3), runs expanded."""

    batch_id: int
    shard: int
    events: tuple[Event, ...]
