"""The records the Kafka adapters hand to the coordinator: plain slotted values, no driver types."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# confluent-kafka accepts None header values and returns them as None.
Headers = list[tuple[str, bytes | None]]


@dataclass(slots=True, frozen=True)
class JournalRecord:
    """One record read from a journal (or an input topic). Timestamp in ms since the epoch."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: Headers | None


@dataclass(slots=True, frozen=True)
class OutgoingRecord:
    """One record to write: a delivery, a dead letter, an event or a reply."""

    topic: str
    value: bytes | None
    key: bytes | None = None
    headers: Sequence[tuple[str, bytes | None]] | None = None
    timestamp_ms: int | None = None
    partition: int | None = None
