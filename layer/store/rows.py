"""The values the store reads and writes: plain frozen dataclasses, times as epoch seconds.

They mirror the rows of `layer.store.tables` and nothing more, so the coordinator maps its
domain objects to them in one place and the store never imports the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

from layer.domain.shards import part_shards
from layer.domain.states import EntryState

__all__ = [
    "ConsumerRow",
    "EntryKey",
    "EntryRow",
    "Ownership",
    "PartitionKey",
    "ProcessRow",
    "QueueCounters",
    "QueueMove",
    "QueueRecord",
    "StoredState",
    "parts_in",
    "stored_state",
]

StoredState = Literal["AVAILABLE", "LEASED", "ACKED", "EXPIRED"]

_STORED: Final[dict[EntryState, StoredState]] = {
    EntryState.AVAILABLE: "AVAILABLE",
    # DELAYED and INACTIVE are AVAILABLE entries the engine may not deliver yet: the row says
    # AVAILABLE and `available_at` (for DELAYED) says when; INACTIVE follows from the queue's
    # target_queue_depth on reload.
    EntryState.DELAYED: "AVAILABLE",
    EntryState.INACTIVE: "AVAILABLE",
    EntryState.LEASED: "LEASED",
    EntryState.ACKED: "ACKED",
    EntryState.EXPIRED: "EXPIRED",
}


def stored_state(state: EntryState) -> StoredState:
    """The `entries.state` value for an engine state (the DESIGN §1 states only)."""
    return _STORED[state]


class EntryKey(NamedTuple):
    """An entry's identity: its queue and its bookmark."""

    queue: str
    topic: str
    partition: int
    offset: int


class PartitionKey(NamedTuple):
    """One journal partition as one queue sees it: the key of a recovery point."""

    queue: str
    topic: str
    partition: int


class EntryRow(NamedTuple):
    """A touched entry. Lease fields are set exactly when ``state == "LEASED"``.

    A named tuple, unlike the other rows: the coordinator makes one or two per message.
    """

    queue: str
    topic: str
    partition: int
    offset: int
    state: StoredState
    delivery_count: int = 0
    cancel_count: int = 0
    lease_consumer: str | None = None
    lease_token: str | None = None
    lease_deadline: float | None = None
    available_at: float | None = None
    reason: str | None = None

    @property
    def key(self) -> EntryKey:
        return EntryKey(self.queue, self.topic, self.partition, self.offset)

    @property
    def partition_key(self) -> PartitionKey:
        return PartitionKey(self.queue, self.topic, self.partition)


@dataclass(frozen=True, slots=True)
class ConsumerRow:
    """A subscription and its session, as the coordinator last learned it."""

    consumer_id: str
    session_id: str
    queue: str
    is_regex: bool
    delivery_topic: str
    session_timeout_ms: int
    subscribed_at: float
    last_heartbeat_at: float
    max_backlog: int | None = None
    filter: str | None = None
    client_info: Mapping[str, Any] | None = None
    # Set when an operator asked to evict the consumer (read only; upserts leave it alone).
    evict_requested_at: float | None = None
    #: ``batch`` (delivery batches, protocol 3) or ``record`` (one record per message).
    delivery_format: str = "record"
    #: SHA-256 of the session's secret (protocol 5, docs/security.md "Session identity");
    #: None for a session that gave none (an older client). The secret is never stored.
    secret_hash: bytes | None = None
    #: The shard holding the session (only it writes the row; None: written before 0013).
    shard: int | None = None
    #: The principal the session's credential proved (None: anonymous), and the SHA-256 of
    #: that credential's secret (a rotation ends the session).
    principal: str | None = None
    credential_hash: bytes | None = None
    #: Protocol 8: the session's home shard when its consumer grants it credit (a
    #: subscription over queues of several shards); None: a session of one shard. A row whose
    #: ``shard`` differs from it is a part of the session on another shard (`consumer_spans`).
    credit_home: int | None = None
    #: Protocol 9: the Kafka transactional.id the session settles with (exactly-once
    #: processing), fenced before any of its leases is broken; None: not transactional.
    transactional_id: str | None = None

    @property
    def is_span(self) -> bool:
        """A part of a session on a shard other than its home (a `consumer_spans` row)."""
        return self.credit_home is not None and self.shard != self.credit_home


@dataclass(frozen=True, slots=True)
class QueueRecord:
    """A stored queue definition; ``definition`` is the JSON the CLI wrote, uninterpreted."""

    name: str
    definition: Mapping[str, Any]
    version: int
    created_at: float
    updated_at: float
    deleted_at: float | None = None
    purge_requested_at: float | None = None
    purged_at: float | None = None
    #: The shard whose coordinator serves the queue (DESIGN §3).
    shard: int = 0
    #: The pending (or last) purge's filter; None acknowledges every entry.
    purge_filter: str | None = None
    #: Entries the last completed purge or ack by filter acknowledged (None: not known).
    purge_acked: int | None = None
    #: Where `qlayer queue reset` (or a changed recovery_point) moves the positions to.
    reset_to: str | None = None
    reset_requested_at: float | None = None
    reset_done_at: float | None = None
    #: The recovery_point setting the queue's positions were set from.
    positions_from: str | None = None

    @property
    def deleted(self) -> bool:
        return self.deleted_at is not None

    @property
    def parts(self) -> int:
        """The queue's ``parts`` (`parts_in` its stored definition)."""
        return parts_in(self.definition)

    def part_shards(self, shard_count: int) -> tuple[int, ...]:
        """The shard serving each part; ``shard`` is the first part's (docs/coordinator.md,
        "Partitioned queues")."""
        return part_shards(self.shard, self.parts, shard_count)

    @property
    def reset_pending(self) -> bool:
        """A reset was asked for and the owning coordinator has not done it yet."""
        if self.reset_requested_at is None or self.reset_to is None:
            return False
        return self.reset_done_at is None or self.reset_done_at < self.reset_requested_at

    @property
    def purge_pending(self) -> bool:
        """A purge was asked for and the owning coordinator has not done it yet."""
        if self.purge_requested_at is None:
            return False
        return self.purged_at is None or self.purged_at < self.purge_requested_at


def parts_in(definition: Mapping[str, Any]) -> int:
    """The ``parts`` of a stored definition, uninterpreted otherwise: 1 when it has none or
    none that is a count of several."""
    parts = definition.get("parts", 1)
    return parts if isinstance(parts, int) and not isinstance(parts, bool) and parts > 1 else 1


@dataclass(frozen=True, slots=True)
class Ownership:
    """Who runs a shard, under which epoch, and how far behind it was when it last said."""

    shard: str
    owner_id: str
    epoch: int
    acquired_at: float
    heartbeat_at: float
    #: Journal, control and ack records not read yet at `reported_at` (None: not reported).
    lag: int | None = None
    reported_at: float | None = None
    #: The shard's running totals of input faults and isolated poison input (0008).
    counters: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProcessRow:
    """A running coordinator process and the shards the group assigned it."""

    owner_id: str
    host: str
    pid: int
    started_at: float
    seen_at: float
    shards: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class QueueMove:
    """What `Store.move_queue` did."""

    queue: str
    from_shard: int
    to_shard: int
    version: int


@dataclass(frozen=True, slots=True)
class QueueCounters:
    """Running totals for one queue (names as `layer.store.tables.COUNTER_NAMES`)."""

    queue: str
    enqueued: int = 0
    delivered: int = 0
    redelivered: int = 0
    acked: int = 0
    released: int = 0
    lease_expired: int = 0
    dead_lettered: int = 0
    expired: int = 0
    unparseable: int = 0
    deletes: int = 0
    malformed_headers: int = 0
    journal_deleted: int = 0
    rejected: int = 0
    updated_at: float | None = None
