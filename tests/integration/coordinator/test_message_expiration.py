"""A message's own expiration (the `qlayer.expiration` header, set by
`QueuePublisher.publish(expiration=...)` or `qlayer publish --expiration`) through a running
coordinator, on both shard cores.

The reference: "The expiration time is calculated based on the time that the message was
received on the local instance, the expiration time set on the individual message (if any),
and the ExpirationModel for the queue." qlayer's model (docs/queue-configuration.md): the
message's own expiration, counted from its record's timestamp, replaces the queue's.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from layer.protocol import Bookmark, parse_dead_letter_headers
from layer.sdk import QueuePublisher
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    TopicReader,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
)

from .test_options_expiry_and_backoff import core, journal_timestamp, no_more

__all__ = ["core"]  # the fixture, imported to run every test on both cores

pytestmark = pytest.mark.integration


def test_a_message_with_its_own_expiration_leaves_before_the_queues(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """A queue that keeps messages an hour; one message published with a 2 s expiration of its
    own ages out unread and is published to the dead-letter topic ("any expired message from
    ``Jobs`` will result in a message automatically published to ``FailedJobs``"); its
    neighbour, without one, is still there for the consumer that comes later."""
    jobs, failed = journal("Jobs", partitions=1), journal("FailedJobs", partitions=1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs, "expiration": "1h",
                          "dead_letter_topic": failed})
    dead_letters = TopicReader(settings.bootstrap_servers, failed)
    try:
        with running_coordinator(settings, core=core):
            with QueuePublisher(settings.bootstrap_servers,
                                topic_prefix=settings.topic_prefix) as publisher:
                publisher.publish(jobs, json.dumps({"job": "urgent"}), key="urgent",
                                  expiration=2.0, partition=0)
                publisher.publish(jobs, json.dumps({"job": "routine"}), key="routine",
                                  partition=0)
            (dead,) = dead_letters.read_until(lambda rs: len(rs) >= 1, timeout=30)
            assert dead.key == b"urgent"
            assert ("qlayer.expiration", b"2000") in dead.headers, "the original headers"
            info = parse_dead_letter_headers(dead.headers)
            assert (info.reason, info.queue, info.bookmark, info.delivery_count) == (
                "expiration", "Jobs", Bookmark(jobs, 0, 0), 0)
            enqueued_ms = journal_timestamp(settings, jobs)
            assert info.dead_lettered_at_ms >= enqueued_ms + 2000, (
                f"dead-lettered {info.dead_lettered_at_ms - enqueued_ms} ms after the record, "
                "before its 2 s expiration")
            wait_for_counters(settings, "Jobs", expired=1, dead_lettered=1)

            with Consumers(settings) as pool:
                worker = pool.subscribe("Jobs", max_backlog=5)
                (routine,) = worker.receive(1)
                assert (routine.key, routine.bookmark) == (
                    b"routine", Bookmark(jobs, 0, 1).format())
                worker.ack([routine])
                wait_for_counters(settings, "Jobs", acked=1)
                assert worker.idle(0.5) == [], "the expired message is not delivered"
            no_more(dead_letters, 1, 0.5)
    finally:
        dead_letters.close()


def test_a_longer_expiration_of_its_own_outlives_the_queues(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """The message's expiration replaces the queue's both ways: with a 1 s queue expiration, a
    message published with 1 h of its own is still delivered seconds later, while one
    without is gone. A malformed header is counted and ignored: that message keeps the
    queue's expiration (docs/protocol.md §5.3)."""
    jobs = journal("Jobs", partitions=1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs, "expiration": "1s"})
    with running_coordinator(settings, core=core):
        with QueuePublisher(settings.bootstrap_servers,
                            topic_prefix=settings.topic_prefix) as publisher:
            publisher.publish(jobs, b'{"job": "kept"}', key="kept", expiration=3600,
                              partition=0)
            publisher.publish(jobs, b'{"job": "queue"}', key="queue", partition=0)
        produce(settings.bootstrap_servers, jobs, [b'{"job": "bad"}'], keys=[b"bad"],
                headers=[("qlayer.expiration", b"soon")], partition=0)
        wait_for_counters(settings, "Jobs", expired=2)
        with Consumers(settings) as pool:
            worker = pool.subscribe("Jobs", max_backlog=5)
            (kept,) = worker.receive(1)
            assert kept.key == b"kept"
            worker.ack([kept])
            totals = wait_for_counters(settings, "Jobs", acked=1)
            assert (totals["expired"], totals["delivered"]) == (2, 1)
