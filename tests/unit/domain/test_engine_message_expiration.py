"""A message's own expiration (the `qlayer.expiration` header; AMPS: "The expiration time is
calculated based on the time that the message was received ..., the expiration time set on the
individual message (if any), and the ExpirationModel for the queue").

It counts from the record's timestamp, like the queue's `expiration`, and overrides it for that
entry; it follows the queue's rules otherwise: an entry that is leased leaves when its lease
ends, not before; it is dead-lettered when the queue dead-letters expiries.
"""

from __future__ import annotations

import pytest

from layer.domain.events import EntryExpired
from layer.domain.states import AckOutcome, AckType, EntryState, ExpiryReason

from .engine_helpers import (
    bm,
    engine,
    leases,
    of_type,
    record,
    serve_rereads,
    settle,
    subscribe,
)

pytestmark = pytest.mark.usefixtures("engine_implementation")


def offsets(deliveries: list[object]) -> list[int]:
    return [d.bookmark.offset for d in leases(deliveries)]


def test_an_unleased_message_leaves_when_its_own_expiration_is_due() -> None:
    queue = engine()
    queue.enqueue([record(0, "short", timestamp=100.0, expiration=5.0),
                   record(1, "plain", timestamp=100.0)], 100.0)
    assert queue.next_deadline() == 105.0
    queue.tick(104.9)
    assert queue.entry(bm(0)).state is EntryState.AVAILABLE
    queue.tick(105.0)
    assert queue.entry(bm(0)).state is EntryState.EXPIRED
    [expired] = of_type(queue.drain().events, EntryExpired)
    assert (expired.bookmark, expired.reason, expired.dead_letter) == (
        bm(0), ExpiryReason.EXPIRATION, False)
    subscribe(queue, "c", max_backlog=5, now=105.0)
    assert offsets(queue.dispatch(105.0)) == [1]


def test_it_counts_from_the_record_timestamp_so_a_replay_expires_it_at_once() -> None:
    queue = engine()
    queue.enqueue([record(0, "old", timestamp=10.0, expiration=5.0)], 100.0)
    queue.tick(100.0)
    assert queue.entry(bm(0)).state is EntryState.EXPIRED


def test_it_overrides_the_queue_expiration_both_ways() -> None:
    """Shorter than the queue's: it leaves first. Longer: the queue's does not take it."""
    queue = engine(expiration="10s")
    queue.enqueue([record(0, "longer", timestamp=0.0, expiration=60.0),
                   record(1, "queue's", timestamp=0.0),
                   record(2, "shorter", timestamp=0.0, expiration=2.0)], 0.0)
    queue.tick(2.0)
    assert [queue.entry(bm(i)).state for i in range(3)] == [
        EntryState.AVAILABLE, EntryState.AVAILABLE, EntryState.EXPIRED]
    queue.tick(10.0)
    assert [queue.entry(bm(i)).state for i in range(2)] == [
        EntryState.AVAILABLE, EntryState.EXPIRED]
    queue.tick(59.0)
    assert queue.entry(bm(0)).state is EntryState.AVAILABLE
    queue.tick(60.0)
    assert queue.entry(bm(0)).state is EntryState.EXPIRED


def test_a_leased_message_is_not_taken_from_its_holder_and_leaves_when_the_lease_ends() -> None:
    """AMPS: "If the message has been in the queue longer than the Expiration time, and there
    is no current lease on the message, AMPS removes the message from the queue" — and at
    lease end: "removes the message from the queue when the lease expires"."""
    queue = engine(lease_period="30s")
    queue.enqueue([record(0, "x", timestamp=0.0, expiration=5.0)], 0.0)
    subscribe(queue, "c")
    [lease] = leases(queue.dispatch(0.0))
    queue.tick(10.0)
    assert queue.entry(bm(0)).state is EntryState.LEASED
    queue.heartbeat("c", 29.0)
    queue.tick(30.0)  # the lease runs out, the message is older than its expiration
    assert queue.entry(bm(0)).state is EntryState.EXPIRED
    assert queue.dispatch(30.0) == []
    assert lease.bookmark == bm(0)


def test_a_leased_message_acked_in_time_is_acked() -> None:
    queue = engine(lease_period="30s")
    queue.enqueue([record(0, "x", timestamp=0.0, expiration=5.0)], 0.0)
    subscribe(queue, "c")
    [lease] = leases(queue.dispatch(0.0))
    queue.tick(6.0)
    assert settle(queue, lease, AckType.ACCEPT, now=7.0) is AckOutcome.APPLIED
    queue.tick(40.0)
    assert queue.entry(bm(0)).state is EntryState.ACKED
    assert of_type(queue.drain().events, EntryExpired) == []


def test_a_released_message_past_its_expiration_leaves() -> None:
    queue = engine(lease_period="30s")
    queue.enqueue([record(0, "x", timestamp=0.0, expiration=5.0)], 0.0)
    subscribe(queue, "c")
    [lease] = leases(queue.dispatch(0.0))
    assert settle(queue, lease, AckType.RELEASE, now=6.0) is AckOutcome.APPLIED
    assert queue.entry(bm(0)).state is EntryState.EXPIRED
    assert queue.dispatch(6.0) == []


def test_dead_lettered_when_the_queue_has_a_dead_letter_topic() -> None:
    queue = engine(dead_letter_topic="FailedWork")
    queue.enqueue([record(0, "x", timestamp=0.0, expiration=1.0)], 0.0)
    queue.tick(1.0)
    [expired] = of_type(queue.drain().events, EntryExpired)
    assert expired.dead_letter and expired.reason is ExpiryReason.EXPIRATION


def test_delayed_and_inactive_messages_expire_too() -> None:
    queue = engine(target_queue_depth=1)
    journal = [record(0, "active", timestamp=0.0),
               record(1, "inactive", timestamp=0.0, expiration=3.0),
               record(2, "delayed", timestamp=0.0, expiration=3.0, deliver_at=50.0),
               record(3, "young", timestamp=0.0)]
    queue.enqueue(journal, 0.0)
    # 1..3 are deferred past the depth: not in memory, so nothing times them.
    assert queue.entry(bm(1)) is None and queue.stats().not_read == 3
    subscribe(queue, "c", max_backlog=5, now=3.0)
    [first] = leases(queue.dispatch(3.0))
    assert first.bookmark.offset == 0
    settle(queue, first, now=3.0)
    # Read again past their own expiration, 1 and 2 expire at once; 3 takes the place.
    serve_rereads(queue, journal, now=3.0)
    assert queue.entry(bm(1)).state is EntryState.EXPIRED
    assert queue.entry(bm(2)).state is EntryState.EXPIRED
    assert offsets(queue.dispatch(3.0)) == [3]
    expired = of_type(queue.drain().events, EntryExpired)
    assert sorted(e.bookmark.offset for e in expired) == [1, 2]
