"""`qlayer stats` of every queue in a constant number of round trips (issue 33).

It took 0.3 s per queue (31 s for 104 queues): per queue a topic listing, two or three offset
requests, two PostgreSQL queries for its entries and a new Kafka consumer to read its oldest
record. The round trips are counted here, on the real broker and database, by wrapping the
real calls: stats of 24 queues must make exactly as many as stats of 3. The figures must be
the same as each queue's own (`qlayer stats QUEUE`), also for queues that share one journal
partition at different progress (read in separate layers by one consumer).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event

from layer.kafka import KafkaAdmin
from layer.kafka.scan import RangeScanner
from layer.sdk import QueueConsumer
from layer.services.views import QueueStats, queue_stats
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import produce, put_queues, running_coordinator, wait_until

pytestmark = pytest.mark.integration

#: The KafkaAdmin calls stats makes (each one request to the broker).
ADMIN_CALLS = ("topics", "end_offsets", "log_start_offsets", "offsets_for_time")


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qs{uuid.uuid4().hex[:8]}.")


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the real calls that go to the broker and to PostgreSQL (nothing is replaced:
    each wrapper calls the real method)."""
    seen: Counter[str] = Counter()
    for name in ADMIN_CALLS:
        real = getattr(KafkaAdmin, name)

        def counted(self: KafkaAdmin, *args: Any, _real: Any = real, _name: str = name,
                    **kwargs: Any) -> Any:
            seen[f"kafka {_name}"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(KafkaAdmin, name, counted)
    real_init = RangeScanner.__init__

    def scanner(self: RangeScanner, *args: Any, **kwargs: Any) -> None:
        seen["kafka consumer"] += 1
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(RangeScanner, "__init__", scanner)

    def statement(*_: Any) -> None:
        seen["postgres statement"] += 1

    event.listen(Engine, "before_cursor_execute", statement)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", statement)


def _queues(settings: Settings, create_topic: Callable[..., str],
            unique_name: Callable[[str], str], count: int, stem: str) -> list[str]:
    """``count`` queues on journals of their own (2 partitions), each with a few records."""
    names = []
    for i in range(count):
        topic = create_topic(unique_name(f"{stem}{i}"), partitions=2)
        name = f"{stem}{i}"
        put_queues(settings, {"name": name, "underlying_topic": topic})
        produce(settings.bootstrap_servers, topic,
                [json.dumps({"n": n}).encode() for n in range(i % 4)])
        names.append(name)
    return names


def test_stats_of_many_queues_takes_as_many_round_trips_as_of_few(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str],
    round_trips: Counter[str],
) -> None:
    few = _queues(settings, create_topic, unique_name, 3, "Few")
    round_trips.clear()
    sample = queue_stats(settings, few, now=time.time())
    for_few = dict(round_trips)
    assert [s.depth for s in sample] == [0, 1, 2]

    many = few + _queues(settings, create_topic, unique_name, 21, "Many")
    round_trips.clear()
    sample = queue_stats(settings, many, now=time.time())
    for_many = dict(round_trips)
    assert len(sample) == 24
    assert sum(s.depth for s in sample) == sum(i % 4 for i in range(3)) + sum(
        i % 4 for i in range(21))
    # The same requests whatever the number of queues: one consumer for the oldest records.
    assert for_many == for_few, (for_few, for_many)
    assert for_many["kafka consumer"] == 1
    assert for_many["kafka topics"] == 1


def _figures(stats: QueueStats) -> tuple[object, ...]:
    return (stats.queue, stats.depth, stats.leased, stats.consumers, stats.partitions,
            stats.counters, stats.problem,
            None if stats.oldest_available_age is None else round(stats.oldest_available_age))


def test_stats_of_all_queues_equal_each_queues_own_also_on_a_shared_journal(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str],
) -> None:
    shared = create_topic(unique_name("Shared"), partitions=1)
    alone = create_topic(unique_name("Alone"), partitions=1)
    put_queues(settings,
               {"name": "Ahead", "underlying_topic": shared},
               {"name": "Behind", "underlying_topic": shared},
               {"name": "Alone", "underlying_topic": alone},
               {"name": "Empty", "underlying_topic": create_topic(unique_name("Empty"))})
    produce(settings.bootstrap_servers, shared,
            [json.dumps({"n": n}).encode() for n in range(6)])
    time.sleep(1.1)  # the oldest records of Ahead and Behind are seconds apart
    produce(settings.bootstrap_servers, shared,
            [json.dumps({"n": n}).encode() for n in range(6, 8)])
    produce(settings.bootstrap_servers, alone, [b'{"n": 0}'])
    def acked() -> bool | None:
        with Store(settings.database_url) as store:
            points = store.load_recovery_points("Ahead")
            counters = store.load_counters("Ahead")
        return (sum(points.values()) >= 6 and counters["Ahead"].acked >= 6) or None

    # Ahead acks its first six records; Behind, on the same partition, acks none.
    with running_coordinator(settings), QueueConsumer(
            "Ahead", settings.bootstrap_servers, topic_prefix=settings.topic_prefix,
            max_backlog=6) as ahead:
        got = [m for m in iter(lambda: ahead.receive(timeout=10), None)][:6]
        for message in got:
            message.ack()
        wait_until(acked, what="Ahead's first six records acked in PostgreSQL")
    now = time.time()
    together = {s.queue: _figures(s) for s in queue_stats(settings, now=now)}
    each = {name: _figures(queue_stats(settings, [name], now=now)[0])
            for name in ("Ahead", "Behind", "Alone", "Empty")}
    assert together == each
    ahead_stats, behind_stats = each["Ahead"], each["Behind"]
    assert ahead_stats[1] <= 2 and behind_stats[1] == 8
    # Behind's oldest record is older than Ahead's: the one partition was read for each.
    assert behind_stats[7] is not None and ahead_stats[7] is not None
    assert behind_stats[7] >= ahead_stats[7]
    assert each["Empty"][1] == 0 and each["Empty"][7] is None


def test_fifty_queues_over_one_journal_read_it_once(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read once per queue sharing it, 50 queues over one journal were 50 reads of half a
    second each (the console's first page waited 30 s): one read now, every queue's oldest."""
    journal = create_topic(unique_name("Shared"), partitions=1)
    names = [f"S{i:02d}" for i in range(50)]
    put_queues(settings, *({"name": n, "underlying_topic": journal} for n in names))
    produce(settings.bootstrap_servers, journal, [b'{"n": 0}', b'{"n": 1}'])
    reads: list[int] = []
    real = RangeScanner.read

    def counted(self: RangeScanner, starts: Any, ends: Any, **kwargs: Any) -> Any:
        reads.append(len(starts))
        return real(self, starts, ends, **kwargs)

    monkeypatch.setattr(RangeScanner, "read", counted)
    found = queue_stats(settings, names, now=time.time() + 5)
    assert reads == [1]  # one partition, read once, for all fifty
    assert {s.depth for s in found} == {2}
    ages = {s.oldest_available_age for s in found}
    assert len(ages) == 1 and ages.pop() is not None
