"""Small helpers shared by the queue engine tests (not a test module)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from layer.domain.definitions import QueueDefinition
from layer.domain.engine import EntryAck, QueueEngine, random_tokens
from layer.domain.entries import OfferedRecord
from layer.domain.events import EntryLeased, Event
from layer.domain.native import NativeQueueEngine
from layer.domain.states import AckOutcome, AckType, Bookmark

TOPIC = "Work"

#: Which engine the tests get: the Python reference or the native port (tests/unit/domain/
#: conftest.py runs every engine test with both).
IMPLEMENTATION = ["python"]


def engine(seed: int = 7, session_timeout: float = 1e6, implementation: str | None = None,
           **fields: object) -> QueueEngine:
    """A queue ``Q`` over journal ``Work`` with the given definition fields.

    Sessions never time out unless a test asks for it (``session_timeout``).
    ``implementation`` ("python" or "native") overrides `IMPLEMENTATION`.
    """
    fields.setdefault("max_per_subscription_backlog", 100)
    definition = QueueDefinition.model_validate({"name": "Q", "underlying_topic": TOPIC, **fields})
    chosen = implementation or IMPLEMENTATION[0]
    kind = NativeQueueEngine if chosen == "native" else QueueEngine
    return kind(  # type: ignore[return-value]
        definition, tokens=random_tokens(random.Random(seed)), session_timeout=session_timeout
    )


def record(
    offset: int,
    doc: object = None,
    *,
    partition: int = 0,
    key: bytes | None = None,
    timestamp: float | None = 0.0,
    deliver_at: float | None = None,
    topic: str = TOPIC,
    expiration: float | None = None,
) -> OfferedRecord:
    return OfferedRecord(topic, partition, offset, key, doc, timestamp, deliver_at, expiration)


def offer(queue: QueueEngine, docs: Iterable[object], *, start: int = 0, now: float = 0.0) -> int:
    """Enqueue one record per document at consecutive offsets of partition 0."""
    return queue.enqueue([record(start + i, doc) for i, doc in enumerate(docs)], now)


def serve_rereads(queue: QueueEngine, journal: Iterable[OfferedRecord], now: float = 0.0
                  ) -> int:
    """Do what the coordinator does for `records_wanted` (target_queue_depth): read the
    deferred ranges from ``journal`` (every record offered so far) and offer them back, again
    while that makes progress. Returns how many entries were admitted."""
    records = sorted(journal, key=lambda r: (r.topic, r.partition, r.offset))
    admitted = 0
    asked: list[object] = []
    wanted = queue.records_wanted()
    while wanted and wanted != asked:
        got: list[OfferedRecord] = []
        through: dict[tuple[str, int], int] = {}
        for w in wanted:
            part = [r for r in records if (r.topic, r.partition) == (w.topic, w.partition)
                    and w.from_offset <= r.offset < w.until][:w.max_records]
            through[(w.topic, w.partition)] = (part[-1].offset + 1
                                               if len(part) == w.max_records else w.until)
            got.extend(part)
        got.sort(key=lambda r: (r.timestamp or 0.0, r.partition))
        admitted += queue.readmit(got, through, now)
        asked, wanted = wanted, queue.records_wanted()
    return admitted


def bm(offset: int, partition: int = 0) -> Bookmark:
    return Bookmark(TOPIC, partition, offset)


def subscribe(
    queue: QueueEngine,
    consumer_id: str,
    *,
    max_backlog: int | None = None,
    filter: str | None = None,
    now: float = 0.0,
    session: str | None = None,
) -> None:
    queue.subscribe(
        consumer_id,
        session or f"{consumer_id}-session",
        now,
        delivery_topic=f"deliver.{consumer_id}",
        max_backlog=max_backlog,
        filter=filter,
    )


def leases(deliveries: Sequence[object]) -> list[EntryLeased]:
    return [d for d in deliveries if isinstance(d, EntryLeased)]


def offsets_of(deliveries: Sequence[object]) -> list[int]:
    return [d.bookmark.offset for d in leases(deliveries)]


def by_consumer(deliveries: Sequence[object]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for lease in leases(deliveries):
        found.setdefault(lease.consumer_id, []).append(lease.bookmark.offset)
    return found


def settle(
    queue: QueueEngine,
    lease: EntryLeased,
    kind: AckType = AckType.ACCEPT,
    *,
    now: float = 0.0,
    delay: float | None = None,
    reason: str | None = None,
    token: str | None = None,
) -> AckOutcome:
    item = EntryAck(lease.bookmark, lease.token if token is None else token, kind, delay, reason)
    return queue.ack([item], now)[0]


def of_type(events: Iterable[Event], kind: type) -> list[Event]:
    return [event for event in events if isinstance(event, kind)]
