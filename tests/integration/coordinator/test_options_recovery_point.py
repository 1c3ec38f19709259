"""`recovery_point` as a timestamp, through a running coordinator: which journal records
become entries of a new queue. Records are written with explicit timestamps (Kafka
CreateTime), as a producer replaying old data would.

Real coordinator loop, real Kafka and PostgreSQL; consumers built from the wire protocol only.
Every test runs on both shard cores (Python reference and native).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from confluent_kafka import Producer

from layer.protocol import Bookmark
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    Delivered,
    counters,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.fixture(params=["python", "native"])
def core(request: pytest.FixtureRequest) -> str:
    """The shard core the coordinator runs (CoordinatorOptions.core)."""
    if request.param == "native":
        from layer.domain.native import native_available

        if not native_available():  # the native core is an optional build
            pytest.skip("the qlayer_native extension is not installed")
    return str(request.param)


def produce_at(bootstrap_servers: str, topic: str,
               records: list[tuple[int, bytes, int]]) -> None:
    """(partition, value, timestamp ms) records, their timestamps set by the producer."""
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    for partition, value, timestamp_ms in records:
        producer.produce(topic, value, partition=partition, timestamp=timestamp_ms)
    assert producer.flush(30) == 0, f"records not written to {topic}"


def iso(timestamp_ms: int) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC).isoformat()


def where(d: Delivered) -> tuple[int, bytes | None]:
    return Bookmark.parse(d.bookmark).partition, d.value


def test_a_timestamp_recovery_point_enqueues_only_records_from_that_time_on(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`recovery_point` [RecoveryPoint] a timestamp. The reference: "If this is a new queue
    ... begin queue recovery at the configured recovery point"; docs/queue-configuration.md:
    "`beginning` | `end` | ISO-8601 timestamp with offset ... Where a new queue starts reading
    its journals." A record stamped at the recovery point or later becomes an entry; one
    stamped before does not; a partition with nothing that late starts at its end.
    """
    work = journal("Work", partitions=3)
    moment = (int(time.time()) - 600) * 1000  # ten minutes ago, to the second
    produce_at(settings.bootstrap_servers, work, [
        (0, b"p0-before", moment - 2000),
        (0, b"p0-at", moment),
        (0, b"p0-after", moment + 1000),
        (1, b"p1-before", moment - 500),
        (1, b"p1-after", moment + 5),
        (2, b"p2-before", moment - 3000),
        (2, b"p2-just-before", moment - 1),
    ])
    put_queues(settings, {"name": "Work", "underlying_topic": work,
                          "recovery_point": iso(moment)})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        worker = pool.subscribe("Work", max_backlog=10)
        got = worker.receive(3)
        assert sorted(where(d) for d in got) == [
            (0, b"p0-after"), (0, b"p0-at"), (1, b"p1-after")]
        assert worker.idle(1.0) == [], "records stamped before the recovery point came in"

        # New records enter, on every partition (p2 started at its end).
        produce(settings.bootstrap_servers, work, [b"p0-live"], partition=0)
        produce(settings.bootstrap_servers, work, [b"p2-live"], partition=2)
        live = worker.receive(2)
        assert sorted(where(d) for d in live) == [(0, b"p0-live"), (2, b"p2-live")]
        worker.ack(got + live)

        totals = wait_for_counters(settings, "Work", acked=5)
        assert (totals["enqueued"], totals["acked"], totals["delivered"]) == (5, 5, 5)
        wait_until(lambda: recovery_points(settings, "Work") == {
            (work, 0): 4, (work, 1): 2, (work, 2): 3},
            what="the recovery points past every record")
        assert worker.idle(0.3) == []
        assert counters(settings, "Work")["enqueued"] == 5


def test_a_restarted_queue_resumes_from_its_recovery_point_not_the_timestamp(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`recovery_point` applies to a new queue only. The reference: "If this is a new queue
    ... begin queue recovery at the configured recovery point" and "Otherwise, start from the
    most recent point in the transaction log at which all previous messages have been
    acknowledged." After a restart nothing acked comes back, nothing before the timestamp
    enters, and what was not acked is delivered again.
    """
    work = journal("Work", partitions=1)
    moment = (int(time.time()) - 600) * 1000
    produce_at(settings.bootstrap_servers, work, [
        (0, b"before", moment - 1000),
        (0, b"first", moment),
        (0, b"second", moment + 1),
    ])
    # The records are there before the queue, so they are leased as the consumer subscribes,
    # before it reads its (new) delivery topic: a lease long enough for that.
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "5s",
                          "recovery_point": iso(moment)})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        worker = pool.subscribe("Work", max_backlog=10)
        got = {d.value or b"": d for d in worker.receive(2)}
        assert sorted(got) == [b"first", b"second"]
        worker.ack([got[b"first"]])
        wait_for_counters(settings, "Work", acked=1)
        wait_until(lambda: recovery_points(settings, "Work").get((work, 0)) == 2,
                   what="the recovery point past the acked record")

    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        worker = pool.subscribe("Work", max_backlog=10)
        # The unacked record's lease is restored and ends at its deadline; then it returns.
        (again,) = worker.receive(1, timeout=20)
        assert (again.value, again.bookmark) == (b"second", got[b"second"].bookmark)
        assert again.delivery_count >= 2, "its first delivery is remembered"
        assert worker.idle(1.0) == [], "nothing acked, nothing before the timestamp, returns"
        worker.ack([again])
        totals = wait_for_counters(settings, "Work", acked=2)
        assert totals["acked"] == 2
        wait_until(lambda: recovery_points(settings, "Work").get((work, 0)) == 3,
                   what="the recovery point past every record")
