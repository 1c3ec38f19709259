"""Who gets what, seen from real consumers: backlog, fairness, priority and barriers."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import (
    Consumers,
    Delivered,
    collect,
    counters,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration


def enqueued(settings: Settings, queue: str, n: int) -> None:
    """Wait until the queue has taken in n journal records (so order is decided by the queue,
    not by when records arrived)."""
    wait_until(lambda: counters(settings, queue).get("enqueued", 0) >= n,
               what=f"{n} entries enqueued in {queue}")


def test_a_consumer_that_gives_no_backlog_holds_one_lease_at_a_time(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": work})
    produce(settings.bootstrap_servers, work, [b"a", b"b", b"c"])
    with running_coordinator(settings), Consumers(settings) as pool:
        worker = pool.new("WorkToDo")  # max_backlog not given
        result = worker.subscribe()
        assert [g.max_backlog for g in result.queues] == [1]
        got: list[Delivered] = []
        for _ in range(3):
            (delivery,) = worker.receive(1)
            assert worker.idle(0.4) == [], "a second lease before the first was acknowledged"
            got.append(delivery)
            worker.ack([delivery])
        assert sorted(d.value for d in got) == [b"a", b"b", b"c"]


def test_an_explicit_backlog_is_capped_by_the_queue(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": work,
                          "max_per_subscription_backlog": 3})
    produce(settings.bootstrap_servers, work, [f"m{i}".encode() for i in range(8)])
    with running_coordinator(settings), Consumers(settings) as pool:
        modest = pool.subscribe("WorkToDo", max_backlog=2)
        greedy = pool.new("WorkToDo", max_backlog=50)
        assert [g.max_backlog for g in greedy.subscribe().queues] == [3]
        held = {modest.consumer_id: modest.receive(2), greedy.consumer_id: greedy.receive(3)}
        assert modest.idle(0.4) == [] and greedy.idle(0.1) == [], "beyond the backlog"
        modest.ack(held[modest.consumer_id][:1])  # one unit of room: exactly one more
        (more,) = modest.receive(1)
        assert modest.idle(0.4) == []
        values = {d.value for ds in held.values() for d in ds} | {more.value}
        assert len(values) == 6


@pytest.mark.parametrize(("fairness", "expected"), [
    # Inky subscribes first with backlog 3, Blinky second with 6; three entries, no acks.
    ("fast", (3, 0)),           # the first consumer found with room
    ("round-robin", (2, 1)),    # Inky, Blinky, Inky
    ("proportional", (1, 2)),   # 0/3 tie -> Inky; then 0/6 < 1/3 -> Blinky; 1/6 < 1/3 -> Blinky
])
def test_fairness_decides_who_gets_the_next_entry(
    fairness: str, expected: tuple[int, int], settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": work, "fairness": fairness})
    with running_coordinator(settings), Consumers(settings) as pool:
        inky = pool.subscribe("WorkToDo", max_backlog=3)
        blinky = pool.subscribe("WorkToDo", max_backlog=6)
        produce(settings.bootstrap_servers, work, [b"e1", b"e2", b"e3"])
        got = collect([inky, blinky], 3)
        assert inky.idle(0.3) == [] and blinky.idle(0.1) == []
        assert (len(got[inky.consumer_id]), len(got[blinky.consumer_id])) == expected


def test_priority_delivers_the_highest_value_first(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """The reference's OrderPriority queue: `/price * /qty`, highest first."""
    orders = journal("Orders")
    put_queues(settings, {"name": "OrderPriority", "underlying_topic": orders,
                          "priority": "/price * /qty"})
    book = [("o1", 10, 1), ("o2", 5, 100), ("o3", 1, 1), ("o4", 20, 3), ("o5", 7, 7)]
    produce(settings.bootstrap_servers, orders,
            [json.dumps({"id": i, "price": p, "qty": q}).encode() for i, p, q in book])
    with running_coordinator(settings), Consumers(settings) as pool:
        enqueued(settings, "OrderPriority", len(book))
        trader = pool.subscribe("OrderPriority")  # backlog 1: one decision at a time
        order = []
        for _ in book:
            (delivery,) = trader.receive(1)
            order.append(json.loads(delivery.value or b"")["id"])
            trader.ack([delivery])
    assert order == ["o2", "o4", "o5", "o1", "o3"]  # 500, 60, 49, 10, 1


def test_a_barrier_waits_for_earlier_acks_reaches_everyone_and_holds_back_later_entries(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "EndOfDay", "underlying_topic": work,
                          "barrier_expression": "/type = 'barrier'"})
    with running_coordinator(settings), Consumers(settings) as pool:
        first = pool.subscribe("EndOfDay", max_backlog=5)
        second = pool.subscribe("EndOfDay", max_backlog=5)
        # AMPS: a barrier goes to every current subscriber, whatever its backlog holds.
        watcher = pool.subscribe("EndOfDay", max_backlog=1, filter="/type = 'barrier'")
        docs = [{"type": "work", "n": 1}, {"type": "work", "n": 2}, {"type": "barrier"},
                {"type": "work", "n": 3}, {"type": "work", "n": 4}]
        # One partition, so the journal order is the queue order.
        produce(settings.bootstrap_servers, work, [json.dumps(d).encode() for d in docs],
                partition=0)

        early = collect([first, second], 2)
        before = [d for ds in early.values() for d in ds]
        assert sorted(json.loads(d.value or b"")["n"] for d in before) == [1, 2]
        assert all(ds for ds in early.values()), "proportional fairness: one each"
        # The barrier waits for both acks and holds back what follows it.
        owner = {d.bookmark: c for c in (first, second) for d in early[c.consumer_id]}
        one, two = before
        owner[one.bookmark].ack([one])
        assert all(c.idle(0.3) == [] for c in (first, second, watcher)), "barrier too early"
        owner[two.bookmark].ack([two])

        after = collect([first, second, watcher], 3 + 2)
        streams = {c.consumer_id: after[c.consumer_id] for c in (first, second, watcher)}
        for consumer_id, stream in streams.items():
            barriers = [d for d in stream if d.barrier]
            assert len(barriers) == 1, f"{consumer_id} should get the barrier once"
            assert json.loads(barriers[0].value or b"") == {"type": "barrier"}
            assert stream[0].barrier, f"{consumer_id} got later work before the barrier"
        assert [d.barrier for d in streams[watcher.consumer_id]] == [True]
        later = [d for s in streams.values() for d in s if not d.barrier]
        assert sorted(json.loads(d.value or b"")["n"] for d in later) == [3, 4]
        for c in (first, second):
            c.ack([d for d in streams[c.consumer_id] if not d.barrier])
        totals = wait_for_counters(settings, "EndOfDay", acked=5)
        assert totals["delivered"] == 4, "a barrier is not leased"
        assert all(c.ack_results() == [] for c in (first, second))


def test_a_consumer_with_backlog_zero_receives_only_barriers(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """docs/protocol.md §4.1: `max_backlog` 0 is allowed; such a session receives only
    barrier messages (AMPS: "subscribers that request max_backlog=0 ... will still receive
    the barrier message")."""
    work = journal("Work")
    put_queues(settings, {"name": "EndOfDay", "underlying_topic": work,
                          "barrier_expression": "/type = 'barrier'"})
    with running_coordinator(settings), Consumers(settings) as pool:
        watcher = pool.new("EndOfDay", max_backlog=0)
        result = watcher.subscribe(timeout=10)
        assert [g.max_backlog for g in result.queues] == [0]
        worker = pool.subscribe("EndOfDay", max_backlog=5)
        docs = [{"type": "work"}, {"type": "barrier"}, {"type": "work"}]
        produce(settings.bootstrap_servers, work, [json.dumps(d).encode() for d in docs],
                partition=0)
        (work_1,) = worker.receive(1)
        worker.ack([work_1])
        (barrier,) = watcher.receive(1)
        assert barrier.barrier
        got = worker.receive(2)
        assert [d.barrier for d in got] == [True, False]
        worker.ack(got[1:])
        assert watcher.idle(0.3) == [], "backlog 0: nothing but barriers"


def test_a_tombstone_in_the_journal_is_not_queued(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """AMPS: "Only publish messages are added to the queue." A Kafka tombstone (null value)
    is a delete: consumers never see it, and it does not hold the queue back."""
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": work})
    produce(settings.bootstrap_servers, work, [b"a", None, b"b"], keys=[b"k", b"k", b"j"])
    with running_coordinator(settings) as coordinator, Consumers(settings) as pool:
        worker = pool.subscribe("WorkToDo", max_backlog=5)
        got = worker.receive(2)
        worker.ack(got)
        assert sorted(d.value for d in got) == [b"a", b"b"]
        assert worker.idle(0.5) == []
        wait_until(lambda: coordinator.counters["deletes_passed_over"] == 1,
                   what="the tombstone counted")
        wait_for_counters(settings, "WorkToDo", enqueued=2, acked=2)

        # Every record is done for the queue, the tombstone included.
        def recovery_point() -> int:
            with Store(settings.database_url) as store:
                return sum(store.load_recovery_points("WorkToDo").values())

        wait_until(lambda: recovery_point() == 3, what="the recovery point past the tombstone")
