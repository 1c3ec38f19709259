"""A restart re-reads the journal from the recovery points; what it re-admits is not counted
as enqueued again (the counters `qlayer stats` shows stay true across restarts)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from layer.settings import Settings
from layer.store.rows import PartitionKey
from layer.store.store import Store
from tests.support.coordinator import (
    RawConsumer,
    counters,
    produce,
    put_queues,
    running_coordinator,
    wait_until,
)

pytestmark = pytest.mark.integration


def test_enqueued_counts_each_message_once_across_restarts(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("Work", partitions=2)
    put_queues(settings, {"name": "Work", "underlying_topic": topic, "lease_period": "60s"})
    for partition in (0, 1):
        produce(settings.bootstrap_servers, topic,
                [f"job-{partition}-{i}".encode() for i in range(15)], partition=partition)
    with running_coordinator(settings):
        wait_until(lambda: counters(settings, "Work").get("enqueued") == 30,
                   what="30 entries enqueued")
        # Ten acked: the recovery points move, but not past the 20 still queued.
        consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Work",
                               max_backlog=10)
        try:
            consumer.subscribe()
            got = wait_until(lambda: consumer.poll(0.2) or None, what="deliveries")
            consumer.ack(got)
            wait_until(lambda: counters(settings, "Work").get("acked") == len(got),
                       what="the acks applied")
        finally:
            consumer.close()
    with Store(settings.database_url) as store:
        admitted = store.load_admitted("Work")
    assert set(admitted) == {PartitionKey("Work", topic, 0), PartitionKey("Work", topic, 1)}
    assert list(admitted.values()) == [15, 15]  # every offset of both partitions admitted

    for restart in range(2):
        with running_coordinator(settings) as coordinator:
            # The replay re-admits the 20 unfinished entries; then 5 new records come.
            wait_until(lambda: coordinator.counters["journal_records"] >= 30 - len(got),
                       what="the journal re-read")
            produce(settings.bootstrap_servers, topic,
                    [f"more-{restart}-{i}".encode() for i in range(5)])
            expected = 35 + 5 * restart
            wait_until(lambda: counters(settings, "Work").get("enqueued") == expected,  # noqa: B023
                       what="the new records counted")
        assert counters(settings, "Work")["enqueued"] == expected
