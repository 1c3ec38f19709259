"""The SDK against the real coordinator (its loop in a thread, real Kafka and PostgreSQL).

The peer tests pin down the SDK's side of the protocol; these check that the two sides,
written separately from docs/protocol.md, work together.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from layer.coordinator.options import CoordinatorOptions
from layer.protocol import AckStatus
from layer.sdk import LeaseLostError, Message, QueueConsumer, QueuePublisher, UnknownQueueError
from layer.services.queues import QueueService
from layer.settings import Settings
from tests.support.coordinator import counters, put_queues, running_coordinator, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qs{uuid.uuid4().hex[:8]}.")


def consumer(settings: Settings, queue: str, **options: object) -> QueueConsumer:
    return QueueConsumer(queue, settings.bootstrap_servers, topic_prefix=settings.topic_prefix,
                         **options)  # type: ignore[arg-type]


def test_three_consumers_share_a_queue_each_message_once(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=3)
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": work})
    with QueuePublisher(settings.bootstrap_servers,
                        topic_prefix=settings.topic_prefix) as publisher:
        for i in range(300):
            publisher.publish(work, json.dumps({"n": i}).encode(), key=str(i % 7).encode())
    seen: Counter[int] = Counter()
    lock = threading.Lock()

    def handle(message: Message) -> None:
        with lock:
            seen[message.json()["n"]] += 1

    with running_coordinator(settings):
        workers = [consumer(settings, "WorkToDo", max_backlog=10) for _ in range(3)]
        handled = [0, 0, 0]

        def work_on(index: int) -> None:
            handled[index] = workers[index].run(handle, idle_timeout=3.0)

        threads = [threading.Thread(target=work_on, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for worker in workers:
            worker.close()
        wait_until(lambda: counters(settings, "WorkToDo").get("acked") == 300 or None,
                   timeout=30, what="300 acks applied")
    assert sorted(seen) == list(range(300))
    assert set(seen.values()) == {1}  # each message to exactly one consumer, once
    assert sum(handled) == 300 and all(handled), handled


def test_close_breaks_leases_so_another_consumer_gets_them_at_once(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=1)
    # A long lease: only the Unsubscribe can bring these back within the test.
    put_queues(settings, {"name": "Jobs", "underlying_topic": work, "lease_period": "10m"})
    with QueuePublisher(settings.bootstrap_servers,
                        topic_prefix=settings.topic_prefix) as publisher:
        for i in range(3):
            publisher.publish(work, f"j{i}".encode())
    with running_coordinator(settings):
        first = consumer(settings, "Jobs", max_backlog=3)
        held = [first.receive(timeout=20) for _ in range(3)]
        assert all(m is not None and m.delivery_count == 1 for m in held)
        second = consumer(settings, "Jobs", max_backlog=3)
        assert second.receive(timeout=1.0) is None  # all three are leased to the first
        closed_at = time.monotonic()
        first.close()
        again = [second.receive(timeout=20) for _ in range(3)]
        assert time.monotonic() - closed_at < 15
        assert sorted(m.value for m in again if m is not None) == [b"j0", b"j1", b"j2"]
        assert {m.delivery_count for m in again if m is not None} == {2}
        for message in again:
            assert message is not None
            message.ack()
        second.close()


def test_renew_and_a_lost_lease_with_the_coordinator(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=1)
    # 5 s: the delivery may reach the worker seconds after its lease began on a loaded
    # machine, and the renew must still find the lease (2 s once did not: WRONG_TOKEN).
    put_queues(settings, {"name": "Jobs", "underlying_topic": work, "lease_period": "5s"})
    with QueuePublisher(settings.bootstrap_servers,
                        topic_prefix=settings.topic_prefix) as publisher:
        publisher.publish(work, b"slow")
    errors: list[LeaseLostError] = []
    with running_coordinator(settings):
        worker = consumer(settings, "Jobs", on_ack_error=errors.append)
        message = worker.receive(timeout=20)
        assert message is not None
        first_deadline = message.lease_expires_at
        time.sleep(0.5)
        renewed = message.renew()
        assert renewed > first_deadline
        # Past the renewed deadline: the lease is gone.
        time.sleep(max(0.0, renewed.timestamp() - time.time()) + 1.0)
        message.ack()
        redelivered = worker.receive(timeout=10)
        assert redelivered is not None and redelivered.delivery_count == 2
        # Replies are read while receiving: the refusal is reported by a receive() call.
        wait_until(lambda: worker.receive(timeout=0.2) or errors or None, timeout=10,
                   what="the refused ack reported")
        assert errors[0].status in (AckStatus.LEASE_LOST, AckStatus.WRONG_TOKEN)
        redelivered.ack()
        worker.close()


def test_renew_with_a_length_outlives_the_lease_period(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    """`msg.renew(extend=...)` (SQS ChangeMessageVisibility): the lease ends that long from
    now, past the queue's lease period; nobody else gets the message meanwhile; a length out
    of bounds is refused before it is sent."""
    work = create_topic(unique_name("Work"), partitions=1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": work, "lease_period": "10s"})
    with running_coordinator(settings):
        # The worker subscribes before anything is published, so its delivery topic exists
        # and both deliveries arrive well within the lease period even on a loaded machine
        # (a first delivery that waits on a new topic could outlive a short lease and be
        # delivered again under a new token before this test renews the old one).
        worker = consumer(settings, "Jobs", max_backlog=2)
        other: QueueConsumer | None = None
        try:
            with QueuePublisher(settings.bootstrap_servers,
                                topic_prefix=settings.topic_prefix) as publisher:
                publisher.publish(work, b"slow")
                publisher.publish(work, b"short")
            slow = worker.receive(timeout=20)
            short = worker.receive(timeout=20)
            assert slow is not None and short is not None
            assert (slow.value, short.value) == (b"slow", b"short")
            assert (slow.delivery_count, short.delivery_count) == (1, 1), \
                "premise: both first deliveries arrived within the lease period"
            other = consumer(settings, "Jobs", max_backlog=2)
            with pytest.raises(ValueError, match="12 hours"):
                slow.renew(extend=13 * 3600)
            first = slow.lease_expires_at
            deadline = slow.renew(extend=30)
            assert slow.lease_expires_at == deadline > first + timedelta(seconds=20)
            assert deadline > datetime.now(UTC) + timedelta(seconds=25)
            # Shorter than the lease period: ended within about half a second.
            short_deadline = short.renew(extend=timedelta(milliseconds=500))
            assert short_deadline < datetime.now(UTC) + timedelta(seconds=1)
            # Within the lease period the other consumer gets the short one, ended early.
            got = other.receive(timeout=5)
            assert got is not None and got.value == b"short" and got.delivery_count == 2
            got.ack()
            # Past the end of the first delivery's lease, the renewed one still holds.
            remaining = (first - datetime.now(UTC)).total_seconds()
            assert other.receive(timeout=max(remaining, 0) + 2) is None, \
                "the renewed lease was broken"
            slow.ack()
            wait_until(lambda: counters(settings, "Jobs").get("acked") == 2 or None,
                       timeout=20, what="both acked, the renewed one by its holder")
        finally:
            worker.close()
            if other is not None:
                other.close()


def publish_mail(settings: Settings, journal: str, *recipients: str) -> None:
    with QueuePublisher(settings.bootstrap_servers,
                        topic_prefix=settings.topic_prefix) as publisher:
        for to in recipients:
            publisher.publish(journal, json.dumps({"to": to}).encode())


def test_unknown_queue_and_replace_with_the_coordinator(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=1)
    put_queues(settings, {"name": "Mail", "underlying_topic": work})
    with running_coordinator(settings):
        with pytest.raises(UnknownQueueError) as caught:
            consumer(settings, "NoSuchQueue")
        assert caught.value.name == "NoSuchQueue"
        reader = consumer(settings, "Mail", filter="/to = 'me'", max_backlog=5)
        publish_mail(settings, work, "me", "you", "any")
        mine = reader.receive(timeout=20)
        assert mine is not None and mine.json() == {"to": "me"}
        assert reader.receive(timeout=1.0) is None
        reader.replace(filter="/to = 'any'")
        other = reader.receive(timeout=20)
        assert other is not None and other.json() == {"to": "any"}
        mine.ack()  # the lease from before the replace is still good
        other.ack()
        reader.close()
        wait_until(lambda: counters(settings, "Mail").get("acked") == 2 or None,
                   timeout=20, what="both acks applied")


def test_a_consumer_subscribing_the_instant_apply_returns_is_served(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    """What deployment scripts do: `qlayer queue apply` (its service, on the store), then a
    consumer at once. The coordinator's catalog is loaded every `refresh_interval` (the
    default here, not the tests' short one), so it does not know the queue yet when the
    Subscribe comes; the Subscribe waits for a catalog loaded after it (docs/coordinator.md,
    "The catalog") and is served, never answered UnknownQueueError. Twenty fresh queues, each
    subscribed to in the instant its apply returned."""
    work = create_topic(unique_name("Work"), partitions=1)
    publish_mail(settings, work, "anyone")
    refresh = CoordinatorOptions().refresh_interval
    with running_coordinator(settings, refresh_interval=refresh), \
            QueueService.from_settings(settings) as service:
        for i in range(20):
            name = f"Fresh{i}"
            applied = service.apply(f"queues:\n  - name: {name}\n    underlying_topic: {work}\n")
            assert [c.name for c in applied.plan.of("create")] == [name]
            reader = consumer(settings, name)  # subscribes: raises UnknownQueueError if refused
            try:
                got = reader.receive(timeout=30)
                assert got is not None and got.json() == {"to": "anyone"}, name
                got.ack()
            finally:
                reader.close()


def test_filtered_subscription_gets_entries_enqueued_before_it_subscribed(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    # The usual order in production: a backlog first, then a worker with a filter.
    work = create_topic(unique_name("Work"), partitions=1)
    put_queues(settings, {"name": "Mail", "underlying_topic": work})
    publish_mail(settings, work, "you", "me")
    with running_coordinator(settings):
        wait_until(lambda: counters(settings, "Mail").get("enqueued") == 2 or None,
                   timeout=20, what="both entries enqueued")
        reader = consumer(settings, "Mail", filter="/to = 'me'")
        mine = reader.receive(timeout=20)
        assert mine is not None and mine.json() == {"to": "me"}
        mine.ack()
        reader.close()
