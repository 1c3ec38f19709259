"""`qlayer consumers [QUEUE]` and `qlayer consumers evict ID`.

The consumer rows are the coordinator's record of live subscriptions (DESIGN §3); an eviction
is a request the owning coordinator carries out within its refresh interval: it breaks the
consumer's leases at once (the entries go to other consumers) and tells the consumer
SessionEnded(EVICTED).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from layer.domain.definitions import DEFAULT_MAX_PER_SUBSCRIPTION_BACKLOG
from layer.domain.errors import UnknownConsumerError
from layer.services.coordinators import STALE_AFTER
from layer.services.queues import (
    NoSuchQueueError,
    WaitTimedOutError,
    attached_consumers,
    with_store_hints,
)
from layer.settings import Settings
from layer.store.rows import ConsumerRow
from layer.store.store import Store

__all__ = ["ConsumerInfo", "ConsumerService", "CreditPart", "EvictionResult",
           "NoSuchConsumerError"]

# DESIGN §4: a consumer that gives no max_backlog gets 1.
DEFAULT_CONSUMER_BACKLOG = 1


class NoSuchConsumerError(UnknownConsumerError):
    def __init__(self, consumer_id: str) -> None:
        super().__init__(consumer_id)
        self.args = (f"no consumer with id {consumer_id}; see `qlayer consumers`",)


@dataclass(frozen=True, slots=True)
class CreditPart:
    """One shard's part of a session that spans shards (protocol 8)."""

    shard: int
    grant: int
    """The credit the consumer granted this shard: it leases while it holds fewer."""
    owner_id: str | None
    """The coordinator process running the shard now (None: none runs it)."""


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    """One subscription as an operator sees it."""

    consumer_id: str
    session_id: str
    queue: str
    is_regex: bool
    max_backlog: int | None
    """What the consumer asked for (None: it gave none)."""
    backlog_limit: int | None
    """The backlog it gets: min(its max_backlog or 1, the queue's
    max_per_subscription_backlog); None for a regex spanning queues with different limits."""
    filter: str | None
    delivery_topic: str
    subscribed_at: float
    last_heartbeat_at: float
    heartbeat_age: float
    session_timeout: float
    evict_requested_at: float | None
    principal: str | None = None
    """The principal its credential proved (protocol 7); None: anonymous."""
    shard: int | None = None
    """The shard holding its session (None: stored before 0013)."""
    owner_id: str | None = None
    """The coordinator process running that shard now (`qlayer coordinators`); None when no
    running process holds it (the session's queues are not served until one takes it)."""
    credit: tuple[CreditPart, ...] | None = None
    """A session over queues of several shards (protocol 8): its part on each shard, home
    first, with the credit granted there; None for a session of one shard."""
    transactional_id: str | None = None
    """The Kafka transactional.id the session settles with (exactly-once processing,
    protocol 9); None: it settles outside transactions."""


@dataclass(frozen=True, slots=True)
class EvictionResult:
    consumer_id: str
    requested_at: float
    gone: bool
    """True when the caller waited and the coordinator removed the consumer."""


@dataclass
class ConsumerService:
    store: Store
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    poll_interval: float = 0.25
    _owned: list[Store] = field(default_factory=list, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> ConsumerService:
        store = Store(settings.database_url)
        return cls(store=store, _owned=[store])

    def close(self) -> None:
        for store in self._owned:
            store.close()

    def __enter__(self) -> ConsumerService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @with_store_hints
    def list_consumers(self, queue: str | None = None) -> list[ConsumerInfo]:
        """Every consumer, or those attached to ``queue`` (by name or by a regex over names)."""
        now = self.clock()
        limits = self._queue_limits()
        rows = self.store.load_consumers()
        if queue is not None:
            if queue not in limits:
                raise NoSuchQueueError(queue)
            rows = attached_consumers(queue, rows)
        owners = self._running_owners(now)
        spans: dict[str, list[ConsumerRow]] = {}
        if any(row.credit_home is not None for row in rows):
            for span in self.store.load_spans():
                spans.setdefault(span.consumer_id, []).append(span)
        return [
            _info(row, now, limits, owners, spans.get(row.consumer_id, ()))
            for row in sorted(rows, key=lambda r: (r.queue, r.consumer_id))
        ]

    @with_store_hints
    def evict(self, consumer_id: str, *, wait: float | None = None) -> EvictionResult:
        """Ask the coordinator to evict the consumer; with ``wait``, until its row is gone."""
        requested_at = self.clock()
        try:
            self.store.request_eviction(consumer_id, requested_at)
        except UnknownConsumerError:
            raise NoSuchConsumerError(consumer_id) from None
        if wait is None:
            return EvictionResult(consumer_id, requested_at, gone=False)
        deadline = time.monotonic() + wait
        while any(row.consumer_id == consumer_id for row in self.store.load_consumers()):
            if time.monotonic() >= deadline:
                raise WaitTimedOutError(
                    f"the eviction of {consumer_id} is requested but no coordinator carried it "
                    f"out within {wait:g}s; check that one runs (`qlayer coordinator run`)"
                )
            self.sleep(self.poll_interval)
        return EvictionResult(consumer_id, requested_at, gone=True)

    def _running_owners(self, now: float) -> dict[str, str]:
        """shard -> the process holding it, for processes still reporting (as `qlayer
        coordinators` judges them: a report within STALE_AFTER seconds)."""
        running = {p.owner_id for p in self.store.processes()
                   if now - p.seen_at <= STALE_AFTER}
        return {o.shard: o.owner_id for o in self.store.owners() if o.owner_id in running}

    def _queue_limits(self) -> dict[str, int]:
        limits = {}
        for record in self.store.list_queues():
            value = record.definition.get("max_per_subscription_backlog")
            limits[record.name] = (
                value if isinstance(value, int) else DEFAULT_MAX_PER_SUBSCRIPTION_BACKLOG
            )
        return limits


def _info(row: ConsumerRow, now: float, limits: dict[str, int],
          owners: dict[str, str] | None = None,
          spans: Iterable[ConsumerRow] = ()) -> ConsumerInfo:
    asked = DEFAULT_CONSUMER_BACKLOG if row.max_backlog is None else row.max_backlog
    if row.is_regex:
        matched = {limits[name] for name in limits if attached_consumers(name, [row])}
        queue_limit = matched.pop() if len(matched) == 1 else None
        limit = None if queue_limit is None else min(asked, queue_limit)
    else:
        limit = min(asked, limits[row.queue]) if row.queue in limits else asked
    return ConsumerInfo(
        consumer_id=row.consumer_id,
        session_id=row.session_id,
        queue=row.queue,
        is_regex=row.is_regex,
        max_backlog=row.max_backlog,
        backlog_limit=limit,
        filter=row.filter,
        delivery_topic=row.delivery_topic,
        subscribed_at=row.subscribed_at,
        last_heartbeat_at=row.last_heartbeat_at,
        heartbeat_age=max(now - row.last_heartbeat_at, 0.0),
        session_timeout=row.session_timeout_ms / 1000,
        evict_requested_at=row.evict_requested_at,
        principal=row.principal,
        shard=row.shard,
        owner_id=None if row.shard is None else (owners or {}).get(str(row.shard)),
        credit=None if row.credit_home is None or row.shard is None else tuple(
            CreditPart(part.shard, _grant(part), (owners or {}).get(str(part.shard)))
            for part in [row, *sorted((s for s in spans if s.session_id == row.session_id
                                       and s.shard is not None),
                                      key=lambda s: s.shard or 0)]
            if part.shard is not None),
        transactional_id=row.transactional_id,
    )


def _grant(row: ConsumerRow) -> int:
    return DEFAULT_CONSUMER_BACKLOG if row.max_backlog is None else row.max_backlog
