"""Defects the fault-injection soak (tests/soak/run.py) found, each pinned by a test."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from layer.settings import Settings
from tests.support.coordinator import RawConsumer, put_queues, running_coordinator

pytestmark = pytest.mark.integration


def test_leases_held_across_a_handover_come_back_when_an_at_most_once_queue_shares_the_journal(
    settings: Settings, journal: Callable[..., str],
) -> None:
    topic = journal("Shared", partitions=1)
    put_queues(settings,
               {"name": "Alo", "underlying_topic": topic, "lease_period": "2s", "shard": 0},
               {"name": "Amo", "underlying_topic": topic, "semantics": "at-most-once",
                "lease_period": "2s", "shard": 0})
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    for i in range(10):
        producer.produce(topic, str(i).encode())
    assert producer.flush(30) == 0
    with running_coordinator(settings):
        holder = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Alo",
                             max_backlog=10)
        other = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Amo",
                            max_backlog=10)
        try:
            holder.subscribe()
            other.subscribe()
            held: list[object] = []
            deadline = time.monotonic() + 30
            while len(held) < 10 and time.monotonic() < deadline:
                held += holder.poll(0.2)
                other.poll(0.1)
            assert len(held) >= 10  # leased, never acked
            time.sleep(1.0)  # at-most-once entries done, recovery point moved there
        finally:
            holder.close()
            other.close()
    time.sleep(3.0)  # the leases' deadline passes while nobody owns the shard
    with running_coordinator(settings):
        taker = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Alo",
                            max_backlog=10)
        try:
            taker.subscribe()
            got: list[bytes | None] = []
            deadline = time.monotonic() + 30
            while len(got) < 10 and time.monotonic() < deadline:
                batch = taker.poll(0.2)
                taker.ack(batch)
                got += [d.value for d in batch]
            assert sorted(got) == sorted(str(i).encode() for i in range(10))
        finally:
            taker.close()
