"""Queue engine: consumers, backlogs, filters, replace, sessions and delivery fairness."""

from __future__ import annotations

import pytest

from layer.domain.engine import QueueEngine
from layer.domain.errors import ExpressionError, UnknownConsumerError
from layer.domain.events import ConsumerLeft, EntryLeased, LeaseBroken
from layer.domain.states import AckOutcome, EntryState, LeaveReason

from .engine_helpers import (
    bm,
    by_consumer,
    engine,
    leases,
    of_type,
    offer,
    record,
    settle,
    subscribe,
)

pytestmark = pytest.mark.usefixtures("engine_implementation")


def test_max_backlog_defaults_to_one_and_is_capped_by_the_queue() -> None:
    queue = engine(max_per_subscription_backlog=5)
    offer(queue, range(20))
    subscribe(queue, "default")
    subscribe(queue, "greedy", max_backlog=50)
    subscribe(queue, "modest", max_backlog=2)

    assert {c.consumer_id: c.max_backlog for c in queue.consumers()} == {
        "default": 1,
        "greedy": 5,
        "modest": 2,
    }
    delivered = by_consumer(queue.dispatch(0.0))
    assert {name: len(got) for name, got in delivered.items()} == {
        "default": 1,
        "greedy": 5,
        "modest": 2,
    }


def test_a_consumer_with_max_backlog_zero_gets_nothing() -> None:
    queue = engine()
    offer(queue, ["0"])
    subscribe(queue, "idle", max_backlog=0)
    assert queue.dispatch(0.0) == []
    with pytest.raises(ValueError, match="max_backlog"):
        subscribe(queue, "bad", max_backlog=-1)


def test_subscription_filters_select_entries_oldest_first() -> None:
    queue = engine()
    offer(queue, [{"to": "eu"}, {"to": "us"}, {"to": "eu"}, {"to": "any"}, {}])
    subscribe(queue, "eu", max_backlog=10, filter="/to = 'eu'")
    subscribe(queue, "us", max_backlog=10, filter="/to IN ('us', 'any')")

    assert by_consumer(queue.dispatch(0.0)) == {"eu": [0, 2], "us": [1, 3]}
    assert [entry.bookmark.offset for entry in queue.view()] == [4]  # nobody wants it


def test_a_bad_filter_is_refused_and_changes_nothing() -> None:
    queue = engine()
    with pytest.raises(ExpressionError):
        subscribe(queue, "a", filter="/to = ")
    assert queue.consumers() == []


def test_replace_is_atomic_and_keeps_leases() -> None:
    # AMPS "Replacing Queue Subscriptions": leases are not broken, the backlog limit is
    # recomputed, and only messages matching the new subscription are delivered.
    queue = engine(max_per_subscription_backlog=10)
    offer(queue, [{"to": "a"}] * 10 + [{"to": "b"}] * 10)
    subscribe(queue, "c", max_backlog=10, filter="/to = 'a'")
    held = leases(queue.dispatch(0.0))
    assert len(held) == 10

    queue.replace("c", 1.0, max_backlog=5, filter="/to = 'b'")
    assert queue.consumers()[0].backlog == 10 and queue.consumers()[0].max_backlog == 5
    assert all(queue.entry(lease.bookmark).state is EntryState.LEASED for lease in held)
    for lease in held[:5]:
        settle(queue, lease, now=2.0)
    assert queue.dispatch(2.0) == []  # still 5 outstanding: at the new maximum
    settle(queue, held[5], now=3.0)
    [next_one] = leases(queue.dispatch(3.0))
    assert next_one.bookmark.offset == 10  # the first entry the new filter matches
    assert next_one.delivery_topic == "deliver.c"
    queue.replace("c", 4.0, max_backlog=5, delivery_topic="deliver.c2")
    assert queue.consumers()[0].delivery_topic == "deliver.c2"
    assert queue.consumers()[0].filter is None


def test_replace_of_an_unknown_consumer_is_an_error() -> None:
    with pytest.raises(UnknownConsumerError):
        engine().replace("ghost", 0.0)


def test_unsubscribe_breaks_every_lease_at_once() -> None:
    queue = engine()
    offer(queue, range(4))
    subscribe(queue, "a", max_backlog=3)
    assert len(leases(queue.dispatch(0.0))) == 3

    assert queue.unsubscribe("a", 1.0)
    assert not queue.unsubscribe("a", 1.0)
    events = queue.drain().events
    broken = of_type(events, LeaseBroken)
    assert [(e.bookmark.offset, e.reason) for e in broken] == [
        (0, LeaveReason.UNSUBSCRIBED),
        (1, LeaveReason.UNSUBSCRIBED),
        (2, LeaveReason.UNSUBSCRIBED),
    ]
    assert [e.broken for e in of_type(events, ConsumerLeft)] == [3]
    subscribe(queue, "b", max_backlog=4, now=1.0)
    assert by_consumer(queue.dispatch(1.0)) == {"b": [0, 1, 2, 3]}  # at once, no back-off


def test_a_missed_session_timeout_breaks_the_leases() -> None:
    queue = engine(session_timeout=10.0)
    offer(queue, ["0", "1"])
    subscribe(queue, "alive", now=0.0)
    subscribe(queue, "silent", now=0.0)
    queue.dispatch(0.0)

    assert queue.heartbeat("alive", 9.0)
    queue.tick(10.0)

    assert [c.consumer_id for c in queue.consumers()] == ["alive"]
    [left] = of_type(queue.drain().events, ConsumerLeft)
    assert (left.consumer_id, left.reason, left.broken) == (
        "silent",
        LeaveReason.SESSION_TIMEOUT,
        1,
    )
    assert queue.entry(bm(1)).state is EntryState.AVAILABLE
    assert not queue.heartbeat("silent", 11.0)


def test_a_new_session_of_the_same_consumer_breaks_the_old_sessions_leases() -> None:
    queue = engine()
    offer(queue, ["0"])
    subscribe(queue, "a", session="s1")
    [old] = leases(queue.dispatch(0.0))

    subscribe(queue, "a", session="s1", max_backlog=3)  # same session: a replace
    assert queue.entry(bm(0)).state is EntryState.LEASED
    subscribe(queue, "a", session="s2", now=1.0)
    assert queue.entry(bm(0)).state is EntryState.AVAILABLE
    assert not queue.heartbeat("a", 2.0, session_id="s1")
    [new] = leases(queue.dispatch(1.0))
    assert settle(queue, old, now=2.0) is AckOutcome.WRONG_TOKEN
    assert settle(queue, new, now=2.0) is AckOutcome.APPLIED


def hold(queue: QueueEngine, consumer_id: str, max_backlog: int, leased: int, start: int) -> int:
    """Subscribe ``consumer_id`` and give it ``leased`` entries of its own; returns next offset."""
    offer(queue, [{"for": consumer_id}] * leased, start=start)
    subscribe(queue, consumer_id, max_backlog=max_backlog, filter=f"/for = '{consumer_id}'")
    assert len(leases(queue.dispatch(0.0))) == leased
    return start + leased


def test_proportional_fairness_inky_blinky_clyde() -> None:
    # The reference's example: Inky 1 of 2 (50%), Blinky 3 of 4 (75%), Clyde 4 of 10 (40%).
    queue = engine(fairness="proportional", max_per_subscription_backlog=10)
    offset = hold(queue, "Inky", 2, 1, 0)
    offset = hold(queue, "Blinky", 4, 3, offset)
    offset = hold(queue, "Clyde", 10, 4, offset)
    for name, limit in (("Inky", 2), ("Blinky", 4), ("Clyde", 10)):
        queue.replace(name, 0.0, max_backlog=limit)  # no filter now; leases are kept

    offer(queue, [{"new": True}], start=offset)
    [delivery] = leases(queue.dispatch(0.0))

    assert delivery.consumer_id == "Clyde"


def test_proportional_fairness_gives_ties_to_the_first_found() -> None:
    queue = engine(fairness="proportional", max_per_subscription_backlog=10)
    offset = hold(queue, "first", 4, 2, 0)  # 50%
    offset = hold(queue, "second", 2, 1, offset)  # 50%
    for name, limit in (("first", 4), ("second", 2)):
        queue.replace(name, 0.0, max_backlog=limit)
    offer(queue, [{}, {}, {}], start=offset)

    # 2/4 vs 1/2 tie -> first; then 3/4 vs 1/2 -> second; then 3/4 vs 2/2 (full) -> first.
    assert [d.consumer_id for d in leases(queue.dispatch(0.0))] == ["first", "second", "first"]


def test_fast_fairness_fills_the_first_consumer_with_room() -> None:
    queue = engine(fairness="fast")
    offer(queue, range(5))
    subscribe(queue, "a", max_backlog=3)
    subscribe(queue, "b", max_backlog=3)

    assert by_consumer(queue.dispatch(0.0)) == {"a": [0, 1, 2], "b": [3, 4]}


def test_round_robin_fairness_takes_turns() -> None:
    queue = engine(fairness="round-robin")
    offer(queue, range(7))
    for name in ("a", "b", "c"):
        subscribe(queue, name, max_backlog=2)

    assert [d.consumer_id for d in leases(queue.dispatch(0.0))] == ["a", "b", "c", "a", "b", "c"]
    # The turn goes on from the last consumer served, skipping consumers without room.
    settle(queue, leases(queue.drain().events)[0], now=1.0)  # a's first entry
    assert [d.consumer_id for d in leases(queue.dispatch(1.0))] == ["a"]


def test_at_most_once_queues_deliver_round_robin() -> None:
    queue = engine(semantics="at-most-once")
    offer(queue, range(4))
    subscribe(queue, "a", max_backlog=2)
    subscribe(queue, "b", max_backlog=2)

    assert [d.consumer_id for d in leases(queue.dispatch(0.0))] == ["a", "b", "a", "b"]


def test_an_entry_goes_to_the_consumer_for_which_it_is_the_oldest_match() -> None:
    queue = engine(fairness="fast")
    offer(queue, [{"k": 1}, {"k": 2}, {"k": 1}])
    subscribe(queue, "ones", max_backlog=1, filter="/k = 1")
    subscribe(queue, "all", max_backlog=5)

    # 0 goes to "ones" (first found with room); "all" then takes 1 and 2.
    assert by_consumer(queue.dispatch(0.0)) == {"ones": [0], "all": [1, 2]}
    events = leases(queue.drain().events)
    assert [e.bookmark.offset for e in events] == [0, 1, 2]
    assert all(isinstance(e, EntryLeased) for e in events)


# ------------------------------------------------------------------ credit (protocol 8)
def test_credit_view_says_work_waits_only_when_an_entry_is_one_the_consumer_may_take() -> None:
    """What a shard reports to a consumer granting it credit: its leases here, and what waits
    for it, after its filter (a regex subscription with one credit over two shards must not
    leave that credit on the shard whose entries its filter refuses)."""
    queue = engine()
    assert queue.credit_view("nobody") == (0, 0)
    offer(queue, [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}])
    subscribe(queue, "big", max_backlog=1, filter="/n >= 2")
    # Nothing leased yet, and two of the four available entries are its own.
    assert queue.credit_view("big") == (0, 4)
    (first,) = leases(queue.dispatch(0.0))
    assert first.bookmark.offset == 2
    assert queue.credit_view("big") == (1, 3)  # n=3 waits for it
    settle(queue, first)
    (second,) = leases(queue.dispatch(0.0))
    assert second.bookmark.offset == 3
    # n=0 and n=1 wait, but not for it: asked again, the answer stays (its pointer moved on).
    assert queue.credit_view("big") == (1, 0)
    assert queue.credit_view("big") == (1, 0)
    offer(queue, [{"n": 7}], start=4)
    assert queue.credit_view("big") == (1, 3)
    # An unfiltered consumer is told of everything available.
    subscribe(queue, "any", max_backlog=0)
    assert queue.credit_view("any") == (0, 3)


def test_credit_view_of_a_key_in_flight_and_of_a_queue_a_replace_left() -> None:
    queue = engine(key_groups=True)
    queue.enqueue([record(0, key=b"alice"), record(1, key=b"alice")], 0.0)
    subscribe(queue, "a", max_backlog=1)
    subscribe(queue, "b", max_backlog=0)
    (held,) = leases(queue.dispatch(0.0))
    assert held.consumer_id == "a"
    # alice's second entry waits behind the first, in flight: nothing b may take now.
    assert queue.credit_view("b") == (0, 0)
    settle(queue, held)
    assert queue.credit_view("b") == (0, 1)
    # A consumer a replace took off the queue drains its leases and takes nothing new.
    (again,) = leases(queue.dispatch(0.0))
    assert queue.retire("a", 0.0) is not None
    queue.enqueue([record(2, key=b"bob")], 0.0)
    assert queue.credit_view("a") == (1, 0)
    assert again.consumer_id == "a"
