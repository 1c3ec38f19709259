"""A replace that takes a subscription off a queue keeps its leases there (AMPS, "Replacing
Queue Subscriptions": "AMPS does not break message leases or adjust the number of
currently-unacknowledged messages for the subscription, even if the messages no longer match
the current subscription ... and requires the subscriber to acknowledge them or allow the lease
to expire")."""

from __future__ import annotations

import pytest

from layer.domain.consumers import BacklogShare
from layer.domain.events import ConsumerLeft, LeaseBroken, LeaseExpired
from layer.domain.states import AckOutcome, AckType, LeaveReason

from .engine_helpers import engine, leases, of_type, offer, settle, subscribe

pytestmark = pytest.mark.usefixtures("engine_implementation")


def test_a_retired_consumer_keeps_its_leases_and_may_settle_them() -> None:
    queue = engine(lease_period="60s")
    offer(queue, range(6))
    subscribe(queue, "a", max_backlog=3)
    subscribe(queue, "b", max_backlog=3)
    held = [lease for lease in leases(queue.dispatch(0.0)) if lease.consumer_id == "a"]
    assert len(held) == 3
    queue.drain()

    assert queue.retire("a", 1.0)
    # Its holder settles them as before: an ACCEPT, a RELEASE.
    assert settle(queue, held[0], now=1.0) == AckOutcome.APPLIED
    assert settle(queue, held[1], AckType.RELEASE, now=1.0) == AckOutcome.APPLIED
    # The released entry is not a's again (a takes nothing new) and b's backlog is full.
    assert leases(queue.dispatch(1.0)) == []
    events = queue.drain().events
    assert not of_type(events, LeaseBroken) and not of_type(events, ConsumerLeft)
    assert settle(queue, held[2], now=2.0) == AckOutcome.APPLIED


def test_a_retired_consumer_leaves_once_it_holds_nothing() -> None:
    queue = engine(lease_period="60s")
    offer(queue, range(4))
    subscribe(queue, "a", max_backlog=2)
    held = leases(queue.dispatch(0.0))
    queue.retire("a", 0.0)
    subscribe(queue, "b", max_backlog=5)
    # b gets the two a does not hold, never a's.
    got = leases(queue.dispatch(0.0))
    assert sorted(d.bookmark.offset for d in got) == [2, 3]
    assert all(d.consumer_id == "b" for d in got)
    settle(queue, held[0], now=1.0)
    queue.tick(1.0)
    assert not of_type(queue.drain().events, ConsumerLeft), "it still holds one"
    settle(queue, held[1], now=2.0)
    queue.tick(2.0)
    (left,) = of_type(queue.drain().events, ConsumerLeft)
    assert left.consumer_id == "a" and left.reason is LeaveReason.REPLACED  # type: ignore[attr-defined]
    assert left.broken == 0  # type: ignore[attr-defined]
    assert [c.consumer_id for c in queue.consumers()] == ["b"]


def test_a_retired_lease_that_ends_is_offered_again() -> None:
    queue = engine(lease_period="5s")
    offer(queue, range(1))
    subscribe(queue, "a", max_backlog=1)
    (held,) = leases(queue.dispatch(0.0))
    queue.retire("a", 0.0)
    subscribe(queue, "b", max_backlog=1, now=0.0)
    assert leases(queue.dispatch(1.0)) == []
    queue.heartbeat("a", 4.0)
    queue.heartbeat("b", 4.0)
    queue.tick(6.0)  # the lease period passed
    assert of_type(queue.drain().events, LeaseExpired)
    (again,) = leases(queue.dispatch(6.0))
    assert again.consumer_id == "b" and again.bookmark == held.bookmark


def test_a_retired_consumer_gets_no_barrier() -> None:
    queue = engine(barrier_expression="/barrier = 1", lease_period="60s")
    offer(queue, [{"n": 0}, {"barrier": 1}])
    subscribe(queue, "a", max_backlog=1)
    subscribe(queue, "b", max_backlog=1)
    first = leases(queue.dispatch(0.0))
    assert len(first) == 1
    queue.retire("a", 0.0)
    settle(queue, first[0], now=1.0)
    barriers = [d for d in queue.dispatch(1.0) if hasattr(d, "recipients")]
    assert [r.consumer_id for r in barriers[0].recipients] == ["b"]  # type: ignore[attr-defined]


def test_the_leases_a_replace_left_behind_count_against_the_subscription() -> None:
    """AMPS: "the consumer may still have 10 messages outstanding" after a replace to a queue
    whose limit is 5, and "no new messages will be delivered until that number drops below
    the current maximum"."""
    old, new = engine(lease_period="60s"), engine(seed=9, lease_period="60s",
                                                  max_per_subscription_backlog=5)
    offer(old, range(10))
    offer(new, range(10))
    subscribe(old, "a", max_backlog=10)
    held = leases(old.dispatch(0.0))
    assert len(held) == 10
    share = BacklogShare()
    old.retire("a", 0.0, share)
    new.subscribe("a", "a-session", 0.0, delivery_topic="deliver.a", max_backlog=10,
                  share=share)
    assert leases(new.dispatch(0.0)) == [], "10 outstanding against a backlog of 5"
    for lease in held[:6]:
        settle(old, lease, now=1.0)
    assert len(leases(new.dispatch(1.0))) == 1, "4 outstanding: room for one"
    for lease in held[6:]:
        settle(old, lease, now=2.0)
    assert len(leases(new.dispatch(2.0))) == 4


def test_subscribing_to_the_queue_again_ends_the_draining() -> None:
    queue = engine(lease_period="60s")
    offer(queue, range(4))
    subscribe(queue, "a", max_backlog=2)
    leases(queue.dispatch(0.0))
    queue.retire("a", 0.0)
    assert leases(queue.dispatch(0.0)) == []
    queue.replace("a", 1.0, max_backlog=4)
    assert len(leases(queue.dispatch(1.0))) == 2
    queue.tick(2.0)
    assert not of_type(queue.drain().events, ConsumerLeft)


def test_retiring_an_unknown_consumer_says_so() -> None:
    assert engine().retire("nobody", 0.0) is False
