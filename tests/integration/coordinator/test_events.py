"""The events topic end to end: the audit trail docs/protocol.md §11 promises.

Every journal message that enters a queue has ENQUEUED first and exactly one outcome
(ACKED, EXPIRED, DELIVERED_AT_MOST_ONCE or BARRIER_DELIVERED) last; a dead-lettered entry has
DEAD_LETTERED just before its EXPIRED, a rejected one REJECTED with the consumer's reason.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import pytest

from layer.kafka import KafkaAdmin
from layer.protocol import AckType, Bookmark, Event, EventType
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    EventReader,
    produce,
    put_queues,
    running_coordinator,
)

pytestmark = pytest.mark.integration

OUTCOMES = {EventType.ACKED, EventType.EXPIRED, EventType.DELIVERED_AT_MOST_ONCE,
            EventType.BARRIER_DELIVERED}


def journal_bookmarks(settings: Settings, topic: str, partitions: int) -> set[str]:
    """Every record the journal holds, as bookmarks."""
    ends = KafkaAdmin(settings.kafka_config()).end_offsets([(topic, p) for p in range(partitions)])
    return {str(Bookmark(topic, p, o)) for (_, p), end in ends.items() for o in range(end)}


def by_bookmark(events: list[Event], queue: str) -> dict[str, list[Event]]:
    found: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e.queue == queue and e.bookmark is not None:
            found[str(e.bookmark)].append(e)
    return found


def test_every_message_has_enqueued_then_exactly_one_outcome(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    # 4 s: no lease may run out before the acks below are applied on a loaded machine.
    put_queues(settings, {"name": "Work", "underlying_topic": work, "max_cancels": 1,
                          "lease_period": "4s"})
    produced_at = int(time.time() * 1000)
    produce(settings.bootstrap_servers, work, [f"m{i}".encode() for i in range(8)],
            keys=[f"k{i}".encode() for i in range(8)])
    events = EventReader(settings)
    with running_coordinator(settings), Consumers(settings) as pool:
        worker = pool.subscribe("Work", max_backlog=8)
        deliveries = {d.value: d for d in worker.receive(8)}
        rejected, released, forgotten = deliveries[b"m0"], deliveries[b"m1"], deliveries[b"m2"]
        worker.ack([rejected], AckType.REJECT, reason="bad payload")
        worker.ack([released], AckType.RELEASE)  # max_cancels 1: dead-lettered at once
        worker.ack([d for v, d in deliveries.items() if v not in (b"m0", b"m1", b"m2")])
        (again,) = worker.receive(1, timeout=20)  # m2's lease expired
        assert again.value == b"m2"
        worker.ack([again])

        expected = journal_bookmarks(settings, work, 3)
        assert len(expected) == 8

        def settled(es: list[Event]) -> bool:
            entries = by_bookmark(es, "Work")
            return all(any(e.type in OUTCOMES for e in entries.get(b, [])) for b in expected)

        found = by_bookmark(events.read_until(settled), "Work")

    events.close()
    assert set(found) == expected
    for bookmark, trail in found.items():
        kinds = [e.type for e in trail]
        assert kinds[0] is EventType.ENQUEUED, (bookmark, kinds)
        assert kinds.count(EventType.ENQUEUED) == 1, (bookmark, kinds)
        assert sum(k in OUTCOMES for k in kinds) == 1, (bookmark, kinds)
        assert kinds[-1] in OUTCOMES, (bookmark, kinds)
        mark = Bookmark.parse(bookmark)
        for e in trail:
            assert (e.bookmark, e.queue) == (mark, "Work")
            assert e.coordinator_id and e.coordinator_epoch >= 1
        enqueued = trail[0]
        assert enqueued.record_timestamp_ms is not None
        assert enqueued.record_timestamp_ms >= produced_at - 1000
        for leased in (e for e in trail if e.type is EventType.LEASED):
            assert leased.consumer_id == worker.consumer_id
            assert leased.session_id == worker.session_id
            assert leased.delivery_count in (1, 2)
            assert leased.lease_expires_ms is not None
            # Both are whole milliseconds of float seconds: allow the rounding.
            assert abs(leased.lease_expires_ms - leased.timestamp_ms - 4000) <= 1

    def kinds_of(delivery_value: bytes) -> list[EventType]:
        delivery = rejected if delivery_value == b"m0" else released
        return [e.type for e in found[delivery.bookmark]]

    assert kinds_of(b"m0") == [EventType.ENQUEUED, EventType.LEASED, EventType.REJECTED,
                               EventType.DEAD_LETTERED, EventType.EXPIRED]
    assert kinds_of(b"m1") == [EventType.ENQUEUED, EventType.LEASED, EventType.RELEASED,
                               EventType.DEAD_LETTERED, EventType.EXPIRED]
    reject_trail = found[rejected.bookmark]
    assert reject_trail[2].reason == "bad payload"
    assert [e.reason for e in reject_trail[3:]] == ["rejected", "rejected"]
    assert [e.reason for e in found[released.bookmark][3:]] == ["max_cancels", "max_cancels"]
    assert [e.type for e in found[forgotten.bookmark]] == [
        EventType.ENQUEUED, EventType.LEASED, EventType.LEASE_EXPIRED, EventType.LEASED,
        EventType.ACKED]
    acked = [trail[-1] for trail in found.values() if trail[-1].type is EventType.ACKED]
    assert len(acked) == 6
    assert all(e.consumer_id == worker.consumer_id for e in acked)
