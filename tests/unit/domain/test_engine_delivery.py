"""Queue engine: ordering, acknowledgement types, leases, limits and timers (DESIGN §4)."""

from __future__ import annotations

import pytest

from layer.domain.engine import EntryAck
from layer.domain.entries import DELETE
from layer.domain.events import (
    BacklogFreed,
    EntriesEnqueued,
    EntryAcked,
    EntryDelayed,
    EntryExpired,
    EntryLeased,
    EntryReleased,
    LeaseExpired,
    LeaseRenewed,
)
from layer.domain.states import AckOutcome, AckSource, AckType, EntryState, ExpiryReason

from .engine_helpers import (
    bm,
    by_consumer,
    engine,
    leases,
    of_type,
    offer,
    offsets_of,
    record,
    settle,
    subscribe,
)

pytestmark = pytest.mark.usefixtures("engine_implementation")


def test_entries_are_delivered_oldest_first() -> None:
    queue = engine()
    offer(queue, [{"n": i} for i in range(5)])
    subscribe(queue, "a", max_backlog=3)

    assert offsets_of(queue.dispatch(0.0)) == [0, 1, 2]


def test_records_of_several_partitions_are_ordered_by_arrival_at_the_queue() -> None:
    queue = engine()
    queue.enqueue([record(10, partition=1), record(0, partition=0), record(11, partition=1)], 0.0)
    subscribe(queue, "a", max_backlog=3)

    delivered = [
        (lease.bookmark.partition, lease.bookmark.offset) for lease in leases(queue.dispatch(0.0))
    ]
    assert delivered == [(1, 10), (0, 0), (1, 11)]


def test_a_replayed_or_duplicate_record_is_not_enqueued_twice() -> None:
    queue = engine()
    assert offer(queue, ["a", "b"]) == 2
    assert queue.enqueue([record(1, "b"), record(0, "a"), record(2, "c")], 0.0) == 1

    assert queue.stats().available == 3


def test_the_queue_filter_decides_which_records_become_entries() -> None:
    queue = engine(filter="/region = 'EU'")
    offer(queue, [{"region": "EU"}, {"region": "US"}, None, {"region": "EU"}])

    assert [entry.bookmark.offset for entry in queue.view()] == [0, 3]
    # Refused records are done for the queue: the recovery point passes them.
    subscribe(queue, "a", max_backlog=5)
    for lease in leases(queue.dispatch(0.0)):
        settle(queue, lease)
    assert queue.recovery_points() == {("Work", 0): 4}


def test_a_delete_is_not_a_publish_and_never_becomes_an_entry() -> None:
    """AMPS: "Only publish messages are added to the queue." A Kafka tombstone is a delete;
    and "Deleting a message from an underlying topic ... does not remove the corresponding
    messages from the queue"."""
    queue = engine()
    offer(queue, [{"n": 0}, DELETE, {"n": 2}, DELETE])

    assert [entry.bookmark.offset for entry in queue.view()] == [0, 2]
    subscribe(queue, "a", max_backlog=5)
    got = leases(queue.dispatch(0.0))
    assert [lease.bookmark.offset for lease in got] == [0, 2]
    for lease in got:
        settle(queue, lease)
    # The deletes are passed over: the recovery point goes past them.
    assert queue.recovery_points() == {("Work", 0): 4}


def test_accept_acknowledges_the_entry_and_frees_the_backlog() -> None:
    queue = engine()
    offer(queue, ["x", "y"])
    subscribe(queue, "a")  # max_backlog defaults to 1
    [first] = leases(queue.dispatch(0.0))
    assert queue.dispatch(0.0) == []  # the backlog of one is full

    assert settle(queue, first) is AckOutcome.APPLIED
    assert queue.entry(bm(0)).state is EntryState.ACKED
    assert offsets_of(queue.dispatch(0.0)) == [1]
    acked = of_type(queue.drain().events, EntryAcked)
    assert [(e.bookmark.offset, e.consumer_id, e.source, e.delivery_count) for e in acked] == [
        (0, "a", AckSource.CONSUMER, 1)
    ]


def test_an_ack_says_after_how_many_deliveries_it_came() -> None:
    queue = engine()
    offer(queue, ["x"])
    subscribe(queue, "a")
    [first] = leases(queue.dispatch(0.0))
    assert settle(queue, first, AckType.RELEASE) is AckOutcome.APPLIED
    [again] = leases(queue.dispatch(1.0))
    assert settle(queue, again) is AckOutcome.APPLIED
    [acked] = of_type(queue.drain().events, EntryAcked)
    assert (acked.source, acked.delivery_count) == (AckSource.CONSUMER, 2)


def test_an_expired_lease_returns_the_entry_to_the_queue() -> None:
    queue = engine(lease_period="10s")
    offer(queue, ["job"])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))
    assert lease.deadline == 10.0
    subscribe(queue, "b", now=5.0, max_backlog=2)

    queue.tick(9.9)
    assert queue.dispatch(9.9) == []
    queue.heartbeat("a", 10.0)
    queue.heartbeat("b", 10.0)
    queue.tick(10.0)
    again = leases(queue.dispatch(10.0))

    # Proportional fairness: a (0 of 1) and b (0 of 2) are both at 0% of their backlog, so
    # the first one found, a, gets it again, with a new token.
    assert [(d.bookmark.offset, d.consumer_id, d.delivery_count) for d in again] == [(0, "a", 2)]
    expired = of_type(queue.drain().events, LeaseExpired)
    assert [(e.consumer_id, e.available_at) for e in expired] == [("a", 10.0)]
    # The old holder's token no longer acknowledges anything.
    assert settle(queue, lease, now=11.0) is AckOutcome.WRONG_TOKEN


def test_a_returned_entry_keeps_its_place_in_the_queue() -> None:
    queue = engine()
    offer(queue, ["0", "1", "2", "3"])
    subscribe(queue, "a", max_backlog=3)
    zero, one, _two = leases(queue.dispatch(0.0))
    settle(queue, one)
    settle(queue, zero, AckType.RELEASE)
    queue.unsubscribe("a", 0.0)
    subscribe(queue, "b", max_backlog=3)

    assert offsets_of(queue.dispatch(0.0)) == [0, 2, 3]


def test_jobs_max_deliveries_expires_after_the_tenth_unsuccessful_delivery() -> None:
    # Reference "Handling Unprocessed Messages": Jobs with MaxCancels 3, MaxDeliveries 10.
    queue = engine(max_cancels=3, max_deliveries=10, lease_period="1s")
    offer(queue, [{"job": 1}])
    subscribe(queue, "worker")
    deliveries = 0
    now = 0.0
    while True:
        got = leases(queue.dispatch(now))
        if not got:
            break
        deliveries += 1
        now += 1.0
        queue.heartbeat("worker", now)
        queue.tick(now)  # the lease runs out: an unsuccessful delivery

    assert deliveries == 10
    [expired] = of_type(queue.drain().events, EntryExpired)
    assert expired.reason is ExpiryReason.MAX_DELIVERIES
    assert expired.dead_letter and expired.delivery_count == 10
    assert queue.entry(bm(0)).state is EntryState.EXPIRED


def test_jobs_max_cancels_expires_on_the_third_cancel() -> None:
    queue = engine(max_cancels=3, max_deliveries=10)
    offer(queue, [{"job": 1}])
    subscribe(queue, "worker")
    results = []
    for _ in range(3):
        [lease] = leases(queue.dispatch(0.0))
        results.append(settle(queue, lease, AckType.RELEASE))

    assert results == [AckOutcome.APPLIED] * 3
    assert queue.dispatch(0.0) == []
    events = queue.drain().events
    assert [e.cancel_count for e in of_type(events, EntryReleased)] == [1, 2, 3]
    [expired] = of_type(events, EntryExpired)
    assert (expired.reason, expired.cancel_count, expired.dead_letter) == (
        ExpiryReason.MAX_CANCELS,
        3,
        True,
    )


def test_reject_expires_the_entry_for_the_dead_letter_topic() -> None:
    queue = engine()
    offer(queue, [{"bad": True}, {"good": True}])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))

    assert settle(queue, lease, AckType.REJECT, reason="unparseable") is AckOutcome.APPLIED
    [expired] = of_type(queue.drain().events, EntryExpired)
    assert (expired.reason, expired.detail, expired.dead_letter, expired.consumer_id) == (
        ExpiryReason.REJECTED,
        "unparseable",
        True,
        "a",
    )
    assert offsets_of(queue.dispatch(0.0)) == [1]  # never redelivered, the next one comes


def test_renew_extends_the_lease() -> None:
    queue = engine(lease_period="10s")
    offer(queue, ["slow"])
    subscribe(queue, "a", session=None)
    [lease] = leases(queue.dispatch(0.0))

    assert settle(queue, lease, AckType.RENEW, now=8.0) is AckOutcome.APPLIED
    queue.heartbeat("a", 12.0)
    queue.tick(12.0)
    assert queue.entry(bm(0)).state is EntryState.LEASED
    assert queue.entry(bm(0)).deadline == 18.0
    renewed = of_type(queue.drain().events, LeaseRenewed)
    assert [(e.deadline, e.at) for e in renewed] == [(18.0, 8.0)]
    assert settle(queue, lease, now=13.0) is AckOutcome.APPLIED


def test_acks_that_cannot_apply_change_nothing_and_say_why() -> None:
    queue = engine()
    offer(queue, ["0", "1"])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))

    results = queue.ack(
        [
            EntryAck(lease.bookmark, "not-the-token"),
            EntryAck(bm(1), None),  # AVAILABLE, not leased
            EntryAck(bm(99), "x"),  # beyond what was read
            EntryAck(lease.bookmark._replace(topic="Other"), lease.token),
            EntryAck(lease.bookmark, lease.token, AckType.RENEW),
            EntryAck(lease.bookmark, lease.token),
            EntryAck(lease.bookmark, lease.token),  # duplicate
        ],
        1.0,
    )

    assert results == [
        AckOutcome.WRONG_TOKEN,
        AckOutcome.NOT_LEASED,
        AckOutcome.UNKNOWN_BOOKMARK,
        AckOutcome.UNKNOWN_BOOKMARK,
        AckOutcome.APPLIED,
        AckOutcome.APPLIED,
        AckOutcome.ALREADY_DONE,
    ]
    assert queue.entry(bm(1)).state is EntryState.AVAILABLE


def test_strict_leasing_only_the_holder_may_release_reject_or_renew() -> None:
    queue = engine()
    offer(queue, ["0"])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))
    for kind in AckType:
        assert settle(queue, lease, kind, token="stolen") is AckOutcome.WRONG_TOKEN
    assert queue.entry(bm(0)).state is EntryState.LEASED


def test_permissive_leasing_lets_anyone_accept_or_reject_but_not_release() -> None:
    queue = engine(leasing="permissive")
    offer(queue, ["0", "1", "2"])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))

    assert settle(queue, lease, AckType.RELEASE, token="other") is AckOutcome.WRONG_TOKEN
    assert settle(queue, lease, AckType.RENEW, token="other") is AckOutcome.WRONG_TOKEN
    assert settle(queue, lease, token="other") is AckOutcome.APPLIED
    # Entries nobody leased can be acknowledged or rejected too.
    assert queue.ack([EntryAck(bm(1), None)], 0.0) == [AckOutcome.APPLIED]
    assert queue.ack([EntryAck(bm(2), None, AckType.REJECT)], 0.0) == [AckOutcome.APPLIED]
    assert queue.ack([EntryAck(bm(2), None, AckType.RELEASE)], 0.0) == [AckOutcome.ALREADY_DONE]
    assert [queue.entry(bm(i)).state for i in range(3)] == [
        EntryState.ACKED,
        EntryState.ACKED,
        EntryState.EXPIRED,
    ]


def test_at_most_once_removes_the_entry_on_delivery_and_never_redelivers() -> None:
    queue = engine(semantics="at-most-once", lease_period="5s")
    offer(queue, ["0", "1", "2"])
    subscribe(queue, "a", max_backlog=2)
    first, _second = leases(queue.dispatch(0.0))

    assert queue.entry(first.bookmark).state is EntryState.ACKED
    acked = of_type(queue.drain().events, EntryAcked)
    assert [(e.bookmark.offset, e.source, e.delivery_count) for e in acked] == [
        (0, AckSource.DELIVERY, 1),
        (1, AckSource.DELIVERY, 1),
    ]
    assert queue.recovery_points() == {("Work", 0): 2}
    # The backlog stays taken until the consumer acknowledges; ack types have no effect.
    assert queue.dispatch(0.0) == []
    assert settle(queue, first, AckType.RELEASE) is AckOutcome.APPLIED
    assert offsets_of(queue.dispatch(0.0)) == [2]
    # A lapsed lease only frees the backlog slot; leaving breaks nothing.
    queue.heartbeat("a", 5.0)
    queue.tick(5.0)
    freed = [e.bookmark.offset for e in of_type(queue.drain().events, BacklogFreed)]
    assert freed == [0, 1, 2]  # 0 by the consumer's ack, 1 and 2 by the lease period
    queue.unsubscribe("a", 6.0)
    subscribe(queue, "b", max_backlog=5, now=6.0)
    assert queue.dispatch(6.0) == []


def test_expiration_removes_unleased_entries_as_a_normal_exit() -> None:
    queue = engine(expiration="60s", lease_period="30s")
    queue.enqueue([record(0, timestamp=0.0), record(1, timestamp=50.0)], 0.0)

    queue.tick(59.0)
    assert queue.stats().available == 2
    queue.tick(60.0)

    [expired] = of_type(queue.drain().events, EntryExpired)
    assert (expired.bookmark.offset, expired.reason, expired.dead_letter) == (
        0,
        ExpiryReason.EXPIRATION,
        False,
    )
    assert [entry.bookmark.offset for entry in queue.view()] == [1]


@pytest.mark.parametrize(("fields", "dead_letter"), [
    ({}, False),  # no action configured: a normal exit (AMPS)
    ({"dead_letter_topic": "FailedJobs"}, True),  # the action publishes it there
    ({"dead_letter_topic": "FailedJobs", "dead_letter_expired": False}, False),
    ({"dead_letter_expired": True}, True),  # to the coordinator's default topic
])
def test_expiration_dead_letters_when_the_queue_has_a_dead_letter_topic(
        fields: dict[str, object], dead_letter: bool) -> None:
    """AMPS: "any expired message from Jobs will result in a message automatically published
    to FailedJobs" once that action is configured; without one, expiration is a normal exit."""
    queue = engine(expiration="60s", **fields)
    queue.enqueue([record(0, timestamp=0.0)], 0.0)
    queue.tick(60.0)
    [expired] = of_type(queue.drain().events, EntryExpired)
    assert (expired.reason, expired.dead_letter) == (ExpiryReason.EXPIRATION, dead_letter)


def test_a_leased_entry_past_its_expiration_leaves_when_its_lease_ends() -> None:
    queue = engine(expiration="60s", lease_period="30s")
    queue.enqueue([record(0, timestamp=0.0)], 0.0)
    subscribe(queue, "a", now=40.0)
    [lease] = leases(queue.dispatch(40.0))

    queue.heartbeat("a", 65.0)
    queue.tick(65.0)
    assert queue.entry(lease.bookmark).state is EntryState.LEASED  # not while leased
    queue.heartbeat("a", 70.0)
    queue.tick(70.0)

    assert queue.entry(lease.bookmark).state is EntryState.EXPIRED
    assert [e.reason for e in of_type(queue.drain().events, EntryExpired)] == [
        ExpiryReason.EXPIRATION
    ]


def test_release_with_a_delay_makes_the_entry_wait() -> None:
    queue = engine()
    offer(queue, ["0", "1"])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))
    settle(queue, lease, AckType.RELEASE, now=1.0, delay=30.0)

    assert queue.entry(bm(0)).state is EntryState.DELAYED
    assert queue.entry(bm(0)).available_at == 31.0
    [next_one] = leases(queue.dispatch(1.0))
    assert next_one.bookmark.offset == 1
    settle(queue, next_one, now=2.0)
    queue.tick(30.9)
    assert queue.dispatch(30.9) == []
    queue.heartbeat("a", 31.0)
    queue.tick(31.0)
    assert offsets_of(queue.dispatch(31.0)) == [0]


def test_redelivery_back_off_grows_with_each_failed_delivery() -> None:
    queue = engine(
        lease_period="10s", redelivery_backoff={"initial": "2s", "multiplier": 3, "maximum": "1m"}
    )
    offer(queue, ["flaky"])
    subscribe(queue, "a", now=0.0)
    [lease] = leases(queue.dispatch(0.0))
    settle(queue, lease, AckType.RELEASE, now=1.0)  # 1st failure: 2 s
    assert queue.entry(bm(0)).available_at == 3.0
    queue.tick(3.0)
    [lease] = leases(queue.dispatch(3.0))
    queue.heartbeat("a", 13.0)
    queue.tick(13.0)  # 2nd failure, the lease ran out: 2 * 3 = 6 s

    assert queue.entry(bm(0)).available_at == 19.0
    expired = of_type(queue.drain().events, LeaseExpired)
    assert [e.available_at for e in expired] == [19.0]
    # An explicit delay of zero overrides the back-off.
    queue.tick(19.0)
    [lease] = leases(queue.dispatch(19.0))
    settle(queue, lease, AckType.RELEASE, now=20.0, delay=0.0)
    assert queue.entry(bm(0)).state is EntryState.AVAILABLE


def test_deliver_at_delays_the_first_delivery() -> None:
    queue = engine()
    queue.enqueue([record(0, "later", deliver_at=100.0), record(1, "now")], 0.0)
    subscribe(queue, "a", max_backlog=5)

    assert offsets_of(queue.dispatch(0.0)) == [1]
    assert [e.until for e in of_type(queue.drain().events, EntryDelayed)] == [100.0]
    queue.heartbeat("a", 100.0)
    queue.tick(100.0)
    assert offsets_of(queue.dispatch(100.0)) == [0]


def test_every_entry_is_announced_once() -> None:
    queue = engine()
    queue.enqueue([record(0), record(5, partition=1), record(1)], 3.0)
    [zero, one] = of_type(queue.drain().events, EntriesEnqueued)
    assert (zero.partition, zero.offsets, one.partition, one.offsets, zero.at) == (
        0,
        (0, 1),
        1,
        (5,),
        3.0,
    )


def test_view_is_read_only_and_shows_available_entries_only() -> None:
    queue = engine()
    offer(queue, [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}])
    subscribe(queue, "a")
    queue.dispatch(0.0)

    assert [v.doc for v in queue.view()] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert [v.doc for v in queue.view("/n >= 2", limit=1)] == [{"n": 2}]
    assert queue.stats().leased == 1 and queue.stats().available == 3
    assert of_type(queue.drain().events, EntryLeased)[0].bookmark.offset == 0


def test_admin_ack_by_filter_acknowledges_leased_and_available_entries() -> None:
    queue = engine()
    offer(queue, [{"to": "x"}, {"to": "y"}, {"to": "x"}, {"to": "z"}])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))  # offset 0, {"to": "x"}

    assert queue.ack_matching("/to = 'x'", 1.0) == 2
    assert [queue.entry(bm(i)).state for i in range(4)] == [
        EntryState.ACKED,
        EntryState.AVAILABLE,
        EntryState.ACKED,
        EntryState.AVAILABLE,
    ]
    assert settle(queue, lease, now=2.0) is AckOutcome.ALREADY_DONE
    assert offsets_of(queue.dispatch(2.0)) == [1]  # the backlog was freed
    sources = {e.source for e in of_type(queue.drain().events, EntryAcked)}
    assert sources == {AckSource.ADMIN}


def test_expire_before_retention_settles_entries_whose_records_are_gone() -> None:
    queue = engine()
    offer(queue, ["0", "1", "2"])
    subscribe(queue, "a")
    queue.dispatch(0.0)

    assert queue.expire_before("Work", 0, 2, 1.0) == 2
    reasons = [(e.bookmark.offset, e.reason) for e in of_type(queue.drain().events, EntryExpired)]
    assert reasons == [(0, ExpiryReason.RETENTION), (1, ExpiryReason.RETENTION)]
    assert queue.consumers()[0].backlog == 0
    assert queue.recovery_points() == {("Work", 0): 2}


def test_a_deleted_journal_expires_every_live_entry_with_its_reason() -> None:
    queue = engine()
    offer(queue, ["0", "1", "2"])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))
    assert settle(queue, lease, now=0.5) is AckOutcome.APPLIED

    assert queue.expire_before("Work", 0, 1 << 62, 1.0, ExpiryReason.JOURNAL_DELETED) == 2
    expired = of_type(queue.drain().events, EntryExpired)
    assert [(e.bookmark.offset, e.reason, e.dead_letter) for e in expired] == [
        (1, ExpiryReason.JOURNAL_DELETED, False), (2, ExpiryReason.JOURNAL_DELETED, False)]
    assert (queue.stats().available, queue.stats().leased) == (0, 0)


def test_an_entry_too_large_to_deliver_is_dead_lettered_in_any_live_state() -> None:
    queue = engine()
    offer(queue, ["0", "1", "2"])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))  # offset 0 leased; 1 and 2 available

    detail = "key, value and headers are 2000000 bytes"
    assert queue.expire_entries([bm(0), bm(2), bm(7)], ExpiryReason.TOO_LARGE, 1.0,
                                detail) == 2
    expired = of_type(queue.drain().events, EntryExpired)
    assert [(e.bookmark.offset, e.reason, e.dead_letter, e.detail) for e in expired] == [
        (0, ExpiryReason.TOO_LARGE, True, detail), (2, ExpiryReason.TOO_LARGE, True, detail)]
    assert queue.consumers()[0].backlog == 0  # the lease ended with the entry
    assert settle(queue, lease, now=2.0) is AckOutcome.ALREADY_DONE
    assert offsets_of(queue.dispatch(2.0)) == [1]
    # Done entries are passed over.
    assert queue.expire_entries([bm(0)], ExpiryReason.TOO_LARGE, 3.0) == 0


@pytest.mark.parametrize("kind", [AckType.RELEASE, AckType.ACCEPT])
def test_acks_of_a_consumer_that_left_are_refused(kind: AckType) -> None:
    queue = engine()
    offer(queue, ["0"])
    subscribe(queue, "a")
    [lease] = leases(queue.dispatch(0.0))
    queue.unsubscribe("a", 1.0)
    subscribe(queue, "b", now=1.0)
    assert by_consumer(queue.dispatch(1.0)) == {"b": [0]}

    assert settle(queue, lease, kind, now=2.0) is AckOutcome.WRONG_TOKEN
