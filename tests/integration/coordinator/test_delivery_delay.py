"""A queue-wide delivery delay through a running coordinator (`delivery_delay`, SQS's
DelaySeconds: "the length of time, in seconds, for which the delivery of all messages in the
queue is delayed"; beyond AMPS, which delays per message only)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from layer.protocol import SubscribeStatus
from layer.settings import Settings
from tests.support.coordinator import RawConsumer, produce, put_queues, running_coordinator

pytestmark = pytest.mark.integration


def test_messages_wait_the_queue_delay_after_they_were_published(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("Delayed", partitions=1)
    put_queues(settings, {"name": "Delayed", "underlying_topic": topic,
                          "delivery_delay": "4s"})
    with running_coordinator(settings):
        consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Delayed",
                               max_backlog=5)
        try:
            assert consumer.subscribe().status is SubscribeStatus.OK
            published = time.time()
            produce(settings.bootstrap_servers, topic, [b"one", b"two"])
            early = consumer.idle(2.0)
            assert early == [], "delivered before the queue's delay"
            got = consumer.receive(2, timeout=15)
            arrived = time.time()
            assert sorted(d.value for d in got) == [b"one", b"two"]
            # The delay counts from the record timestamp (taken when it was produced).
            assert arrived - published >= 3.5
            consumer.ack(got)
            assert consumer.ack_results() == []
        finally:
            consumer.close()
