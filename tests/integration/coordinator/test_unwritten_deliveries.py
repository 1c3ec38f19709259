"""Leases committed to PostgreSQL whose deliveries never reached Kafka.

The coordinator commits leases before it writes their deliveries (the safety order), so a
crash or a failed Kafka write in between leaves leases nobody received. The restart sends
the deliveries of every restored lease again, unchanged, instead of leaving the consumer's
backlog blocked for a whole lease period; the SDK drops the repeats of leases it has.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from confluent_kafka import Producer

from layer.coordinator.process import CoordinatorProcess
from layer.coordinator.shard import ShardLoop
from layer.kafka import OutgoingRecord
from layer.kafka.errors import DeliveryFailed
from layer.protocol import Event, EventType
from layer.protocol.batch import BATCH, decode_delivery_batch
from layer.protocol.headers import LEASE
from layer.sdk import QueueConsumer
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import (
    EventReader,
    RawConsumer,
    put_queues,
    running_coordinator,
)

pytestmark = pytest.mark.integration

#: Far beyond the tests' timeouts: a delivery that waited for its lease to expire fails them.
LEASE_PERIOD = "300s"


class LosesADeliveryWrite(ShardLoop):
    """A real coordinator whose first Kafka write carrying deliveries once it is ``armed``
    fails, after the PostgreSQL commit of their leases (as when the broker refuses the write,
    or the process dies there). Nothing of that write reaches Kafka; the loop's crash-only
    recovery then rebuilds from PostgreSQL, as a restarted process would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = True
        self.failed = False
        self.lost_deliveries = 0

    def _start(self, now: float) -> None:
        super()._start(now)
        writer = self._writer
        assert writer is not None
        real_send = writer.send

        def send(records: Iterable[OutgoingRecord]) -> int:
            records = list(records)
            # Record-form deliveries carry a lease header; a delivery batch many leases.
            deliveries = sum(1 for r in records
                             if r.headers and any(k == LEASE and v for k, v in r.headers))
            deliveries += sum(len(decode_delivery_batch(r.value or b"")) for r in records
                              if r.headers and r.headers[0][0] == BATCH)
            if self.armed and not self.failed and deliveries:
                self.failed = True
                self.lost_deliveries = deliveries
                raise DeliveryFailed(f"injected: {len(records)} records not written")
            return real_send(records)

        writer.send = send  # type: ignore[method-assign]


def produce(settings: Settings, topic: str, values: Iterable[bytes]) -> None:
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    for value in values:
        producer.produce(topic, value)
    assert producer.flush(30) == 0


def wait_for_recovery_point(settings: Settings, queue: str, total: int) -> None:
    deadline = time.monotonic() + 30
    with Store(settings.database_url) as store:
        while sum(store.load_recovery_points(queue).values()) < total:
            assert time.monotonic() < deadline, "the acks were not all applied"
            time.sleep(0.1)


def _loop_of(process: CoordinatorProcess, queue: str) -> LosesADeliveryWrite:
    """The shard loop serving ``queue`` (the others never see its deliveries)."""
    loop = process.loop_for(queue)
    assert isinstance(loop, LosesADeliveryWrite), f"no loop serves {queue}"
    return loop


def test_deliveries_lost_after_the_commit_are_sent_again_with_the_same_lease(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": topic,
                          "lease_period": LEASE_PERIOD})
    events = EventReader(settings)
    with running_coordinator(settings, loop_class=LosesADeliveryWrite) as process:
        coordinator = _loop_of(process, "WorkToDo")
        consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "WorkToDo",
                               max_backlog=5)
        try:
            consumer.subscribe()
            produce(settings, topic, [f"m{i}".encode() for i in range(5)])
            started = time.monotonic()
            got = consumer.receive(5, timeout=30)
            waited = time.monotonic() - started
            assert coordinator.failed and coordinator.counters["iteration_failures"] >= 1
            # The same leases, not redeliveries after an expiry: first deliveries, well within
            # the lease period, and the tokens the coordinator committed settle them.
            assert sorted(d.value for d in got) == [f"m{i}".encode() for i in range(5)]
            assert [d.delivery_count for d in got] == [1] * 5
            assert waited < 30
            # (The five may be leased over several iterations: only the failed write's are
            # sent again.)
            assert coordinator.counters["deliveries_resent"] >= coordinator.lost_deliveries >= 1
            consumer.ack(got)
            wait_for_recovery_point(settings, "WorkToDo", 5)
            assert consumer.ack_results() == []  # no refusal: the tokens were the committed ones

            # The failed write's events (the LEASED of its leases, at least) stayed in the
            # outbox through the rebuild and were published by the shard's next take: each
            # entry's trail is whole, with exactly one ENQUEUED, one LEASED and one ACKED.
            def acked(es: list[Event]) -> bool:
                return sum(e.type is EventType.ACKED and e.queue == "WorkToDo" for e in es) >= 5

            trails: dict[str, list[EventType]] = defaultdict(list)
            for e in events.read_until(acked, timeout=30):
                if e.queue == "WorkToDo" and e.bookmark is not None:
                    trails[str(e.bookmark)].append(e.type)
            assert len(trails) == 5
            for bookmark, kinds in trails.items():
                assert kinds[0] is EventType.ENQUEUED and kinds[-1] is EventType.ACKED, (
                    bookmark, kinds)
                assert kinds == [EventType.ENQUEUED, EventType.LEASED, EventType.ACKED], (
                    bookmark, kinds)
            assert coordinator.counters["outbox_republished"] >= 1
        finally:
            consumer.close()
            events.close()


def test_the_sdk_drops_the_repeats_of_leases_it_holds(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": topic,
                          "lease_period": LEASE_PERIOD})
    total = 20
    with running_coordinator(settings, loop_class=LosesADeliveryWrite) as process:
        coordinator = _loop_of(process, "WorkToDo")
        coordinator.armed = False
        with QueueConsumer("WorkToDo", settings.bootstrap_servers,
                           topic_prefix=settings.topic_prefix, max_backlog=10) as consumer:
            produce(settings, topic, [f"m{i}".encode() for i in range(total)])
            first: list[Any] = []
            while len(first) < 10:
                message = consumer.receive(timeout=20)
                assert message is not None, f"received {len(first)} of the first 10"
                first.append(message)
            # Half are settled; the other half stay held while the coordinator fails the
            # write of the next leases and rebuilds: the five held leases come again.
            coordinator.armed = True
            for message in first[:5]:
                message.ack()
            received = [m.value for m in first]
            deadline = time.monotonic() + 60
            while len(received) < total and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)
                if message is None:
                    continue
                received.append(message.value)
                message.ack()
            for message in first[5:]:
                message.ack()
            assert coordinator.failed
            assert coordinator.lost_deliveries >= 1
            assert coordinator.counters["deliveries_resent"] >= 5 + coordinator.lost_deliveries
            # Each message reached the application once: the repeats of the leases it held
            # were dropped, counted, and the unwritten ones came without a lease expiry.
            assert sorted(received) == sorted(f"m{i}".encode() for i in range(total))
            assert consumer.stats.repeated >= 5
        wait_for_recovery_point(settings, "WorkToDo", total)
