"""Queue engine: recovery points, the outbox of changed entries, and restart (restore)."""

from __future__ import annotations

import pytest

from layer.domain.engine import QueueEngine
from layer.domain.entries import EntryRecord
from layer.domain.events import EntryLeased, LeaseBroken
from layer.domain.states import AckOutcome, AckType, EntryState

from .engine_helpers import bm, engine, leases, of_type, offer, record, settle, subscribe

pytestmark = pytest.mark.usefixtures("engine_implementation")


def test_the_recovery_point_is_the_lowest_offset_not_done_per_partition() -> None:
    queue = engine()
    queue.enqueue(
        [record(0), record(1), record(2), record(40, partition=1), record(41, partition=1)], 0.0
    )
    subscribe(queue, "a", max_backlog=5)
    got = {(d.bookmark.partition, d.bookmark.offset): d for d in leases(queue.dispatch(0.0))}
    assert queue.recovery_points() == {("Work", 0): 0, ("Work", 1): 40}

    settle(queue, got[(0, 1)])
    settle(queue, got[(1, 40)])
    assert queue.recovery_points() == {("Work", 0): 0, ("Work", 1): 41}  # 0 is not done
    settle(queue, got[(0, 0)])
    assert queue.recovery_points() == {("Work", 0): 2, ("Work", 1): 41}
    settle(queue, got[(0, 2)], AckType.REJECT)  # EXPIRED is done too
    settle(queue, got[(1, 41)])
    assert queue.recovery_points() == {("Work", 0): 3, ("Work", 1): 42}


def test_drain_gives_each_changed_entry_once_with_its_current_state() -> None:
    queue = engine()
    offer(queue, ["0", "1", "2"])
    assert queue.drain().entries == []  # untouched entries are not persisted

    subscribe(queue, "a", max_backlog=2)
    zero, one = leases(queue.dispatch(0.0))
    settle(queue, zero)
    settle(queue, one, AckType.RELEASE)
    records = queue.drain().entries

    assert records == [
        EntryRecord(bm(0), EntryState.ACKED, delivery_count=1),
        EntryRecord(bm(1), EntryState.AVAILABLE, delivery_count=1, cancel_count=1),
    ]
    assert queue.drain().entries == []
    again, _two = leases(queue.dispatch(1.0))
    leased = queue.drain().entries[0]
    assert (leased.bookmark, leased.state, leased.consumer_id, leased.token, leased.deadline) == (
        bm(1),
        EntryState.LEASED,
        "a",
        again.token,
        again.deadline,
    )


def test_done_entries_are_reclaimed_without_changing_any_answer() -> None:
    queue = engine()
    total = 20_000
    subscribe(queue, "a", max_backlog=100)
    for start in range(0, total, 1000):
        offer(queue, range(1000), start=start)
        while got := leases(queue.dispatch(0.0)):
            for lease in got:
                settle(queue, lease)
        queue.drain()

    assert queue.recovery_points() == {("Work", 0): total}
    assert settle(queue, EntryLeased("Q", bm(5), "a", "", "t", 0.0, 1, 0.0)) is (
        AckOutcome.ALREADY_DONE
    )
    assert queue.entry(bm(total - 1)) is None  # done and forgotten: below the recovery point
    offer(queue, ["late"], start=total)
    assert [d.bookmark.offset for d in leases(queue.dispatch(0.0))] == [total]


def test_restart_skips_done_entries_and_keeps_leases_until_their_deadline() -> None:
    before = engine(lease_period="30s", max_deliveries=5)
    offer(before, [{"n": i} for i in range(5)])
    subscribe(before, "a", max_backlog=3, session="s1")
    zero, one, two = leases(before.dispatch(0.0))
    settle(before, zero)
    settle(before, one, AckType.RELEASE)
    persisted = {r.bookmark: r for r in before.drain().entries}
    recovery = before.recovery_points()
    assert recovery == {("Work", 0): 1}

    after = engine(lease_period="30s", max_deliveries=5)
    after.restore(persisted.values(), recovery)
    subscribe(after, "a", max_backlog=3, session="s1", now=10.0)
    # The coordinator replays the journal from the recovery point (here, a bit earlier).
    assert after.enqueue([record(i, {"n": i}) for i in range(5)], 10.0) == 4

    assert after.entry(bm(0)) is None  # below the recovery point
    assert after.entry(two.bookmark).state is EntryState.LEASED
    assert after.consumers()[0].backlog == 1  # the restored lease counts for its session
    # The entry that was released keeps its delivery and cancel counts.
    [redelivered, three] = leases(after.dispatch(10.0))
    assert (redelivered.bookmark.offset, redelivered.delivery_count) == (1, 2)
    assert after.entry(bm(1)).cancel_count == 1 and three.bookmark.offset == 3
    # The old token still acknowledges the restored lease ...
    assert settle(after, two, now=11.0) is AckOutcome.APPLIED


def test_a_restored_lease_expires_at_its_deadline() -> None:
    before = engine(lease_period="30s")
    offer(before, ["0"])
    subscribe(before, "gone", session="old")
    [lease] = leases(before.dispatch(0.0))
    persisted = before.drain().entries

    after = engine(lease_period="30s")
    after.restore(persisted, {})
    offer(after, ["0"])
    assert after.entry(lease.bookmark).state is EntryState.LEASED
    subscribe(after, "other", now=5.0)
    assert after.dispatch(5.0) == []
    after.tick(29.0)
    assert after.entry(lease.bookmark).state is EntryState.LEASED
    after.tick(30.0)

    [again] = leases(after.dispatch(30.0))
    assert (again.consumer_id, again.delivery_count) == ("other", 2)


def test_a_restored_lease_of_a_consumer_back_with_a_new_session_is_broken() -> None:
    before = engine()
    offer(before, ["0"])
    subscribe(before, "a", session="old")
    before.dispatch(0.0)
    persisted = before.drain().entries

    after = engine()
    after.restore(persisted, {})
    offer(after, ["0"])
    subscribe(after, "a", session="new", now=1.0)

    assert after.entry(bm(0)).state is EntryState.AVAILABLE
    broken = of_type(after.drain().events, LeaseBroken)
    assert [e.bookmark.offset for e in broken] == [0]
    assert [d.consumer_id for d in leases(after.dispatch(1.0))] == ["a"]


def _restarted_with(lease_count: int, *, lease_period: str = "30s",
                    session: str = "s1") -> tuple[list[EntryLeased], QueueEngine]:
    """A queue that leased ``lease_count`` entries to "a", and its restart from what it
    persisted (the journal replayed, "a" back with ``session``)."""
    before = engine(lease_period=lease_period)
    offer(before, [str(i) for i in range(lease_count)])
    subscribe(before, "a", max_backlog=lease_count, session="s1")
    held = leases(before.dispatch(0.0))
    after = engine(lease_period=lease_period)
    after.restore(before.drain().entries, before.recovery_points())
    subscribe(after, "a", max_backlog=lease_count, session=session, now=10.0)
    return held, after


def test_restored_leases_are_sent_again_unchanged_once_their_records_are_replayed() -> None:
    held, after = _restarted_with(3)
    assert after.resends(10.0) == []  # the replay has not brought the records back yet

    offer(after, ["0", "1", "2"], now=10.0)
    resent = after.resends(10.0)
    assert [(d.bookmark, d.token, d.deadline, d.delivery_count, d.delivery_topic)
            for d in resent] == [
        (d.bookmark, d.token, d.deadline, d.delivery_count, d.delivery_topic) for d in held]
    assert after.resends(10.0) == []  # once
    # They are the same leases, not new ones: no event, and the old tokens settle them.
    assert of_type(after.drain().events, EntryLeased) == []
    assert all(settle(after, d, now=11.0) is AckOutcome.APPLIED for d in held)


def test_settled_expired_and_broken_leases_are_not_sent_again() -> None:
    held, after = _restarted_with(3, lease_period="30s")
    offer(after, ["0", "1", "2"], now=10.0)
    settle(after, held[0], now=10.0)  # an ack that waited for the replay
    assert [d.token for d in after.resends(10.0)] == [held[1].token, held[2].token]

    held, expired = _restarted_with(3, lease_period="30s")
    offer(expired, ["0", "1", "2"], now=10.0)
    expired.tick(31.0)  # past the deadline persisted before the restart
    assert expired.resends(31.0) == []

    held, broken = _restarted_with(2, session="new")  # "a" is back with a new session
    offer(broken, ["0", "1"], now=10.0)
    assert broken.resends(10.0) == []  # the session they were sent to is gone


def test_a_lease_replayed_after_its_consumer_came_back_with_a_new_session_is_broken() -> None:
    held, after = _restarted_with(2, session="new")  # back before the replay reached them
    offer(after, ["0", "1"], now=10.0)

    assert [e.bookmark for e in of_type(after.drain().events, LeaseBroken)] == [
        d.bookmark for d in held]
    # Offered again at once (to the consumer's new session), not after the lease period.
    again = leases(after.dispatch(10.0))
    assert [(d.bookmark, d.delivery_count) for d in again] == [(d.bookmark, 2) for d in held]


def test_restored_acked_and_expired_entries_are_not_enqueued_again() -> None:
    queue = engine()
    queue.restore(
        [
            EntryRecord(bm(1), EntryState.ACKED, delivery_count=1),
            EntryRecord(bm(2), EntryState.EXPIRED, delivery_count=3),
        ],
        {("Work", 0): 1},
    )
    assert offer(queue, ["0", "1", "2", "3"]) == 1
    subscribe(queue, "a", max_backlog=5)
    assert [d.bookmark.offset for d in leases(queue.dispatch(0.0))] == [3]
    assert queue.recovery_points() == {("Work", 0): 3}


def test_next_deadline_tells_when_a_timer_is_due() -> None:
    queue = engine(lease_period="10s", session_timeout=60.0)
    assert queue.next_deadline() is None
    queue.enqueue([record(0), record(1, deliver_at=5.0)], 0.0)
    assert queue.next_deadline() == 5.0
    subscribe(queue, "a", now=1.0)
    queue.dispatch(1.0)
    assert queue.next_deadline() == 5.0
    queue.tick(5.0)
    assert queue.next_deadline() == 11.0
