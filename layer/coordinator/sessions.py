"""Consumer sessions as a shard knows them (a session may span several queues of the shard)."""

from __future__ import annotations

from dataclasses import dataclass, field

from layer.domain.consumers import BacklogShare
from layer.domain.likepattern import name_matcher
from layer.store.rows import ConsumerRow

__all__ = ["Session"]


@dataclass
class Session:
    """A consumer's subscription as the coordinator knows it (it may span several queues)."""

    consumer_id: str
    session_id: str
    queue: str
    is_regex: bool
    max_backlog: int | None
    filter: str | None
    delivery_topic: str
    session_timeout: float
    subscribed_at: float
    queues: list[str]
    #: One backlog across the queues of a regex subscription (AMPS; `BacklogShare`).
    share: BacklogShare | None = None
    #: How its deliveries are written: ``batch`` (protocol 3) or ``record`` (one per message).
    delivery_format: str = "record"
    #: Queues a replace took the subscription off, where its consumer still holds leases
    #: (`QueueEngine.retire`): heartbeats and the session's end reach them too.
    draining: list[str] = field(default_factory=list)
    #: SHA-256 of the session's secret (protocol 5, `layer.coordinator.identity`); None for an
    #: unproven session (a consumer that sent none).
    secret_hash: bytes | None = None
    #: The principal its credential proved (protocol 7, `layer.domain.authorization`), None
    #: for an anonymous session, and the SHA-256 of the credential's secret: a catalog load
    #: that finds the principal removed, rotated or no longer granted the queues ends it.
    principal: str | None = None
    credential_hash: bytes | None = None
    #: Protocol 8: the home shard of a session whose consumer grants each shard credit (its
    #: ``max_backlog`` here is this shard's grant); None: a session of one shard.
    home: int | None = None
    #: The last ``(held, grant, waiting)`` this shard reported to the consumer (protocol 8).
    reported: tuple[int, int, int] | None = None
    #: Protocol 9: the Kafka transactional.id the consumer settles with; its leases are broken
    #: only once this shard has fenced it (`layer.coordinator.fences`). None: not transactional.
    transactional_id: str | None = None

    def is_span(self, shard: int) -> bool:
        """Whether this is a part of a session whose home is another shard."""
        return self.home is not None and self.home != shard

    @property
    def every_queue(self) -> list[str]:
        """The queues the session is subscribed to, then those it still drains."""
        return self.queues + [q for q in self.draining if q not in self.queues]

    def matches(self, queue: str) -> bool:
        if self.is_regex:
            return name_matcher(self.queue)(queue)
        return self.queue == queue

    @classmethod
    def from_row(cls, row: ConsumerRow) -> Session:
        """The session a stored consumer row describes (before it is subscribed anywhere)."""
        return cls(row.consumer_id, row.session_id, row.queue, row.is_regex, row.max_backlog,
                   row.filter, row.delivery_topic, row.session_timeout_ms / 1000.0,
                   row.subscribed_at, [], BacklogShare() if row.is_regex else None,
                   row.delivery_format, secret_hash=row.secret_hash,
                   principal=row.principal, credential_hash=row.credential_hash,
                   home=row.credit_home, transactional_id=row.transactional_id)
