"""Time-driven queue options through a running coordinator: `expiration` with a dead-letter
topic (read back with a plain Kafka consumer, as any team would) and `redelivery_backoff`.

Real coordinator loop, real Kafka and PostgreSQL; consumers built from the wire protocol only.
Every test runs on both shard cores (Python reference and native).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from layer.protocol import (
    AckType,
    Bookmark,
    EventType,
    TopicNames,
    header_value,
    parse_dead_letter_headers,
)
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    EventReader,
    TopicReader,
    TopicRecord,
    counters,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration

JOB = json.dumps({"job": 42, "kind": "render"}).encode()
HEADERS = [("trace-id", b"t-123"), ("origin", b"billing")]


@pytest.fixture(params=["python", "native"])
def core(request: pytest.FixtureRequest) -> str:
    """The shard core the coordinator runs (CoordinatorOptions.core)."""
    if request.param == "native":
        from layer.domain.native import native_available

        if not native_available():  # the native core is an optional build
            pytest.skip("the qlayer_native extension is not installed")
    return str(request.param)


def produce_at(bootstrap_servers: str, topic: str,
               records: list[tuple[bytes | None, bytes, int]], partition: int = 0) -> None:
    """(key, value, timestamp ms) records with their timestamps set by the producer."""
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    for key, value, timestamp_ms in records:
        producer.produce(topic, value, key=key, partition=partition, timestamp=timestamp_ms)
    assert producer.flush(30) == 0, f"records not written to {topic}"


def journal_timestamp(settings: Settings, topic: str, offset: int = 0) -> int:
    """The record's own timestamp (ms) in the journal, partition 0."""
    reader = TopicReader(settings.bootstrap_servers, topic)
    try:
        records = reader.read_until(lambda rs: any(r.offset == offset for r in rs))
        return next(r.timestamp_ms for r in records if r.offset == offset)
    finally:
        reader.close()


def no_more(reader: TopicReader, expected: int, seconds: float) -> list[TopicRecord]:
    """Read for ``seconds`` more; everything the reader saw (to check a count stayed put)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reader.read(0.2)
    assert len(reader.records) == expected, (
        f"{reader.topic}: {len(reader.records)} records, expected {expected}")
    return reader.records


def lease_expires_ms(headers: list[tuple[str, bytes | None]]) -> int:
    value = header_value(headers, "qlayer.lease-expires")
    assert value is not None
    return int(value)


# --------------------------------------------------------------------------- expiration


def test_an_expired_message_is_published_to_the_dead_letter_topic(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`expiration` [Expiration] with `dead_letter_topic` (the reference's
    amps-action-on-sow-expire-message): "With this action configured, any expired message
    from ``Jobs`` will result in a message automatically published to ``FailedJobs``
    containing the original message". And: "If the message has been in the queue longer than
    the Expiration time, and there is no current lease on the message, AMPS removes the
    message from the queue."
    """
    jobs, failed = journal("Jobs", partitions=1), journal("FailedJobs", partitions=1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs, "expiration": "2s",
                          "dead_letter_topic": failed})
    dead_letters = TopicReader(settings.bootstrap_servers, failed)
    try:
        with running_coordinator(settings, core=core):
            # Nobody subscribes to Jobs: the job ages out of the queue.
            produce(settings.bootstrap_servers, jobs, [JOB], keys=[b"job-42"],
                    headers=HEADERS)
            (dead,) = dead_letters.read_until(lambda rs: len(rs) >= 1, timeout=30)
            assert (dead.key, dead.value) == (b"job-42", JOB), "the original message"
            assert [h for h in dead.headers if not h[0].startswith("qlayer.")] == HEADERS
            info = parse_dead_letter_headers(dead.headers)
            assert (info.reason, info.queue, info.bookmark) == (
                "expiration", "Jobs", Bookmark(jobs, 0, 0))
            assert (info.delivery_count, info.last_consumer) == (0, None)
            enqueued_ms = journal_timestamp(settings, jobs)
            assert info.dead_lettered_at_ms >= enqueued_ms + 2000, (
                f"dead-lettered {info.dead_lettered_at_ms - enqueued_ms} ms after the record, "
                "before the 2s expiration")

            totals = wait_for_counters(settings, "Jobs", expired=1)
            assert (totals["expired"], totals["dead_lettered"], totals["delivered"]) == (1, 1, 0)
            wait_until(lambda: recovery_points(settings, "Jobs").get((jobs, 0)) == 1,
                       what="the expired job to leave the queue")
            no_more(dead_letters, 1, 1.0)  # published once
    finally:
        dead_letters.close()


def test_a_leased_message_past_its_expiration_leaves_when_its_lease_ends(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`expiration` with a lease: "If the message has been in the queue longer than the
    Expiration time or has been delivered more than the number of times specified by
    MaxDeliveries, AMPS removes the message from the queue when the lease expires." A lease
    holder may still acknowledge a message past its expiration ("and there is no current
    lease on the message" is the condition for removing it); the other lands on the
    dead-letter topic ("any expired message from ``Jobs`` will result in a message
    automatically published to ``FailedJobs``").
    """
    jobs, failed = journal("Jobs", partitions=1), journal("FailedJobs", partitions=1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs, "expiration": "1s",
                          "lease_period": "3s", "dead_letter_topic": failed})
    dead_letters = TopicReader(settings.bootstrap_servers, failed)
    try:
        with running_coordinator(settings, core=core), Consumers(settings) as pool:
            worker = pool.subscribe("Jobs", max_backlog=2)
            produce(settings.bootstrap_servers, jobs, [b'{"job": "done"}', b'{"job": "hung"}'],
                    keys=[b"done", b"hung"])
            done, hung = sorted(worker.receive(2), key=lambda d: Bookmark.parse(d.bookmark))
            enqueued_ms = journal_timestamp(settings, jobs, 1)
            deadline_ms = lease_expires_ms(hung.headers)

            # Past the expiration, within the lease: the holder's ack still counts.
            worker.idle(max(0.0, (enqueued_ms + 1300) / 1000 - time.time()))
            worker.ack([done])
            wait_for_counters(settings, "Jobs", acked=1)
            assert worker.ack_results() == [], "an ack within the lease must be applied"

            (dead,) = dead_letters.read_until(lambda rs: len(rs) >= 1, timeout=15)
            assert (dead.key, dead.value) == (b"hung", b'{"job": "hung"}')
            info = parse_dead_letter_headers(dead.headers)
            assert (info.reason, info.bookmark, info.delivery_count, info.last_consumer) == (
                "expiration", Bookmark.parse(hung.bookmark), 1, worker.consumer_id)
            assert info.dead_lettered_at_ms >= deadline_ms, "removed before its lease ended"
            assert worker.idle(1.0) == [], "an expired message is not delivered again"
            totals = counters(settings, "Jobs")
            assert (totals["acked"], totals["expired"], totals["dead_lettered"],
                    totals["delivered"]) == (1, 1, 1, 2)
            no_more(dead_letters, 1, 0.5)
            wait_until(lambda: recovery_points(settings, "Jobs").get((jobs, 0)) == 2,
                       what="both jobs to leave the queue")
    finally:
        dead_letters.close()


def test_expiration_is_counted_from_the_record_timestamp(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`expiration`: "The expiration time is calculated based on the time that the message was
    received" (docs/engine.md, decision 4: "Expiration is counted from the journal record's
    timestamp"). A record stamped a minute ago in a queue with a 30 s expiration is expired at
    once and published to the dead-letter topic, long before 30 s pass.
    """
    jobs, failed = journal("Jobs", partitions=1), journal("FailedJobs", partitions=1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs, "expiration": "30s",
                          "dead_letter_topic": failed})
    dead_letters = TopicReader(settings.bootstrap_servers, failed)
    try:
        with running_coordinator(settings, core=core):
            started = time.monotonic()
            produce_at(settings.bootstrap_servers, jobs,
                       [(b"stale", b'{"job": "stale"}', int(time.time() * 1000) - 60_000)])
            (dead,) = dead_letters.read_until(lambda rs: len(rs) >= 1, timeout=20)
            assert time.monotonic() - started < 25, "expired by the clock, not the timestamp"
            assert dead.key == b"stale"
            assert parse_dead_letter_headers(dead.headers).reason == "expiration"
    finally:
        dead_letters.close()


def test_expired_messages_leave_silently_with_dead_letter_expired_false(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`dead_letter_expired: false`. The reference: "By default, expiring a message simply
    means the message is removed from the queue" and "message expiration is considered to be
    a normal way for the message to leave the queue, and is not considered an error"
    (docs/queue-configuration.md: "`false` keeps expiry a silent exit on such a queue").
    """
    jobs, failed = journal("Jobs", partitions=1), journal("FailedJobs", partitions=1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs, "expiration": "1s",
                          "dead_letter_topic": failed, "dead_letter_expired": False})
    dead_letters = TopicReader(settings.bootstrap_servers, failed)
    try:
        with running_coordinator(settings, core=core):
            produce(settings.bootstrap_servers, jobs, [JOB])
            totals = wait_for_counters(settings, "Jobs", expired=1)
            assert totals["dead_lettered"] == 0
            wait_until(lambda: recovery_points(settings, "Jobs").get((jobs, 0)) == 1,
                       what="the expired job to leave the queue")
            no_more(dead_letters, 0, 1.0)
    finally:
        dead_letters.close()


def test_dead_letter_expired_true_uses_the_default_dead_letter_topic(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`dead_letter_expired: true` on a queue without `dead_letter_topic`
    (docs/queue-configuration.md: "`true` dead-letters expiries to the coordinator's default
    topic on a queue without one"), the reference's "any expired message from ``Jobs`` will
    result in a message automatically published".
    """
    jobs = journal("Jobs", partitions=1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs, "expiration": "1s",
                          "dead_letter_expired": True})
    dead_letters = TopicReader(settings.bootstrap_servers,
                               TopicNames(settings.topic_prefix).dead_letter("Jobs"))
    try:
        with running_coordinator(settings, core=core):
            produce(settings.bootstrap_servers, jobs, [JOB], keys=[b"job-42"])
            (dead,) = dead_letters.read_until(lambda rs: len(rs) >= 1, timeout=30)
            assert (dead.key, dead.value) == (b"job-42", JOB)
            assert parse_dead_letter_headers(dead.headers).reason == "expiration"
            totals = wait_for_counters(settings, "Jobs", dead_lettered=1)
            assert (totals["expired"], totals["dead_lettered"]) == (1, 1)
    finally:
        dead_letters.close()


# --------------------------------------------------------------------------- redelivery_backoff


def test_a_released_entry_is_offered_again_no_earlier_than_the_backoff(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`redelivery_backoff` (beyond AMPS; DESIGN §4: "`release(delay=…)` and a redelivery
    back-off"). docs/queue-configuration.md: "Delay before a RELEASEd or lease-expired entry
    is offered again: `initial × multiplier^(n−1)` after the n-th failed delivery, at most
    `maximum`." docs/engine.md: "A RELEASE with an explicit `delay` waits exactly that (0:
    available at once)."
    """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s",
                          "redelivery_backoff": {"initial": "1s", "multiplier": 20,
                                                 "maximum": "4s"}})
    events = EventReader(settings)
    try:
        with running_coordinator(settings, core=core), Consumers(settings) as pool:
            worker = pool.subscribe("Work")
            produce(settings.bootstrap_servers, work, [b"job"])
            (first,) = worker.receive(1)

            waits = []
            current = first
            for delay_ms in (None, None, 0):
                released_at = time.time()
                worker.ack([current], AckType.RELEASE, delay_ms=delay_ms)
                (current,) = worker.receive(1, timeout=20)
                waits.append(time.time() - released_at)
                assert current.bookmark == first.bookmark
            assert current.delivery_count == 4
            # The loop reads `now` at the start of the iteration that applies the release, a
            # poll timeout (20 ms) at most before the record arrives: 50 ms of slack.
            assert waits[0] >= 1.0 - 0.05, f"1st release: offered again after {waits[0]:.2f}s"
            assert waits[1] >= 4.0 - 0.05, f"2nd release: offered again after {waits[1]:.2f}s"
            assert waits[1] < 12, f"2nd release waited {waits[1]:.1f}s: `maximum` (4s) ignored"
            assert waits[2] < 3, f"RELEASE with delay 0 waited {waits[2]:.1f}s (back-off 4s)"
            worker.ack([current])

            found = events.read_until(lambda es: any(e.type is EventType.ACKED for e in es))
            released = [e for e in found if e.type is EventType.RELEASED]
            waited_ms = [(e.available_at_ms or e.timestamp_ms) - e.timestamp_ms
                         for e in released]
            assert len(waited_ms) == 3
            # initial, then initial × 20 capped at maximum, then the explicit delay (ms rounding).
            assert all(abs(w - want) <= 1 for w, want in zip(waited_ms, [1000, 4000, 0],
                                                             strict=True)), waited_ms
            totals = wait_for_counters(settings, "Work", acked=1)
            assert (totals["released"], totals["redelivered"]) == (3, 3)
    finally:
        events.close()


def test_an_expired_lease_is_offered_again_no_earlier_than_the_backoff(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`redelivery_backoff`: "Delay before a RELEASEd or lease-expired entry is offered
    again" (docs/queue-configuration.md); the reference's lease expiry ("AMPS returns the
    message to the queue") then waits the back-off.
    """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "1s",
                          "redelivery_backoff": {"initial": "2s", "multiplier": 2,
                                                 "maximum": "1m"}})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        worker = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"job"])
        (first,) = worker.receive(1)
        deadline_ms = lease_expires_ms(first.headers)
        (again,) = worker.receive(1, timeout=20)
        received_ms = time.time() * 1000
        assert (again.bookmark, again.delivery_count) == (first.bookmark, 2)
        assert received_ms >= deadline_ms + 2000 - 50, (
            f"offered again {received_ms - deadline_ms:.0f} ms after the lease ended, "
            "before the 2s back-off")
        worker.ack([again])
        totals = wait_for_counters(settings, "Work", acked=1)
        assert (totals["lease_expired"], totals["redelivered"]) == (1, 1)


def test_a_broken_lease_is_offered_again_at_once_despite_the_backoff(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`redelivery_backoff` does not apply to a broken lease. The reference: "Leases are
    broken and messages are returned to the queue if the lease holder disconnects from AMPS";
    docs/engine.md: "`_break_lease` ... at once, no back-off" and "Broken leases never wait."
    """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s",
                          "redelivery_backoff": {"initial": "30s", "multiplier": 2,
                                                 "maximum": "1m"}})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        leaver = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"job"])
        (first,) = leaver.receive(1)
        survivor = pool.subscribe("Work")
        assert survivor.idle(0.3) == []
        leaver.unsubscribe()
        # Well within the 30s back-off.
        (again,) = survivor.receive(1, timeout=15)
        assert (again.bookmark, again.delivery_count) == (first.bookmark, 2)
        survivor.ack([again])
        wait_for_counters(settings, "Work", acked=1)
