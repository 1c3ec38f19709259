"""RELEASE, REJECT and the delivery limits end to end, down to the dead-letter topic.

The reference's example (AMPS "Handling Unprocessed Messages"): a `Jobs` queue with
MaxCancels 3 and MaxDeliveries 10 whose expired messages go to `FailedJobs` for review. In
qlayer the action is the queue's `dead_letter_topic`, and `FailedJobs` is a queue over it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

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
    Delivered,
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

from .test_options_expiry_and_backoff import core

__all__ = ["core"]  # the fixture: the rejection test runs on both cores

pytestmark = pytest.mark.integration

JOB = json.dumps({"job": 42, "kind": "render"}).encode()
HEADERS = [("trace-id", b"t-123"), ("origin", b"billing")]
# docs/protocol.md §5.1: the headers on every delivery.
DELIVERY_HEADERS = ("qlayer.queue", "qlayer.bookmark", "qlayer.lease", "qlayer.lease-expires",
                    "qlayer.delivery-count", "qlayer.barrier", "qlayer.consumer",
                    "qlayer.session")


def jobs_queues(settings: Settings, jobs: str, failed: str, **overrides: object) -> None:
    """The reference's Jobs / FailedJobs configuration, with test-unique journal names."""
    put_queues(
        settings,
        {"name": "Jobs", "underlying_topic": jobs, "max_cancels": 3, "max_deliveries": 10,
         "dead_letter_topic": failed, **overrides},
        {"name": "FailedJobs", "underlying_topic": failed},
    )


def check_dead_letter(record: Delivered | TopicRecord, *, reason: str, delivery: Delivered,
                      consumer_id: str, delivery_count: int, detail: str | None = None) -> None:
    """The dead letter is the journal record (key, value, headers) plus qlayer.dlq.* headers."""
    key, value, headers = record.key, record.value, record.headers
    assert (key, value) == (delivery.key, delivery.value)
    assert [h for h in headers if not h[0].startswith("qlayer.")] == HEADERS
    info = parse_dead_letter_headers(headers)
    assert info.reason == reason
    assert info.queue == "Jobs"
    assert info.bookmark == Bookmark.parse(delivery.bookmark)
    assert info.original_topic == Bookmark.parse(delivery.bookmark).topic
    assert info.delivery_count == delivery_count
    assert info.last_consumer == consumer_id
    assert info.detail == detail
    assert abs(info.dead_lettered_at_ms - time.time() * 1000) < 60_000
    names = [k for k, _ in headers if k in DELIVERY_HEADERS]
    if isinstance(record, Delivered):
        # Delivered again by FailedJobs: its own delivery headers, once each; none of Jobs'.
        assert sorted(names) == sorted(DELIVERY_HEADERS)
        assert header_value(headers, "qlayer.queue") == b"FailedJobs"
    else:
        assert names == [], f"delivery headers leaked into the dead letter: {names}"


def test_the_third_release_dead_letters_the_job_to_failed_jobs(
    settings: Settings, journal: Callable[..., str]
) -> None:
    jobs, failed = journal("Jobs"), journal("FailedJobs")
    jobs_queues(settings, jobs, failed)
    with running_coordinator(settings), Consumers(settings) as pool:
        worker = pool.subscribe("Jobs")
        reviewer = pool.subscribe("FailedJobs")
        produce(settings.bootstrap_servers, jobs, [JOB], keys=[b"job-42"], headers=HEADERS)

        seen = []
        for attempt in (1, 2, 3):
            (delivery,) = worker.receive(1)
            assert delivery.delivery_count == attempt
            seen.append(delivery)
            worker.ack([delivery], AckType.RELEASE)  # AMPS cancel
        assert len({d.bookmark for d in seen}) == 1
        assert worker.idle(0.5) == [], "a job past MaxCancels must not be delivered again"

        (dead,) = reviewer.receive(1)
        check_dead_letter(dead, reason="max_cancels", delivery=seen[0],
                          consumer_id=worker.consumer_id, delivery_count=3)
        assert dead.bookmark.startswith(f"{failed}/"), "FailedJobs reads its own journal"
        reviewer.ack([dead])

        totals = wait_for_counters(settings, "Jobs", dead_lettered=1)
        assert totals["released"] == 3
        assert totals["dead_lettered"] == 1
        assert totals["expired"] == 1
        assert totals["acked"] == 0
        # The job left Jobs: its partition's recovery point passed it.
        (_, partition, offset) = seen[0].bookmark.rsplit("/", 2)
        wait_until(lambda: recovery_points(settings, "Jobs").get((jobs, int(partition)), -1)
                   > int(offset), what="the recovery point to pass the dead-lettered job")


def test_max_deliveries_dead_letters_after_the_last_lease_expires(
    settings: Settings, journal: Callable[..., str]
) -> None:
    jobs = journal("Jobs")
    # No dead_letter_topic: the coordinator's default, prefix + "dlq." + queue.
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs, "max_deliveries": 2,
                          "lease_period": "1s"})
    dlq = TopicReader(settings.bootstrap_servers, TopicNames(settings.topic_prefix)
                      .dead_letter("Jobs"))
    with running_coordinator(settings), Consumers(settings) as pool:
        crashing = pool.subscribe("Jobs")
        produce(settings.bootstrap_servers, jobs, [JOB], keys=[b"job-42"], headers=HEADERS)
        first, second = crashing.receive(1), crashing.receive(1, timeout=10)
        assert [first[0].delivery_count, second[0].delivery_count] == [1, 2]

        (dead,) = dlq.read_until(lambda rs: len(rs) >= 1)
        check_dead_letter(dead, reason="max_deliveries", delivery=first[0],
                          consumer_id=crashing.consumer_id, delivery_count=2)
        assert crashing.idle(1.5) == [], "MaxDeliveries reached: no third delivery"
        assert len(dlq.read_until(lambda rs: True)) == 1, "dead-lettered exactly once"
        totals = counters(settings, "Jobs")
        assert (totals["delivered"], totals["lease_expired"], totals["dead_lettered"]) == (2, 2, 1)
    dlq.close()


def test_reject_sends_the_job_with_its_reason_to_failed_jobs(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    jobs, failed = journal("Jobs"), journal("FailedJobs")
    jobs_queues(settings, jobs, failed)
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        worker = pool.subscribe("Jobs", max_backlog=2)
        reviewer = pool.subscribe("FailedJobs")
        good = json.dumps({"job": 1}).encode()
        produce(settings.bootstrap_servers, jobs, [JOB], keys=[b"job-42"], headers=HEADERS,
                partition=0)
        produce(settings.bootstrap_servers, jobs, [good], keys=[b"job-1"], partition=0)
        deliveries = worker.receive(2)
        bad = next(d for d in deliveries if d.value == JOB)
        fine = next(d for d in deliveries if d.value == good)
        worker.ack([bad], AckType.REJECT, reason="cannot render: font missing")
        worker.ack([fine])

        (dead,) = reviewer.receive(1)
        check_dead_letter(dead, reason="rejected", delivery=bad, consumer_id=worker.consumer_id,
                          delivery_count=1, detail="cannot render: font missing")
        assert json.loads(dead.value or b"") == {"job": 42, "kind": "render"}
        assert worker.idle(0.5) == [], "a rejected job is never redelivered"
        assert worker.ack_results() == []
        totals = wait_for_counters(settings, "Jobs", acked=1)
        assert (totals["acked"], totals["dead_lettered"], totals["released"]) == (1, 1, 0)
        # Counted as a rejection, not as an expiry (nothing timed out or hit a limit).
        assert (totals["rejected"], totals["expired"]) == (1, 0)
        wait_until(lambda: recovery_points(settings, "Jobs").get((jobs, 0)) == 2,
                   what="both jobs to leave the queue")


def test_release_with_a_delay_is_not_redelivered_before_the_delay(
    settings: Settings, journal: Callable[..., str]
) -> None:
    jobs = journal("Jobs")
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs})
    events = EventReader(settings)
    with running_coordinator(settings), Consumers(settings) as pool:
        worker = pool.subscribe("Jobs")
        produce(settings.bootstrap_servers, jobs, [JOB])
        (delivery,) = worker.receive(1)
        released_at = time.time()
        worker.ack([delivery], AckType.RELEASE, delay_ms=1500)

        (again,) = worker.receive(1, timeout=10)
        waited = time.time() - released_at
        assert again.bookmark == delivery.bookmark
        assert again.delivery_count == 2
        # The coordinator's clock reads `now` at the start of the iteration that applies the
        # release, a poll timeout (20 ms) at most before the record arrives.
        assert waited >= 1.5 - 0.05, f"redelivered after {waited:.3f}s, before the 1.5s delay"
        worker.ack([again])

        found = events.read_until(lambda es: any(e.type is EventType.ACKED for e in es))
        (released,) = [e for e in found if e.type is EventType.RELEASED]
        (leased_again,) = [e for e in found if e.type is EventType.LEASED
                           and e.delivery_count == 2]
        assert released.available_at_ms is not None
        assert abs(released.available_at_ms - released.timestamp_ms - 1500) <= 1  # ms rounding
        assert leased_again.timestamp_ms >= released.available_at_ms
    events.close()


def test_an_expired_job_goes_to_failed_jobs(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """The reference: "any expired message from ``Jobs`` will result in a message
    automatically published to ``FailedJobs``". A queue with a dead_letter_topic dead-letters
    what `expiration` removes (docs/queue-configuration.md, dead_letter_expired)."""
    jobs, failed = journal("Jobs"), journal("FailedJobs")
    jobs_queues(settings, jobs, failed, expiration="2s")
    with running_coordinator(settings), Consumers(settings) as pool:
        reviewer = pool.subscribe("FailedJobs")
        # Nobody takes Jobs: the job ages out of the queue.
        produce(settings.bootstrap_servers, jobs, [JOB], keys=[b"job-42"], headers=HEADERS,
                partition=0)
        (dead,) = reviewer.receive(1, timeout=30)
        assert (dead.key, dead.value) == (b"job-42", JOB)
        assert [h for h in dead.headers if not h[0].startswith("qlayer.")] == HEADERS
        info = parse_dead_letter_headers(dead.headers)
        assert (info.reason, info.queue, info.delivery_count, info.last_consumer) == (
            "expiration", "Jobs", 0, None)
        totals = wait_for_counters(settings, "Jobs", expired=1)
        assert (totals["expired"], totals["dead_lettered"]) == (1, 1)
        wait_until(lambda: recovery_points(settings, "Jobs").get((jobs, 0)) == 1,
                   what="the expired job to leave the queue")
