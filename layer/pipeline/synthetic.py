"""Protocol-correct synthetic event trails, for the pipeline's benchmark and tests.

Every entry gets exactly five events, in the order a coordinator writes them, for one of five
fates chosen by its offset: acked after two renewals, redelivered after an expired lease then
acked, released then acked by another consumer, rejected into the dead letters, or still
pending (leased, released, leased again, renewed). The expected totals are known from the
count alone (`expected_outcomes`), so a reader can check what the jobs compute.
"""

from __future__ import annotations

from collections.abc import Iterator

from layer.protocol import EventType
from layer.protocol.bookmark import Bookmark
from layer.protocol.records import Event

__all__ = ["EVENTS_PER_ENTRY", "FATES", "entry_trail", "expected_outcomes", "workload"]

#: Fates in offset order (offset % 10 picks one): four in ten renewed, two redelivered, two
#: released, one dead-lettered, one pending.
FATES = ("renewed", "renewed", "renewed", "renewed", "redelivered", "redelivered",
         "released", "released", "dead_lettered", "pending")
EVENTS_PER_ENTRY = 5


def entry_trail(queue: str, bookmark: Bookmark, enqueued_ms: int, fate: str,
                coordinator: str = "bench") -> list[Event]:
    """The five events of one entry enqueued at ``enqueued_ms``."""
    consumers = ("c1", "c2", "c3")
    first = consumers[bookmark.offset % 3]
    other = consumers[(bookmark.offset + 1) % 3]

    def event(kind: EventType, at: int, **fields: object) -> Event:
        return Event(type=kind, timestamp_ms=enqueued_ms + at, coordinator_id=coordinator,
                     coordinator_epoch=1, queue=queue, bookmark=bookmark,
                     **fields)  # type: ignore[arg-type]

    def lease(at: int, consumer: str, count: int) -> Event:
        return event(EventType.LEASED, at, consumer_id=consumer, session_id=f"s-{consumer}",
                     delivery_count=count, lease_expires_ms=enqueued_ms + at + 30_000)

    trail = [event(EventType.ENQUEUED, 0, record_timestamp_ms=enqueued_ms - 2)]
    if fate == "renewed":
        trail += [lease(5, first, 1),
                  event(EventType.RENEWED, 20, consumer_id=first, delivery_count=1,
                        lease_expires_ms=enqueued_ms + 50_020),
                  event(EventType.RENEWED, 40, consumer_id=first, delivery_count=1,
                        lease_expires_ms=enqueued_ms + 70_040),
                  event(EventType.ACKED, 60, consumer_id=first, delivery_count=1)]
    elif fate == "redelivered":
        trail += [lease(5, first, 1),
                  event(EventType.LEASE_EXPIRED, 30_005, consumer_id=first, delivery_count=1,
                        reason="deadline"),
                  lease(30_010, other, 2),
                  event(EventType.ACKED, 30_050, consumer_id=other, delivery_count=2)]
    elif fate == "released":
        trail += [lease(5, first, 1),
                  event(EventType.RELEASED, 15, consumer_id=first, delivery_count=1),
                  lease(20, other, 2),
                  event(EventType.ACKED, 45, consumer_id=other, delivery_count=2)]
    elif fate == "dead_lettered":
        trail += [lease(5, first, 1),
                  event(EventType.REJECTED, 25, consumer_id=first, delivery_count=1,
                        reason="bad payload"),
                  event(EventType.DEAD_LETTERED, 25, delivery_count=1, reason="rejected"),
                  event(EventType.EXPIRED, 25, delivery_count=1, reason="rejected")]
    else:  # pending
        trail += [lease(5, first, 1),
                  event(EventType.RELEASED, 15, consumer_id=first, delivery_count=1),
                  lease(20, other, 2),
                  event(EventType.RENEWED, 40, consumer_id=other, delivery_count=2,
                        lease_expires_ms=enqueued_ms + 60_040)]
    return trail


def workload(queue: str, journal: str, partitions: int, entries: int, start_ms: int,
             spacing_ms: int = 1) -> Iterator[Event]:
    """``entries`` entries of ``journal`` (offsets dealt round-robin over ``partitions``),
    one enqueued every ``spacing_ms`` from ``start_ms``; their events in entry order."""
    for i in range(entries):
        bookmark = Bookmark(journal, i % partitions, i // partitions)
        yield from entry_trail(queue, bookmark, start_ms + i * spacing_ms,
                               FATES[bookmark.offset % len(FATES)])


def expected_outcomes(entries: int, partitions: int) -> dict[str, int]:
    """How many of `workload`'s entries end acked, dead-lettered or pending."""
    counts = {"acked": 0, "dead_lettered": 0, "pending": 0}
    for i in range(entries):
        fate = FATES[(i // partitions) % len(FATES)]
        key = fate if fate in ("dead_lettered", "pending") else "acked"
        counts[key] += 1
    return counts
