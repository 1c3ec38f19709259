"""Queue engine: priority, key groups, barrier messages and target_queue_depth."""

from __future__ import annotations

import json

import pytest

from layer.domain.engine import EntryAck
from layer.domain.entries import priority_rank
from layer.domain.events import BarrierDelivered, EntryAcked, EntryLeased, Recipient
from layer.domain.expressions import RawDocument
from layer.domain.states import AckOutcome, AckSource, AckType, EntryState

from .engine_helpers import (
    bm,
    by_consumer,
    engine,
    leases,
    of_type,
    offer,
    offsets_of,
    record,
    serve_rereads,
    settle,
    subscribe,
)

pytestmark = pytest.mark.usefixtures("engine_implementation")

# --------------------------------------------------------------------------- priority


def test_order_priority_price_times_quantity_highest_first() -> None:
    # The reference's OrderPriority queue: <Priority>/price * /qty</Priority>.
    queue = engine(priority="/price * /qty")
    offer(
        queue,
        [
            {"id": "a", "price": 10, "qty": 1},  # 10
            {"id": "b", "price": 5, "qty": 100},  # 500
            {"id": "c", "price": 1, "qty": 10},  # 10, younger than a
            {"id": "d", "price": 99},  # no qty: NULL, lowest
            {"id": "e", "price": 50, "qty": 2},  # 100
        ],
    )
    assert [entry.doc["id"] for entry in queue.view()] == ["b", "e", "a", "c", "d"]
    subscribe(queue, "a", max_backlog=5)

    assert offsets_of(queue.dispatch(0.0)) == [1, 4, 0, 2, 3]


def test_documents_given_as_record_bytes_order_and_show_the_same() -> None:
    # The coordinator offers the record's bytes (RawDocument), parsed on first read: the
    # priority, a consumer's filter and the view see the parsed JSON.
    queue = engine(priority="/price * /qty")
    orders = [{"id": "a", "price": 10, "qty": 1}, {"id": "b", "price": 5, "qty": 100},
              {"id": "c", "region": "EU", "price": 1, "qty": 30}]
    offer(queue, [RawDocument(json.dumps(o).encode()) for o in orders])
    assert [entry.doc["id"] for entry in queue.view()] == ["b", "c", "a"]
    subscribe(queue, "eu", max_backlog=5, filter="/region = 'EU'")
    assert offsets_of(queue.dispatch(0.0)) == [2]


def test_non_numeric_and_invalid_priorities_rank_lowest() -> None:
    assert priority_rank(2**64 - 1) < priority_rank(5) < priority_rank(0)
    assert priority_rank(2.9) == priority_rank(2)  # interpreted as an unsigned long
    lowest = priority_rank(None)
    assert {
        priority_rank("high"),
        priority_rank(-1),
        priority_rank(2**64),
        priority_rank(True),
    } == {lowest}
    assert priority_rank(float("nan")) == lowest and priority_rank(0) < lowest


def test_a_returned_high_priority_entry_goes_back_ahead_of_lower_ones() -> None:
    queue = engine(priority="/p")
    offer(queue, [{"p": 1}, {"p": 9}, {"p": 5}])
    subscribe(queue, "a")
    [top] = leases(queue.dispatch(0.0))
    assert top.bookmark.offset == 1
    offer(queue, [{"p": 7}], start=3)  # arrives while 1 is leased

    settle(queue, top, AckType.RELEASE)
    assert [entry.doc for entry in queue.view()] == [{"p": 9}, {"p": 7}, {"p": 5}, {"p": 1}]
    assert offsets_of(queue.dispatch(0.0)) == [1]


def test_a_new_high_priority_entry_overtakes_entries_a_consumer_looked_past() -> None:
    queue = engine(priority="/p")
    offer(queue, [{"p": 1, "to": "x"}])
    subscribe(queue, "y", filter="/to = 'y'")
    assert queue.dispatch(0.0) == []  # y looked at the whole queue
    offer(queue, [{"p": 0, "to": "y"}, {"p": 5, "to": "y"}], start=1)

    assert offsets_of(queue.dispatch(0.0)) == [2]


# --------------------------------------------------------------------------- key groups


def test_key_groups_allow_one_entry_in_flight_per_key() -> None:
    queue = engine(key_groups=True)
    queue.enqueue(
        [
            record(0, key=b"alice"),
            record(1, key=b"alice"),
            record(2, key=b"bob"),
            record(3, key=None),
            record(4, key=b"bob"),
            record(5, key=b"alice"),
        ],
        0.0,
    )
    subscribe(queue, "w1", max_backlog=10)

    first = leases(queue.dispatch(0.0))
    assert [d.bookmark.offset for d in first] == [0, 2, 3]  # one per key; no key: no group
    settle(queue, first[0])  # alice's first entry is done
    assert offsets_of(queue.dispatch(0.0)) == [1]
    settle(queue, first[1], AckType.RELEASE)  # bob's is back in the queue, still first
    assert offsets_of(queue.dispatch(0.0)) == [2]


def test_key_groups_keep_per_key_order_across_consumers_and_filters() -> None:
    queue = engine(key_groups=True, fairness="fast")
    queue.enqueue(
        [record(0, {"n": 0}, key=b"k"), record(1, {"n": 1}, key=b"k"), record(2, {"n": 2})], 0.0
    )
    subscribe(queue, "odd", max_backlog=5, filter="/n = 1")
    subscribe(queue, "any", max_backlog=5, filter="/n <> 1")

    # 1 (key k) must wait for 0 (key k), even though only "odd" wants 1.
    assert by_consumer(queue.dispatch(0.0)) == {"any": [0, 2]}
    settle(queue, leases(queue.drain().events)[0])
    assert by_consumer(queue.dispatch(0.0)) == {"odd": [1]}


def test_at_most_once_key_groups_wait_for_the_consumers_ack() -> None:
    queue = engine(key_groups=True, semantics="at-most-once")
    queue.enqueue([record(0, key=b"k"), record(1, key=b"k")], 0.0)
    subscribe(queue, "a", max_backlog=5)
    [first] = leases(queue.dispatch(0.0))
    assert queue.dispatch(0.0) == []

    settle(queue, first)
    assert offsets_of(queue.dispatch(0.0)) == [1]


# --------------------------------------------------------------------------- barriers


def test_a_barrier_waits_for_every_earlier_entry_to_be_acknowledged() -> None:
    queue = engine(barrier_expression="/type = 'eod'")
    offer(queue, [{"type": "work"}, {"type": "work"}, {"type": "eod"}, {"type": "work"}])
    subscribe(queue, "a", max_backlog=10)
    subscribe(queue, "b", max_backlog=10)

    first = leases(queue.dispatch(0.0))
    # Entries after the barrier are held back until the barrier is delivered.
    assert sorted(d.bookmark.offset for d in first) == [0, 1]
    settle(queue, first[0])
    assert queue.dispatch(0.0) == []
    settle(queue, first[1])

    delivered = queue.dispatch(0.0)
    barrier = delivered[0]
    assert isinstance(barrier, BarrierDelivered)
    assert barrier.bookmark.offset == 2
    assert barrier.recipients == (Recipient("a", "deliver.a"), Recipient("b", "deliver.b"))
    assert offsets_of(delivered[1:]) == [3]
    # No acknowledgement needed: the barrier left the queue at once.
    assert queue.entry(bm(2)).state is EntryState.ACKED
    acked = [e for e in of_type(queue.drain().events, EntryAcked) if e.bookmark.offset == 2]
    assert [e.source for e in acked] == [AckSource.BARRIER]


def test_a_barrier_ignores_backlog_but_respects_filters() -> None:
    queue = engine(barrier_expression="/type = 'eod'")
    offer(queue, [{"type": "eod", "desk": "fx"}, {"type": "work", "desk": "fx"}])
    subscribe(queue, "idle", max_backlog=0)
    subscribe(queue, "rates", max_backlog=5, filter="/desk = 'rates'")
    subscribe(queue, "fx", max_backlog=1, filter="/desk = 'fx'")

    delivered = queue.dispatch(0.0)

    assert isinstance(delivered[0], BarrierDelivered)
    # "rates" does not match the barrier: it does not get it (but paused like everyone).
    assert [r.consumer_id for r in delivered[0].recipients] == ["idle", "fx"]
    assert by_consumer(delivered) == {"fx": [1]}  # the barrier took no backlog room


def test_a_barrier_waits_for_a_consumer_to_deliver_to() -> None:
    queue = engine(barrier_expression="/type = 'eod'")
    offer(queue, [{"type": "eod"}])
    assert queue.dispatch(0.0) == []
    assert queue.stats().pending_barriers == 1
    subscribe(queue, "late")
    assert isinstance(queue.dispatch(0.0)[0], BarrierDelivered)
    assert queue.stats().pending_barriers == 0


def test_at_most_once_barriers_wait_for_earlier_deliveries_to_be_acknowledged() -> None:
    queue = engine(barrier_expression="/type = 'eod'", semantics="at-most-once")
    offer(queue, [{"type": "work"}, {"type": "eod"}])
    subscribe(queue, "a", max_backlog=5)
    [work] = leases(queue.dispatch(0.0))
    assert queue.dispatch(0.0) == []

    settle(queue, work)
    assert isinstance(queue.dispatch(0.0)[0], BarrierDelivered)


# --------------------------------------------------------------------------- target depth


def test_target_queue_depth_keeps_only_the_first_entries_active() -> None:
    queue = engine(target_queue_depth=3)
    journal = [record(i, {"n": i}) for i in range(6)]
    queue.enqueue(journal, 0.0)

    assert [v.doc for v in queue.view()] == [{"n": 0}, {"n": 1}, {"n": 2}]
    # Beyond the depth only the position is kept: 3..5 are not read into memory.
    assert (queue.stats().inactive, queue.stats().not_read) == (0, 3)
    assert queue.entry(bm(3)) is None
    # Nothing beyond the depth is delivered, even if it is what a consumer wants.
    subscribe(queue, "fives", filter="/n = 5")
    assert queue.dispatch(0.0) == []
    subscribe(queue, "any", max_backlog=10)
    first = leases(queue.dispatch(0.0))
    assert [d.bookmark.offset for d in first] == [0, 1, 2]
    settle(queue, first[0])
    # Acknowledging makes room: the coordinator reads the next record again, and it becomes
    # active and deliverable.
    assert [tuple(w) for w in queue.records_wanted()] == [("Work", 0, 3, 1, 6)]
    assert serve_rereads(queue, journal) == 1
    assert offsets_of(queue.dispatch(0.0)) == [3]
    assert queue.stats().not_read == 2


def test_target_queue_depth_remembers_acks_for_inactive_entries() -> None:
    queue = engine(target_queue_depth=1, leasing="permissive")
    journal = [record(i, str(i)) for i in range(8)]
    queue.enqueue(journal[:3], 0.0)

    # 2 is inactive (deferred): the ack is applied at once, and 2 never enters the
    # deliverable part; a second one is a duplicate.
    assert queue.ack([EntryAck(bm(2), None)], 0.0) == [AckOutcome.APPLIED]
    assert queue.ack([EntryAck(bm(2), None)], 0.0) == [AckOutcome.ALREADY_DONE]
    # 7 has not even been read: remembered until it arrives.
    assert queue.ack([EntryAck(bm(7), None)], 0.0) == [AckOutcome.REMEMBERED]
    assert queue.stats().remembered_acks == 1
    queue.enqueue(journal[3:], 0.0)
    assert queue.entry(bm(7)) is None and queue.stats().remembered_acks == 0

    subscribe(queue, "a")
    delivered = []
    for _ in range(10):
        serve_rereads(queue, journal)
        got = leases(queue.dispatch(0.0))
        if not got:
            break
        delivered.extend(d.bookmark.offset for d in got)
        settle(queue, got[0])
    assert delivered == [0, 1, 3, 4, 5, 6]
    early = [
        e.bookmark.offset
        for e in of_type(queue.drain().events, EntryAcked)
        if e.source is AckSource.EARLY
    ]
    assert early == [2, 7]
    assert queue.recovery_points() == {("Work", 0): 8}


def test_admin_ack_by_filter_applies_only_to_the_active_part() -> None:
    queue = engine(target_queue_depth=2)
    journal = [record(i, {"x": 1}) for i in range(4)]
    queue.enqueue(journal, 0.0)

    assert queue.ack_matching("/x = 1", 0.0) == 2
    # The two inactive entries become active as the first two left (read again).
    assert serve_rereads(queue, journal) == 2
    assert queue.stats().available == 2 and queue.stats().not_read == 0


def test_a_purge_acknowledges_the_deferred_part_as_it_is_read_back() -> None:
    queue = engine(target_queue_depth=2)
    journal = [record(i, {"x": i}) for i in range(6)]
    queue.enqueue(journal, 0.0)
    subscribe(queue, "a", max_backlog=5)
    [held, _] = leases(queue.dispatch(0.0))

    # qlayer queue purge: the active part at once (a lease ends), the rest as it is read,
    # without waiting for room and without being delivered.
    assert queue.ack_matching(None, 0.0) == 2
    assert queue.purge_deferred() == 4
    assert [w.max_records for w in queue.records_wanted()] == [10_000]
    assert serve_rereads(queue, journal) == 4
    assert queue.dispatch(0.0) == []
    acked = of_type(queue.drain().events, EntryAcked)
    assert sorted(e.bookmark.offset for e in acked if e.source is AckSource.ADMIN) == [
        0, 1, 2, 3, 4, 5]
    assert queue.stats().not_read == 0 and queue.recovery_points() == {("Work", 0): 6}
    assert queue.ack([EntryAck(held.bookmark, held.token)], 0.0) == [AckOutcome.ALREADY_DONE]
    # Records after the purge are the queue's as usual.
    queue.enqueue([record(6, {"x": 6})], 0.0)
    assert offsets_of(queue.dispatch(0.0)) == [6]


def test_strict_queues_do_not_remember_acks_without_a_lease() -> None:
    queue = engine(target_queue_depth=1)
    offer(queue, ["0", "1"])
    assert queue.ack([EntryAck(bm(1), None), EntryAck(bm(5), None)], 0.0) == [
        AckOutcome.NOT_LEASED,
        AckOutcome.UNKNOWN_BOOKMARK,
    ]
    assert of_type(queue.drain().events, EntryLeased) == []


def test_inactive_entries_that_expired_meanwhile_do_not_take_active_places() -> None:
    queue = engine(target_queue_depth=2, expiration="10s")
    journal = [record(i, timestamp=0.0) for i in range(4)]  # 2, 3 deferred, aging
    journal += [record(i, timestamp=20.0) for i in (4, 5)]
    queue.enqueue(journal[:4], 0.0)
    queue.enqueue(journal[4:], 20.0)
    subscribe(queue, "a", max_backlog=2, now=0.0)
    first = leases(queue.dispatch(0.0))
    for lease in first:
        settle(queue, lease, now=20.0)

    # 2 and 3 are too old when they are read again: they expire at once (taking no place),
    # and 4 and 5 become active.
    serve_rereads(queue, journal, now=20.0)
    assert offsets_of(queue.dispatch(20.0)) == [4, 5]
    assert queue.stats().inactive == 0
