"""QueuePublisher and the queue directory on real Kafka: routing, headers, delayed delivery."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka import Message as KafkaMessage

from layer.domain.definitions import QueueDefinition, load_queue_file
from layer.protocol import TopicNames
from layer.sdk import (
    NoPublishTargetError,
    PublishError,
    QueueDirectory,
    QueuePublisher,
    delete_queue_definition,
    publish_queue_definitions,
    sync_queue_definitions,
)

pytestmark = pytest.mark.integration

# The AMPS reference's routing table (amps-message-queues-chapter.rst), with journal names
# made unique per test; the queue names are the reference's own (the directory is per test).
ORDERS = """
queues:
  - Name: ORDERS_ANALYTICS
    UnderlyingTopic: ^{orders}$|^{analytics}$
    DefaultPublishTarget: {analytics}
  - Name: ORDERS_RISK
    UnderlyingTopic: ^{orders}$|^{risk}$
    DefaultPublishTarget: {risk}
"""


def read_topic(bootstrap_servers: str, topic: str, count: int,
               partitions: int = 1) -> list[KafkaMessage]:
    reader = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": f"{topic}-reader",
                       "auto.offset.reset": "earliest", "enable.auto.commit": False})
    reader.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got: list[KafkaMessage] = []
    deadline = time.monotonic() + 30
    try:
        while len(got) < count and time.monotonic() < deadline:
            got += [m for m in reader.consume(100, 0.5) if m.error() is None]
        time.sleep(0.3)  # anything beyond the expected records would show up now
        got += [m for m in reader.consume(100, 0.5) if m.error() is None]
    finally:
        reader.close()
    return got


def test_publish_to_a_topic_writes_key_value_and_headers(
    bootstrap_servers: str, prefix: str, create_topic: Callable[..., str],
    unique_name: Callable[[str], str],
) -> None:
    topic = create_topic(unique_name("events"), partitions=1)
    with QueuePublisher(bootstrap_servers, topic_prefix=prefix) as publisher:
        assert publisher.publish(topic, b'{"n": 1}', key=b"k1",
                                 headers={"trace": b"abc", "source": "test"}) == topic
        publisher.publish(topic, "text value", key="k2", headers=[("h", None)])
    [first, second] = read_topic(bootstrap_servers, topic, 2)
    assert (first.key(), first.value()) == (b"k1", b'{"n": 1}')
    assert first.headers() == [("trace", b"abc"), ("source", b"test")]
    assert (second.key(), second.value(), second.headers()) == (b"k2", b"text value",
                                                                [("h", None)])


def test_publishing_to_a_queue_name_goes_to_its_default_publish_target(
    bootstrap_servers: str, prefix: str, create_topic: Callable[..., str],
    unique_name: Callable[[str], str],
) -> None:
    orders, analytics, risk = (create_topic(unique_name(n), partitions=1)
                               for n in ("ORDERS", "ORDERS_ANALYTICS_DIRECT",
                                         "ORDERS_RISK_DIRECT"))
    queues = load_queue_file(ORDERS.format(orders=orders, analytics=analytics, risk=risk))
    assert publish_queue_definitions(queues, bootstrap_servers, topic_prefix=prefix) == 2

    with QueuePublisher(bootstrap_servers, topic_prefix=prefix) as publisher:
        assert publisher.publish("ORDERS_ANALYTICS", b"a1") == analytics
        assert publisher.publish("ORDERS_RISK", b"r1") == risk
        assert publisher.publish(orders, b"o1") == orders  # a journal is written as named
        assert publisher.publish(analytics, b"a2") == analytics

    assert [m.value() for m in read_topic(bootstrap_servers, analytics, 2)] == [b"a1", b"a2"]
    assert [m.value() for m in read_topic(bootstrap_servers, risk, 1)] == [b"r1"]
    assert [m.value() for m in read_topic(bootstrap_servers, orders, 1)] == [b"o1"]


def test_queue_over_a_regex_without_a_publish_target_is_refused(
    bootstrap_servers: str, prefix: str
) -> None:
    queue = QueueDefinition(name="AllOrders", underlying_topic="^orders-.*")
    publish_queue_definitions([queue], bootstrap_servers, topic_prefix=prefix)
    with QueuePublisher(bootstrap_servers, topic_prefix=prefix) as publisher, \
            pytest.raises(NoPublishTargetError) as caught:
        publisher.publish("AllOrders", b"x")
    assert caught.value.queue == "AllOrders"
    assert "default_publish_target" in str(caught.value)
    assert "'^orders-.*'" in str(caught.value)


def test_queue_over_one_journal_routes_to_that_journal(
    bootstrap_servers: str, prefix: str, unique_name: Callable[[str], str]
) -> None:
    journal = unique_name("work")
    publish_queue_definitions([QueueDefinition(name="WorkToDo", underlying_topic=journal)],
                              bootstrap_servers, topic_prefix=prefix)
    with QueuePublisher(bootstrap_servers, topic_prefix=prefix) as publisher:
        assert publisher.target("WorkToDo") == journal


def test_deliver_at_becomes_the_delayed_delivery_header(
    bootstrap_servers: str, prefix: str, create_topic: Callable[..., str],
    unique_name: Callable[[str], str],
) -> None:
    topic = create_topic(unique_name("later"), partitions=1)
    at = datetime(2030, 1, 2, 3, 4, 5, 678_000, tzinfo=UTC)
    with QueuePublisher(bootstrap_servers, topic_prefix=prefix) as publisher:
        publisher.publish(topic, b"dt", deliver_at=at, headers={"h": b"1"})
        publisher.publish(topic, b"epoch", deliver_at=1_900_000_000.5)
        with pytest.raises(ValueError, match="time zone"):
            publisher.publish(topic, b"naive", deliver_at=datetime(2030, 1, 1))
    first, second = read_topic(bootstrap_servers, topic, 2)
    assert first.headers() == [("h", b"1"), ("qlayer.deliver-at", b"1893553445678")]
    assert second.headers() == [("qlayer.deliver-at", b"1900000000500")]


def test_records_kafka_refuses_are_reported_by_flush(
    bootstrap_servers: str, prefix: str, unique_name: Callable[[str], str]
) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = unique_name("small")
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    admin.create_topics([NewTopic(topic, 1, config={"max.message.bytes": "200"})])[topic].result(
        timeout=30)
    publisher = QueuePublisher(bootstrap_servers, topic_prefix=prefix)
    publisher.publish(topic, b"x" * 10_000)
    with pytest.raises(PublishError) as caught:
        publisher.flush(30)
    assert topic in str(caught.value)
    publisher.flush(5)  # reported once
    publisher.close()


# --- the directory -----------------------------------------------------------------------------


def test_directory_sees_new_queues_on_a_miss_and_deletions_on_refresh(
    bootstrap_servers: str, prefix: str
) -> None:
    directory = QueueDirectory(bootstrap_servers, topic_prefix=prefix, miss_refresh_interval=0)
    publisher = QueuePublisher(bootstrap_servers, topic_prefix=prefix, directory=directory)
    # No directory topic yet (no coordinator ever ran): every name is a topic.
    assert publisher.target("Jobs") == "Jobs"
    publish_queue_definitions(
        [QueueDefinition(name="Jobs", underlying_topic="^jobs-(in|retry)$",
                         default_publish_target="jobs-in")],
        bootstrap_servers, topic_prefix=prefix)
    assert publisher.target("Jobs") == "jobs-in"  # a miss reads the directory again
    delete_queue_definition("Jobs", bootstrap_servers, topic_prefix=prefix)
    assert publisher.target("Jobs") == "jobs-in"  # a hit is served until the next refresh
    directory.refresh()
    assert publisher.target("Jobs") == "Jobs"
    assert directory.definitions() == []
    publisher.close()
    directory.close()


def test_directory_topic_is_compacted_and_sync_removes_stale_queues(
    bootstrap_servers: str, prefix: str
) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    first = [QueueDefinition(name=n, underlying_topic=f"{n}-in") for n in ("A", "B", "C")]
    assert sync_queue_definitions(first, bootstrap_servers, topic_prefix=prefix) == (3, 0)
    changed = QueueDefinition(name="B", underlying_topic="B-in", lease_period=60.0)
    assert sync_queue_definitions([changed], bootstrap_servers, topic_prefix=prefix) == (1, 2)
    with QueueDirectory(bootstrap_servers, topic_prefix=prefix) as directory:
        assert directory.definitions() == [changed]
        assert directory.get("B") == changed and directory.get("A") is None
        assert directory.malformed == 0

    topic = TopicNames(prefix).queues
    resource = ConfigResource(ResourceType.TOPIC, topic)
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    config = admin.describe_configs([resource])[resource].result(timeout=30)
    assert config["cleanup.policy"].value == "compact"


def test_unreadable_directory_records_are_counted_and_skipped(
    bootstrap_servers: str, prefix: str
) -> None:
    from confluent_kafka import Producer

    publish_queue_definitions([QueueDefinition(name="Good", underlying_topic="good-in")],
                              bootstrap_servers, topic_prefix=prefix)
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    topic = TopicNames(prefix).queues
    producer.produce(topic, key=b"Bad", value=b"{not json")
    producer.produce(topic, key=b"Worse", value=b'{"name": "Worse", "lease_perod": "1s"}')
    assert producer.flush(10) == 0
    with QueueDirectory(bootstrap_servers, topic_prefix=prefix) as directory:
        assert [d.name for d in directory.definitions()] == ["Good"]
        assert directory.malformed == 2
        assert directory.publish_target("Bad") == "Bad"


def test_directory_reads_past_the_first_fetch(bootstrap_servers: str, prefix: str) -> None:
    many = [QueueDefinition(name=f"Q{i:04d}", underlying_topic=f"q{i}-in",
                            expiration=timedelta(hours=1).total_seconds())
            for i in range(1500)]
    publish_queue_definitions(many, bootstrap_servers, topic_prefix=prefix)
    with QueueDirectory(bootstrap_servers, topic_prefix=prefix) as directory:
        assert len(directory.definitions()) == 1500
        assert directory.publish_target("Q1499") == "q1499-in"
