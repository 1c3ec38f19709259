"""Delivery batches and AcceptRecords (protocol 3) between the SDK and the real coordinator,
and the record form kept for plain Kafka readers of a delivery topic."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer

from layer.protocol.batch import BATCH
from layer.protocol.headers import BOOKMARK, LEASE
from layer.sdk import QueueConsumer, QueuePublisher
from layer.settings import Settings
from tests.support.coordinator import counters, put_queues, running_coordinator, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qf{uuid.uuid4().hex[:8]}.")


def _records_on(bootstrap: str, topic: str) -> list[list[tuple[str, bytes]]]:
    """The headers of every record on a delivery topic, read by a plain Kafka consumer."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                       "auto.offset.reset": "earliest", "enable.auto.commit": False})
    reader.subscribe([topic])
    found: list[list[tuple[str, bytes]]] = []
    idle = 0
    try:
        while idle < 3:
            batch = reader.consume(500, 1.0)
            idle = 0 if batch else idle + 1
            found.extend([(k, v or b"") for k, v in (r.headers() or [])]
                         for r in batch if r.error() is None)
    finally:
        reader.close()
    return found


def _publish(settings: Settings, topic: str, count: int) -> None:
    with QueuePublisher(settings.bootstrap_servers,
                        topic_prefix=settings.topic_prefix) as publisher:
        for i in range(count):
            publisher.publish(topic, json.dumps({"n": i}).encode(), key=b"k%d" % i,
                              headers=[("trace", b"t%d" % i)])


def test_batches_carry_many_messages_each_with_its_own_record_and_lease(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=2)
    put_queues(settings, {"name": "Batched", "underlying_topic": work})
    _publish(settings, work, 300)
    with running_coordinator(settings):
        worker = QueueConsumer("Batched", settings.bootstrap_servers,
                               topic_prefix=settings.topic_prefix, max_backlog=100)
        seen: dict[int, tuple[bytes | None, list[tuple[str, bytes | None]], str]] = {}
        released = rejected = False
        while len(seen) < 300:
            message = worker.receive(timeout=30)
            assert message is not None, f"only {len(seen)} of 300 arrived"
            n = message.json()["n"]
            if n == 7 and not released:
                released = True
                message.release()  # an item beside the AcceptRecords: comes back alone
                continue
            if n == 8 and not rejected:
                rejected = True
                message.reject("bad")
                seen[n] = (message.key, message.headers, message.lease)
                continue
            assert n not in seen
            seen[n] = (message.key, message.headers, message.lease)
            message.ack()
        worker.close()  # flushes the last acks
        stats = worker.stats
        wait_until(lambda: counters(settings, "Batched").get("acked") == 299 or None,
                   timeout=30, what="299 acks applied")
        totals = counters(settings, "Batched")
        delivery_topic = worker.delivery_topic
    # Every message kept its own key, headers and lease token.
    assert all(seen[n][0] == b"k%d" % n and seen[n][1] == [("trace", b"t%d" % n)]
               for n in range(300))
    assert len({lease for _, _, lease in seen.values()}) == 300
    assert (totals["released"], totals["dead_lettered"], totals["redelivered"]) == (1, 1, 1)
    # Far fewer records than messages, each a batch; and far fewer ack records than acks.
    records = _records_on(settings.bootstrap_servers, delivery_topic)
    batches = [h for h in records if h and h[0] == (BATCH, b"1")]
    assert batches and len(batches) < 100, len(batches)
    assert stats.ack_items_sent == 301 and stats.ack_records_sent < 100


def test_a_record_form_consumer_gets_one_record_per_message_with_qlayer_headers(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=1)
    put_queues(settings, {"name": "Plain", "underlying_topic": work})
    _publish(settings, work, 20)
    with running_coordinator(settings):
        worker = QueueConsumer("Plain", settings.bootstrap_servers,
                               topic_prefix=settings.topic_prefix, max_backlog=50,
                               delivery_format="record")
        for _ in range(20):
            message = worker.receive(timeout=30)
            assert message is not None
            message.ack()
        worker.close()
        wait_until(lambda: counters(settings, "Plain").get("acked") == 20 or None,
                   timeout=30, what="20 acks applied")
        delivery_topic = worker.delivery_topic
    deliveries = [dict(h) for h in _records_on(settings.bootstrap_servers, delivery_topic)
                  if dict(h).get(BOOKMARK)]
    assert len(deliveries) == 20
    assert all(h.get(LEASE) and BATCH not in h for h in deliveries)


def test_an_unknown_delivery_format_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="delivery_format"):
        QueueConsumer("Q", "127.0.0.1:1", delivery_format="json")  # type: ignore[arg-type]
