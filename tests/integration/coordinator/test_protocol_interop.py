"""End to end with nothing but Kafka clients: a plain producer, hand-built protocol records."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from layer.protocol import SubscribeStatus
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import Delivered, RawConsumer, put_queues, running_coordinator

pytestmark = pytest.mark.integration


def produce(bootstrap: str, topic: str, n: int, prefix: str = "m") -> list[bytes]:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    values = [f"{prefix}{i}".encode() for i in range(n)]
    for i, v in enumerate(values):
        producer.produce(topic, v, key=f"k{i}".encode(), headers=[("origin", b"plain")])
    assert producer.flush(30) == 0
    return values


def test_three_plain_consumers_share_the_work_exactly_once(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": work, "lease_period": "30s"})
    sent = produce(settings.bootstrap_servers, work, 60)
    with running_coordinator(settings):
        consumers = [RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "WorkToDo",
                                 max_backlog=5) for _ in range(3)]
        try:
            for c in consumers:
                result = c.subscribe()
                assert result.status is SubscribeStatus.OK
                assert [g.queue for g in result.queues] == ["WorkToDo"]
                assert result.queues[0].max_backlog == 5
            got: dict[str, list[Delivered]] = {c.consumer_id: [] for c in consumers}
            deadline = time.monotonic() + 60
            while sum(len(v) for v in got.values()) < len(sent) and time.monotonic() < deadline:
                for c in consumers:
                    batch = c.poll(0.2)
                    got[c.consumer_id].extend(batch)
                    c.ack(batch)
            values = Counter(d.value for ds in got.values() for d in ds)
            assert set(values) == set(sent)
            assert max(values.values()) == 1, "a message was delivered twice"
            assert all(got.values()), "every consumer should get a share of the work"
            sample = next(d for ds in got.values() for d in ds)
            assert ("origin", b"plain") in sample.headers  # original headers kept
            assert sample.key is not None and sample.key.startswith(b"k")
            assert sample.delivery_count == 1
            # Every ack is applied: the recovery points reach the journal's end.
            deadline = time.monotonic() + 30
            with Store(settings.database_url) as store:
                while time.monotonic() < deadline:
                    points = store.load_recovery_points("WorkToDo")
                    if sum(points.values()) == len(sent):
                        break
                    time.sleep(0.2)
                assert sum(points.values()) == len(sent)
        finally:
            for c in consumers:
                c.close()


def test_subscribe_to_an_unknown_queue_is_answered_not_ignored(settings: Settings) -> None:
    put_queues(settings, {"name": "Known", "underlying_topic": "known-topic"})
    with running_coordinator(settings):
        c = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Nope")
        try:
            result = c.subscribe()
        finally:
            c.close()
    assert result.status is SubscribeStatus.UNKNOWN_QUEUE
    assert "Nope" in (result.message or "")
