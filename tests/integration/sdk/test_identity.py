"""The SDK's session identity against the real coordinator (protocol 5): a second live
process cannot take a consumer id over; one that kept the secret (a restart) does, at once;
a closed consumer leaves nothing to prove."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

from layer.sdk import InvalidSubscriptionError, QueueConsumer
from layer.settings import Settings
from tests.support.coordinator import put_queues, running_coordinator

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qs{uuid.uuid4().hex[:8]}.")


def test_a_second_process_without_the_secret_cannot_take_a_live_consumer_id(
        settings: Settings, create_topic: Callable[..., str],
        unique_name: Callable[[str], str], tmp_path: Path) -> None:
    topic = create_topic(unique_name("jobs"), 1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": topic, "lease_period": "60s"})

    def consumer(state: str) -> QueueConsumer:
        return QueueConsumer("Jobs", settings.bootstrap_servers, max_backlog=2,
                             topic_prefix=settings.topic_prefix, consumer_id="worker-1",
                             state_dir=tmp_path / state, subscribe_timeout=20)

    with running_coordinator(settings):
        first = consumer("host-a")
        secret_file = tmp_path / "host-a" / f"{settings.topic_prefix}worker-1.secret"
        assert secret_file.exists()
        with pytest.raises(InvalidSubscriptionError, match="live session"):
            consumer("host-b")  # another host: no secret to prove
        # The first one is undisturbed.
        producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
        producer.produce(topic, b"job")
        assert producer.flush(30) == 0
        msg = first.receive(timeout=20)
        assert msg is not None and msg.value == b"job"
        # The same host (a restart that found the file) takes the id over: the lease of the
        # first session is broken at once and the message comes to the new session.
        second = consumer("host-a")
        try:
            again = second.receive(timeout=20)
            assert again is not None and again.value == b"job" and again.delivery_count == 2
            again.ack()
        finally:
            second.close()
            first.close()
        assert not secret_file.exists()  # closed: nothing left to prove
