"""A recovery point older than the journal's log start: Kafka retention deleted records the
queue had not finished. The queue resumes at the log start and says what it lost: each lost
entry is EXPIRED with reason `retention` (events topic, counters), never silently skipped."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from layer.protocol import Bookmark, Event, EventType
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    EventReader,
    collect,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration

PER_PARTITION = 10
DELETED_BELOW = 5


def delete_records_before(bootstrap_servers: str, topic: str, partitions: int,
                          offset: int) -> None:
    """What retention does, on demand: the partition's log start moves to ``offset``."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    futures = admin.delete_records([TopicPartition(topic, p, offset) for p in range(partitions)])
    for future in futures.values():
        assert future.result(timeout=30).low_watermark == offset


def test_records_deleted_before_the_queue_was_done_are_expired_with_reason_retention(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "2s",
                          "max_per_subscription_backlog": 3 * PER_PARTITION})
    for p in range(3):
        produce(settings.bootstrap_servers, work,
                [f"p{p}-{i}".encode() for i in range(PER_PARTITION)], partition=p)
    every = {str(Bookmark(work, p, o)) for p in range(3) for o in range(PER_PARTITION)}

    # First run: one entry acked, one delivered and returned (touched: it has a row in
    # PostgreSQL), the rest never delivered (known only from the journal).
    with running_coordinator(settings), Consumers(settings) as pool:
        early = pool.subscribe("Work")
        (done,) = early.receive(1)
        early.ack([done])
        (returned,) = early.receive(1)
        early.unsubscribe()
        wait_for_counters(settings, "Work", acked=1, lease_expired=1)
    assert Bookmark.parse(returned.bookmark).offset < DELETED_BELOW

    delete_records_before(settings.bootstrap_servers, work, 3, DELETED_BELOW)
    lost = {b for b in every if Bookmark.parse(b).offset < DELETED_BELOW} - {done.bookmark}
    left = {b for b in every if Bookmark.parse(b).offset >= DELETED_BELOW} - {done.bookmark}

    events = EventReader(settings)
    with running_coordinator(settings), Consumers(settings) as pool:
        late = pool.subscribe("Work", max_backlog=len(left))
        got = collect([late], len(left))[late.consumer_id]
        late.ack(got)
        assert {d.bookmark for d in got} == left, "everything still in the journal is delivered"
        assert late.idle(0.3) == []

        def expired_for_retention(es: list[Event]) -> set[str]:
            return {str(e.bookmark) for e in es
                    if e.type is EventType.EXPIRED and e.reason == "retention"}

        found = events.read_until(lambda es: expired_for_retention(es) >= lost)
        assert expired_for_retention(found) == lost, "each lost entry is reported, once"
        totals = wait_for_counters(settings, "Work", acked=1 + len(left))
        assert (totals["acked"], totals["expired"]) == (1 + len(left), len(lost))
        wait_until(lambda: recovery_points(settings, "Work")
                   == {(work, p): PER_PARTITION for p in range(3)},
                   what="recovery points at the journal's end")
    events.close()


def test_records_deleted_while_the_coordinator_runs_are_reported_too(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """Retention catches up with a running coordinator: entries whose bytes were past the
    memory budget can no longer be read back. The coordinator notices (the reader refuses to
    skip), rebuilds from its stored state and reports exactly the lost entries."""
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "30s",
                          "max_per_subscription_backlog": 100})
    total, deleted_below = 100, 50
    produce(settings.bootstrap_servers, work, [b"%03d" % i + b"." * 1000 for i in range(total)],
            partition=0)
    events = EventReader(settings)
    with running_coordinator(settings, payload_budget=5_000) as coordinator, \
            Consumers(settings) as pool:
        wait_until(lambda: coordinator.counters["journal_records"] >= total or None,
                   what="every record queued")
        delete_records_before(settings.bootstrap_servers, work, 1, deleted_below)
        late = pool.subscribe("Work", max_backlog=total)
        got = collect([late], total - deleted_below, timeout=60)[late.consumer_id]
        late.ack(got)
        assert {Bookmark.parse(d.bookmark).offset for d in got} == set(
            range(deleted_below, total))
        assert coordinator.counters["iteration_failures"] >= 1
        lost = {str(Bookmark(work, 0, o)) for o in range(deleted_below)}
        found = events.read_until(lambda es: {
            str(e.bookmark) for e in es
            if e.type is EventType.EXPIRED and e.reason == "retention"} >= lost)
        assert {str(e.bookmark) for e in found
                if e.type is EventType.EXPIRED and e.reason == "retention"} == lost
        wait_until(lambda: recovery_points(settings, "Work") == {(work, 0): total} or None,
                   what="recovery point at the journal's end")
    events.close()
