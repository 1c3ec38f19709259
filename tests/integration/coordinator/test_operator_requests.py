"""Operator requests recorded in PostgreSQL and carried out by the coordinator: evict, purge."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from layer import QueueConsumer
from layer.protocol import SessionEndReason
from layer.sdk import SessionEndedError
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import (
    RawConsumer,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration


def test_evicted_consumer_loses_its_leases_at_once_and_is_told(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s"})
    produce(settings.bootstrap_servers, work, [f"job {i}".encode() for i in range(6)])
    with running_coordinator(settings) as coordinator:
        victim = QueueConsumer("Work", settings.bootstrap_servers,
                               topic_prefix=settings.topic_prefix, max_backlog=6)
        held = []
        deadline = time.monotonic() + 20
        while len(held) < 6 and time.monotonic() < deadline:
            msg = victim.receive(timeout=0.5)
            if msg is not None:
                held.append(str(msg.bookmark))
        assert len(held) == 6
        with Store(settings.database_url) as store:
            store.request_eviction(victim.consumer_id, time.time())
        other = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Work",
                            max_backlog=6)
        try:
            other.subscribe()
            # Long before the 60 s leases end, the evicted consumer's entries move over.
            got = other.receive(6, timeout=20)
            assert sorted(d.bookmark for d in got) == sorted(held)
            other.ack(got)
        finally:
            other.close()
        with pytest.raises(SessionEndedError) as ended:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                victim.receive(timeout=0.5)
        assert ended.value.reason is SessionEndReason.EVICTED
        victim.close()
        assert coordinator.counters["evictions"] == 1
    with Store(settings.database_url) as store:
        assert victim.consumer_id not in {c.consumer_id for c in store.load_consumers()}


def test_evicting_an_unknown_consumer_is_a_clear_error(settings: Settings) -> None:
    from layer.domain.errors import UnknownConsumerError

    with Store(settings.database_url) as store, pytest.raises(UnknownConsumerError):
        store.request_eviction("nobody", time.time())


def test_purge_acknowledges_every_entry_and_the_queue_goes_on(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s"})
    produce(settings.bootstrap_servers, work, [f"old {i}".encode() for i in range(20)],
            partition=0)
    with running_coordinator(settings) as coordinator:
        holder = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Work",
                             max_backlog=2)
        try:
            holder.subscribe()
            assert len(holder.receive(2)) == 2  # two leased, eighteen available
            with Store(settings.database_url) as store:
                store.request_purge("Work", time.time())
            wait_until(lambda: recovery_points(settings, "Work") == {(work, 0): 20} or None,
                       what="every entry purged")
            assert coordinator.counters["purged"] == 20
            wait_for_counters(settings, "Work", acked=20)
            with Store(settings.database_url) as store:
                record = store.get_queue("Work")
                assert record is not None and not record.purge_pending
            # New messages after the purge are delivered as usual.
            produce(settings.bootstrap_servers, work, [b"new"], partition=0)
            (fresh,) = holder.receive(1)
            assert fresh.value == b"new"
        finally:
            holder.close()
