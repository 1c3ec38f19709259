"""Past the memory budget, records are re-read from the journal: nothing is lost or altered."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from layer.protocol import AckType, TopicNames, parse_dead_letter_headers
from layer.settings import Settings
from tests.support.coordinator import RawConsumer, put_queues, running_coordinator

pytestmark = pytest.mark.integration


def test_records_beyond_the_budget_are_delivered_and_dead_lettered_intact(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("Big")
    put_queues(settings, {"name": "Big", "underlying_topic": topic, "lease_period": "30s"})
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 5})
    total = 300
    sent = {}
    for i in range(total):
        value = f"{i:05d}".encode() + bytes([i % 251]) * 1000
        sent[f"k{i}".encode()] = value
        producer.produce(topic, value, key=f"k{i}".encode(), headers=[("n", str(i).encode())])
    assert producer.flush(30) == 0
    received: dict[bytes, bytes] = {}
    rejected: set[bytes] = set()
    # Room for about 20 records of the 300: most must come back from the journal.
    with running_coordinator(settings, payload_budget=20_000) as coordinator:
        consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Big",
                               max_backlog=25)
        try:
            consumer.subscribe()
            deadline = time.monotonic() + 90
            while len(received) < total and time.monotonic() < deadline:
                batch = consumer.poll(0.2)
                for d in batch:
                    assert d.key is not None and d.value is not None
                    assert ("n", d.key[1:]) in d.headers  # original headers came back too
                    received[d.key] = d.value
                consumer.ack([d for d in batch if int(d.key[1:]) % 10])  # type: ignore[index]
                to_reject = [d for d in batch if int(d.key[1:]) % 10 == 0]  # type: ignore[index]
                consumer.ack(to_reject, AckType.REJECT, reason="test")
                rejected.update(d.key for d in to_reject if d.key is not None)
        finally:
            consumer.close()
        assert coordinator.counters["payload_rereads"] > 0
    assert received == sent
    # The rejected ones reached the dead-letter topic with their payload.
    dlq = TopicNames(settings.topic_prefix).dead_letter("Big")
    reader = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": "dlq-check",
                       "enable.auto.commit": False})
    reader.assign([TopicPartition(dlq, 0, 0)])
    letters: dict[bytes, bytes] = {}
    deadline = time.monotonic() + 30
    while len(letters) < len(rejected) and time.monotonic() < deadline:
        for m in reader.consume(100, 0.5):
            if m.error() is None and m.key() is not None:
                assert parse_dead_letter_headers(m.headers() or []).reason == "rejected"
                letters[m.key()] = m.value()
    reader.close()
    assert letters == {k: sent[k] for k in rejected}


def test_past_the_budget_the_fields_expressions_read_are_kept(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """Filter and priority still work on entries whose documents were projected."""
    import json

    topic = journal("Orders", partitions=1)
    put_queues(settings, {"name": "Orders", "underlying_topic": topic, "filter": "/keep = 1",
                          "priority": "/p", "lease_period": "30s"})
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 5})
    for i in range(200):
        doc = {"keep": i % 2, "p": i, "notes": "x" * 1000}
        producer.produce(topic, json.dumps(doc).encode(), key=str(i).encode())
    assert producer.flush(30) == 0
    with running_coordinator(settings, payload_budget=10_000) as coordinator:
        # Let every record be queued before the one consumer (backlog 1) starts taking them.
        deadline = time.monotonic() + 30
        while coordinator.counters["journal_records"] < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Orders")
        order: list[int] = []
        try:
            consumer.subscribe()
            deadline = time.monotonic() + 60
            while len(order) < 100 and time.monotonic() < deadline:
                batch = consumer.poll(0.2)
                order.extend(json.loads(d.value or b"{}")["p"] for d in batch)
                consumer.ack(batch)
        finally:
            consumer.close()
        assert coordinator.counters["documents_projected"] > 0
    # Only /keep = 1 entered, all of them, highest /p first (the payloads were re-read whole).
    assert order == sorted(range(1, 200, 2), reverse=True)


def test_a_filter_subscribed_after_the_records_passed_the_budget_still_matches_them(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """Past the budget a record keeps only the fields the expressions of its moment read
    (none here). A consumer filter subscribed later must still see the records' real values:
    they are read again from the journal, not matched against null (which would starve it,
    or hand `/region IS NULL` everything)."""
    import json

    topic = journal("Regions", partitions=2)
    put_queues(settings, {"name": "Regions", "underlying_topic": topic, "lease_period": "30s"})
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 5})
    regions = ["EU", "US", "APAC"]
    for i in range(300):
        doc = {"region": regions[i % 3], "n": i, "notes": "x" * 500}
        producer.produce(topic, json.dumps(doc).encode(), key=str(i).encode())
    assert producer.flush(30) == 0
    with running_coordinator(settings, payload_budget=10_000) as coordinator:
        deadline = time.monotonic() + 30
        while coordinator.counters["journal_records"] < 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert coordinator.counters["documents_projected"] > 250
        eu = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Regions",
                         max_backlog=50, filter="/region = 'EU'")
        nulls = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Regions",
                            max_backlog=50, filter="/region IS NULL")
        got: list[int] = []
        try:
            eu.subscribe()
            nulls.subscribe()
            deadline = time.monotonic() + 60
            while len(got) < 100 and time.monotonic() < deadline:
                batch = eu.poll(0.2)
                got.extend(json.loads(d.value or b"{}")["n"] for d in batch)
                eu.ack(batch)
            assert nulls.idle(0.5) == [], "no record has a null region"
        finally:
            eu.close()
            nulls.close()
        assert coordinator.counters["documents_reread"] >= 100
    assert sorted(got) == list(range(0, 300, 3))
