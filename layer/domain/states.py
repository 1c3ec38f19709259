"""Entry states and the small vocabularies of the queue engine (DESIGN §1, §4).

The state diagram and the transition that moves an entry along each edge are in
``docs/engine.md``. Values are small integers so the engine can keep one state byte per entry
in a ``bytearray`` (the memory budget is ~150 bytes per queued entry, DESIGN §2).
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Final, NamedTuple

__all__ = [
    "DONE_STATES",
    "LIVE_STATES",
    "AckOutcome",
    "AckSource",
    "AckType",
    "Bookmark",
    "EntryState",
    "ExpiryReason",
    "LeaveReason",
]


class EntryState(IntEnum):
    """Where one entry of one queue is in its life.

    ``AVAILABLE``, ``LEASED``, ``ACKED`` and ``EXPIRED`` are the states of DESIGN §1.
    ``DELAYED`` (a deliver-at time or a release delay not reached yet) and ``INACTIVE``
    (beyond the queue's ``target_queue_depth``) are AVAILABLE entries the queue may not
    deliver yet; they keep their place in the queue order.
    """

    AVAILABLE = 1
    LEASED = 2
    DELAYED = 3
    INACTIVE = 4
    ACKED = 5
    EXPIRED = 6

    @property
    def done(self) -> bool:
        """ACKED and EXPIRED entries have left the queue for good."""
        return self >= EntryState.ACKED


DONE_STATES: Final = frozenset({EntryState.ACKED, EntryState.EXPIRED})
LIVE_STATES: Final = frozenset(
    {EntryState.AVAILABLE, EntryState.LEASED, EntryState.DELAYED, EntryState.INACTIVE}
)


class AckType(IntEnum):
    """What a consumer says about a leased entry: one enum for the engine and the wire.

    Names and numbers are Kafka's share-group ``AcknowledgeType`` ids (ACCEPT/RELEASE/REJECT
    from KIP-932, RENEW from KIP-1222); AMPS calls the first three ack (no option), ``cancel``
    and ``expire``; ``RENEW`` extends the lease instead of ending it. On the wire it is an
    Avro enum, encoded by symbol position (``id - 1``).
    """

    ACCEPT = 1
    RELEASE = 2
    REJECT = 3
    RENEW = 4


class AckOutcome(StrEnum):
    """The engine's answer to one ack item; anything but APPLIED/REMEMBERED changed nothing."""

    APPLIED = "applied"
    REMEMBERED = "remembered"  # an ack for an entry beyond target_queue_depth not read yet
    WRONG_TOKEN = "wrong-token"  # strict leasing: the token is not the current holder's
    NOT_LEASED = "not-leased"  # the entry is in the queue but this ack needs a lease
    ALREADY_DONE = "already-done"  # duplicate: the entry was acked or expired before
    UNKNOWN_BOOKMARK = "unknown-bookmark"  # never enqueued in this queue


class AckSource(StrEnum):
    """Who made an entry ACKED."""

    CONSUMER = "consumer"  # an ACCEPT from a consumer (the holder, or anyone if permissive)
    ADMIN = "admin"  # an acknowledgement by filter (AMPS sow_delete with a filter)
    DELIVERY = "delivery"  # at-most-once: the entry leaves the queue when it is delivered
    BARRIER = "barrier"  # a barrier message leaves the queue when it is delivered
    EARLY = "early"  # an ack remembered for an entry beyond target_queue_depth


class ExpiryReason(StrEnum):
    """Why an entry left the queue unprocessed (EXPIRED); the dead-letter reason header."""

    MAX_DELIVERIES = "max-deliveries"
    MAX_CANCELS = "max-cancels"
    REJECTED = "rejected"
    EXPIRATION = "expiration"
    RETENTION = "retention"  # the journal record was deleted by Kafka retention
    #: The record is larger than the coordinator may write to a delivery topic (the producer's
    #: ``message.max.bytes``, or a topic's lower ``max.message.bytes``, which refused it).
    TOO_LARGE = "too-large"
    #: The journal topic was deleted while the queue read it: nothing is left to deliver.
    JOURNAL_DELETED = "journal-deleted"

    @property
    def dead_letter(self) -> bool:
        """Whether the coordinator writes the entry to the dead-letter topic.

        Expiration by age is a normal way to leave a queue in AMPS, not an error, so it is
        dead-lettered only when the queue asks for it (``dead_letter_topic`` or
        ``dead_letter_expired``, decided by the engine); retention and a deleted journal have
        no payload to write. A record too large to deliver is dead-lettered (its value left
        out when it does not fit either: `layer.coordinator.output`).
        """
        return self in (
            ExpiryReason.MAX_DELIVERIES,
            ExpiryReason.MAX_CANCELS,
            ExpiryReason.REJECTED,
            ExpiryReason.TOO_LARGE,
        )


class LeaveReason(StrEnum):
    """Why a consumer's leases were all broken at once."""

    UNSUBSCRIBED = "unsubscribed"
    SESSION_TIMEOUT = "session-timeout"
    SESSION_REPLACED = "session-replaced"  # the same consumer id subscribed with a new session
    EVICTED = "evicted"  # an operator removed the consumer (qlayer consumers evict)
    #: A replace took the subscription off the queue; it stayed until its leases there were
    #: settled or ended (AMPS: a replace "does not break message leases").
    REPLACED = "replaced"


class Bookmark(NamedTuple):
    """Where a journal record lives, and so the identity of a queue entry (DESIGN §1)."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"

    @classmethod
    def parse(cls, text: str) -> Bookmark:
        """Read ``topic/partition/offset`` (Kafka topic names never contain ``/``)."""
        topic, partition, offset = text.rsplit("/", 2)
        if not topic:
            raise ValueError(f"bookmark {text!r} has no topic")
        return cls(topic, int(partition), int(offset))
