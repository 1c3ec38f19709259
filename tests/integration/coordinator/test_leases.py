"""Leases end to end: expiry, renewal, and what happens to deliveries when a consumer leaves.

Real coordinator loop, real Kafka and PostgreSQL; consumers built from the wire protocol only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from layer.protocol import AckStatus, AckType, EventType, header_value
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    EventReader,
    counters,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
)

pytestmark = pytest.mark.integration


def lease_expires_ms(headers: list[tuple[str, bytes | None]]) -> int:
    value = header_value(headers, "qlayer.lease-expires")
    assert value is not None
    return int(value)


def test_an_unacknowledged_entry_comes_back_after_the_lease_period(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "1s"})
    with running_coordinator(settings), Consumers(settings) as pool:
        worker = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"job-1"], keys=[b"k1"])
        (first,) = worker.receive(1)
        assert first.delivery_count == 1
        deadline_ms = lease_expires_ms(first.headers)

        (again,) = worker.receive(1, timeout=10)  # never acknowledged: it returns
        received_ms = time.time() * 1000

        assert again.bookmark == first.bookmark
        assert (again.value, again.key) == (b"job-1", b"k1")
        assert again.delivery_count == 2
        assert again.lease != first.lease, "a new lease needs a new token"
        assert received_ms >= deadline_ms, "redelivered before the lease ended"
        worker.ack([again])
        totals = wait_for_counters(settings, "Work", acked=1)
        assert totals["delivered"] == 2
        assert totals["redelivered"] == 1
        assert totals["lease_expired"] == 1
        assert totals["acked"] == 1


def test_an_expired_lease_goes_to_the_other_consumer_and_the_late_ack_is_refused(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    # Round-robin makes "the other consumer" deterministic: the first holder was served last.
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "1s",
                          "fairness": "round-robin"})
    events = EventReader(settings)
    with running_coordinator(settings), Consumers(settings) as pool:
        slow = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"job-1"])
        (first,) = slow.receive(1)
        other = pool.subscribe("Work")

        (again,) = other.receive(1, timeout=10)
        assert again.bookmark == first.bookmark
        assert again.delivery_count == 2
        assert slow.idle(0.3) == [], "the slow consumer must not get it back as well"

        slow.ack([first])  # too late: the entry is leased to the other consumer now
        (refused,) = slow.wait_for_ack_results(1)
        assert refused.status in (AckStatus.WRONG_TOKEN, AckStatus.LEASE_LOST)
        assert refused.bookmark == first.bookmark
        other.ack([again])
        assert other.idle(0.3) == []
        assert other.ack_results() == [], "the holder's ack must be applied silently"

        found = events.read_until(lambda es: any(e.type is EventType.ACKED for e in es))
        expired = [e for e in found if e.type is EventType.LEASE_EXPIRED]
        assert [(e.consumer_id, e.reason) for e in expired] == [(slow.consumer_id, "deadline")]
        (acked,) = [e for e in found if e.type is EventType.ACKED]
        assert acked.consumer_id == other.consumer_id
    events.close()


def test_renew_extends_the_lease_and_the_new_deadline_holds(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "2s"})
    with running_coordinator(settings), Consumers(settings) as pool:
        worker = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"long-job"])
        (delivery,) = worker.receive(1)
        old_deadline = lease_expires_ms(delivery.headers)

        time.sleep(1.0)  # half the lease period: the work takes time
        worker.ack([delivery], AckType.RENEW)
        (renewed,) = worker.wait_for_ack_results(1)
        assert renewed.status is AckStatus.OK
        assert renewed.type is AckType.RENEW
        assert renewed.lease_expires_ms is not None
        assert renewed.lease_expires_ms >= old_deadline + 900, "renew must push the deadline"
        new_deadline = renewed.lease_expires_ms

        # Past the old deadline nothing comes back...
        wait = (old_deadline + 500) / 1000 - time.time()
        assert worker.idle(max(wait, 0.0)) == []
        # ...and the renewed lease still ends: at the new deadline, not before.
        (again,) = worker.receive(1, timeout=10)
        assert time.time() * 1000 >= new_deadline
        assert again.bookmark == delivery.bookmark
        assert again.delivery_count == 2
        worker.ack([again])
        totals = wait_for_counters(settings, "Work", acked=1)
        assert totals["lease_expired"] == 1


@pytest.mark.parametrize("semantics", ["at-most-once", "at-least-once"])
def test_deliveries_of_a_consumer_that_went_away(
    semantics: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """At-most-once: a delivery is final, whether the consumer unsubscribes or times out.
    At-least-once (the control): the same deliveries are redelivered at once."""
    work = journal("Work")
    put_queues(settings, {"name": "Work", "underlying_topic": work, "semantics": semantics,
                          "lease_period": "60s"})
    events = EventReader(settings)
    with running_coordinator(settings), Consumers(settings) as pool:
        leaver = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"first"])
        (first,) = leaver.receive(1)
        # Published before `silent` subscribes (the leaver's one backlog slot is taken, so it
        # waits): `silent` heartbeats only while it polls, and a slow produce on a loaded
        # machine must not outlast its 1 s session before it has received anything.
        produce(settings.bootstrap_servers, work, [b"second"])
        silent = pool.subscribe("Work", session_timeout_ms=1000)
        (second,) = silent.receive(1)

        leaver.unsubscribe()  # with its delivery unacknowledged
        # `silent` stops heartbeating: its session times out after 1 s.
        events.read_until(lambda es: any(e.type is EventType.CONSUMER_TIMED_OUT for e in es))

        survivor = pool.subscribe("Work", max_backlog=5)
        late = survivor.idle(1.0)
        if semantics == "at-most-once":
            assert late == [], "at-most-once deliveries must never be redelivered"
            produce(settings.bootstrap_servers, work, [b"third"])
            (third,) = survivor.receive(1)  # the survivor is served: nothing was just stuck
            assert third.value == b"third"
            totals = counters(settings, "Work")
            assert totals["redelivered"] == 0
            assert totals["delivered"] == 3
            outcomes = [e for e in events.events
                        if e.type is EventType.DELIVERED_AT_MOST_ONCE]
            assert {str(e.bookmark) for e in outcomes} >= {first.bookmark, second.bookmark}
        else:
            late += survivor.receive(2 - len(late)) if len(late) < 2 else []
            assert sorted(d.value for d in late) == [b"first", b"second"]
            assert all(d.delivery_count == 2 for d in late)
            survivor.ack(late)
            ended = {(str(e.bookmark), e.consumer_id, e.reason) for e in events.events
                     if e.type is EventType.LEASE_EXPIRED}
            # Reasons as docs/protocol.md §11 spells them (LeaseEndReason).
            assert ended == {(first.bookmark, leaver.consumer_id, "unsubscribed"),
                             (second.bookmark, silent.consumer_id, "session_timed_out")}
    events.close()
