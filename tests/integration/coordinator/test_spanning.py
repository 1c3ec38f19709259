"""A regex subscription over queues of several shards (protocol 8, issue 31): one backlog,
held as credit the consumer moves between the shards. Through the public SDK, a real
coordinator, broker and database."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest

from layer.sdk import Message, QueueConsumer, SessionEndedError
from layer.services.consumers import ConsumerService
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import put_queues, running_coordinator
from tests.support.processes import produce_numbers

pytestmark = pytest.mark.integration


def test_a_regex_consumer_over_two_shards_holds_one_backlog_and_gets_everything_once(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """The issue's case: two queues on different shards, each allowing 10 per subscription;
    a regex consumer with max_backlog=2 holds 2 across them (it held 4 before protocol 8),
    and gets all 20 messages, each once, from both."""
    topics = {"RxOne": journal("one"), "RxTwo": journal("two")}
    put_queues(settings, *({"name": q, "underlying_topic": t, "shard": i,
                            "max_per_subscription_backlog": 10}
                           for i, (q, t) in enumerate(topics.items())))
    with running_coordinator(settings):
        for topic in topics.values():
            produce_numbers(settings.bootstrap_servers, topic, 10)
        with QueueConsumer("^Rx(One|Two)$", regex=True, max_backlog=2,
                           bootstrap_servers=settings.bootstrap_servers,
                           topic_prefix=settings.topic_prefix) as consumer:
            assert sorted(g.queue for g in consumer.grants) == ["RxOne", "RxTwo"]
            # The operator sees one consumer with a part on each shard and its credit there.
            with ConsumerService.from_settings(settings) as service:
                (info,) = service.list_consumers("RxTwo")
            assert info.credit is not None
            assert [p.shard for p in info.credit] == [0, 1]
            assert sum(p.grant for p in info.credit) <= 2
            assert all(p.owner_id is not None for p in info.credit)
            held: list[Message] = []
            deadline = time.monotonic() + 30
            while len(held) < 2 and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)
                if message is not None:
                    held.append(message)
            assert len(held) == 2
            # Nothing more comes while two are held, whichever shards they came from.
            assert consumer.receive(timeout=2.0) is None
            got = [(m.queue, str(m.bookmark)) for m in held]
            for message in held:
                message.ack()
            deadline = time.monotonic() + 60
            while len(got) < 20 and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)
                if message is not None:
                    got.append((message.queue, str(message.bookmark)))
                    message.ack()
            assert Counter(q for q, _ in got) == {"RxOne": 10, "RxTwo": 10}
            assert len(set(got)) == 20, "a message was delivered twice"
            assert consumer.receive(timeout=1.0) is None
            assert consumer.stats.credit_moves > 0  # the credit went where the work was


def test_evicting_a_consumer_over_two_shards_ends_every_part(
    settings: Settings, journal: Callable[..., str]
) -> None:
    put_queues(settings, {"name": "EvOne", "underlying_topic": journal("one"), "shard": 0},
               {"name": "EvTwo", "underlying_topic": journal("two"), "shard": 1})
    with running_coordinator(settings), QueueConsumer(
            "^Ev(One|Two)$", regex=True, max_backlog=2, consumer_id="spanning-evicted",
            bootstrap_servers=settings.bootstrap_servers,
            topic_prefix=settings.topic_prefix) as consumer:
        with Store(settings.database_url) as store:
            assert [s.shard for s in store.load_spans()] == [1]
            with ConsumerService(store) as service:
                assert service.evict("spanning-evicted", wait=30).gone
            deadline = time.monotonic() + 30
            while store.load_spans() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert store.load_spans() == [], "the part on shard 1 outlived the eviction"
        deadline = time.monotonic() + 30
        with pytest.raises(SessionEndedError):
            while time.monotonic() < deadline:
                consumer.receive(timeout=1.0)


def test_a_regex_consumer_joins_a_queue_created_later_on_another_shard(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """AMPS: a regex subscription covers queues created after it. Here the new queue lands on
    a shard the subscription had no part on: the SDK finds it in the directory, makes its
    session spanning, and gets its messages, one backlog still."""
    topics = {"LateOne": journal("one"), "LateTwo": journal("two")}
    put_queues(settings, {"name": "LateOne", "underlying_topic": topics["LateOne"], "shard": 0})
    with running_coordinator(settings), QueueConsumer(
            "^Late(One|Two)$", regex=True, max_backlog=2,
            bootstrap_servers=settings.bootstrap_servers,
            topic_prefix=settings.topic_prefix) as consumer:
        assert [g.queue for g in consumer.grants] == ["LateOne"]
        put_queues(settings, {"name": "LateTwo", "underlying_topic": topics["LateTwo"],
                              "shard": 1})
        for topic in topics.values():
            produce_numbers(settings.bootstrap_servers, topic, 3)
        got: list[tuple[str, str]] = []
        deadline = time.monotonic() + 60
        while len(got) < 6 and time.monotonic() < deadline:
            message = consumer.receive(timeout=0.5)
            if message is not None:
                got.append((message.queue, str(message.bookmark)))
                message.ack()
        assert Counter(q for q, _ in got) == {"LateOne": 3, "LateTwo": 3}
        assert len(set(got)) == 6
        assert {g.queue for g in consumer.grants} == {"LateOne", "LateTwo"}


def test_a_replace_onto_a_queue_of_another_shard_keeps_the_leases_held(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """The issue's second case: a consumer holding leases on A (shard 0) replaces its
    subscription with B (shard 1). AMPS: the leases stay valid and keep counting against the
    backlog; B's messages come once they are settled. (It raised UnknownQueueError before.)"""
    topics = {"MoveA": journal("a"), "MoveB": journal("b")}
    put_queues(settings, *({"name": q, "underlying_topic": t, "shard": i}
                           for i, (q, t) in enumerate(topics.items())))
    with running_coordinator(settings):
        for topic in topics.values():
            produce_numbers(settings.bootstrap_servers, topic, 3)
        with QueueConsumer("MoveA", max_backlog=2, bootstrap_servers=settings.bootstrap_servers,
                           topic_prefix=settings.topic_prefix) as consumer:
            held: list[Message] = []
            deadline = time.monotonic() + 30
            while len(held) < 2 and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)
                if message is not None:
                    held.append(message)
            assert [m.queue for m in held] == ["MoveA", "MoveA"]
            consumer.replace(queue="MoveB")
            assert consumer.queue == "MoveB"
            # The two leases held still fill the backlog: nothing comes from B yet.
            assert consumer.receive(timeout=2.0) is None
            for message in held:
                message.ack()
            got: list[tuple[str, str]] = []
            deadline = time.monotonic() + 30
            while len(got) < 3 and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)  # raises LeaseLostError if an ack failed
                if message is not None:
                    got.append((message.queue, str(message.bookmark)))
                    message.ack()
            assert [q for q, _ in got] == ["MoveB"] * 3
            assert len(set(got)) == 3
            assert consumer.receive(timeout=1.0) is None  # nothing more from A: it was left
        with Store(settings.database_url) as store:
            # Both acks on A were applied: its recovery point passed them.
            assert sum(store.load_recovery_points("MoveA").values()) == 2


def test_a_queue_of_a_spanning_subscription_moves_and_nothing_is_lost_or_held_twice(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """`qlayer queue move` of one of a regex subscription's queues, from the shard of its part
    to another shard, while the consumer holds leases of it: the held ones stay ackable, the
    rest of its messages come from the new shard, and the one backlog holds throughout."""
    topics = {"MvOne": journal("one"), "MvTwo": journal("two")}
    put_queues(settings, {"name": "MvOne", "underlying_topic": topics["MvOne"], "shard": 0},
               {"name": "MvTwo", "underlying_topic": topics["MvTwo"], "shard": 1})
    with running_coordinator(settings):
        for topic in topics.values():
            produce_numbers(settings.bootstrap_servers, topic, 10)
        with QueueConsumer("^Mv(One|Two)$", regex=True, max_backlog=2,
                           bootstrap_servers=settings.bootstrap_servers,
                           topic_prefix=settings.topic_prefix) as consumer:
            got: list[tuple[str, str]] = []
            held: list[Message] = []
            deadline = time.monotonic() + 30
            while not any(m.queue == "MvTwo" for m in held) and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)
                if message is None:
                    continue
                held.append(message)
                if len(held) > 1:  # keep one of MvTwo held across the move
                    first = held.pop(0)
                    got.append((first.queue, str(first.bookmark)))
                    first.ack()
            assert any(m.queue == "MvTwo" for m in held)
            with Store(settings.database_url) as store:
                moved = store.move_queue("MvTwo", 2, time.time())
            assert (moved.from_shard, moved.to_shard) == (1, 2)
            for message in held:
                got.append((message.queue, str(message.bookmark)))
                message.ack()
            deadline = time.monotonic() + 90
            while len(set(got)) < 20 and time.monotonic() < deadline:
                # Take what comes until nothing more does: never more than the backlog.
                holding: list[Message] = []
                while len(holding) <= 2:
                    message = consumer.receive(timeout=1.0)
                    if message is None:
                        break
                    holding.append(message)
                assert len(holding) <= 2, "more held than the one backlog"
                for m in holding:
                    got.append((m.queue, str(m.bookmark)))
                    m.ack()
            assert Counter(q for q, _ in set(got)) == {"MvOne": 10, "MvTwo": 10}
            assert len(got) == len(set(got)), "a message was delivered twice"
