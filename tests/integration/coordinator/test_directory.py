"""Publishing by queue name needs only Kafka: the coordinator publishes the queue directory."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from layer import QueuePublisher
from layer.settings import Settings
from tests.support.coordinator import RawConsumer, put_queues, running_coordinator

pytestmark = pytest.mark.integration


def test_publish_to_a_queue_name_routes_to_its_default_publish_target(
    settings: Settings, unique_name: Callable[[str], str], create_topic: Callable[..., str]
) -> None:
    """The ORDERS example: ORDERS_ANALYTICS's own name routes to ORDERS_ANALYTICS_DIRECT."""
    orders = create_topic(unique_name("ORDERS"), 1)
    direct = create_topic(f"{orders}_ANALYTICS_DIRECT", 1)
    put_queues(settings, {"name": "ORDERS_ANALYTICS",
                          "underlying_topic": f"^{orders}$|^{direct}$",
                          "default_publish_target": direct})
    with running_coordinator(settings):
        with QueuePublisher(settings.bootstrap_servers,
                            topic_prefix=settings.topic_prefix) as publisher:
            deadline = time.monotonic() + 30
            target = publisher.target("ORDERS_ANALYTICS")
            while target != direct and time.monotonic() < deadline:
                time.sleep(0.2)  # the directory is written when the coordinator starts
                target = publisher.target("ORDERS_ANALYTICS")
            assert target == direct
            assert publisher.publish("ORDERS_ANALYTICS", b"via the queue name") == direct
            assert publisher.publish(orders, b"via the journal") == orders
            publisher.flush(10)
        consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix,
                               "ORDERS_ANALYTICS", max_backlog=5)
        try:
            consumer.subscribe()
            got: list[bytes] = []
            deadline = time.monotonic() + 30
            while len(got) < 2 and time.monotonic() < deadline:
                batch = consumer.poll(0.2)
                got.extend(d.value or b"" for d in batch)
                consumer.ack(batch)
        finally:
            consumer.close()
    assert sorted(got) == [b"via the journal", b"via the queue name"]
