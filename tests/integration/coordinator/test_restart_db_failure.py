"""The coordinator survives its PostgreSQL connections being killed mid-run."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import psycopg
import pytest
from confluent_kafka import Producer
from sqlalchemy.engine import make_url

from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import RawConsumer, put_queues, running_coordinator

pytestmark = pytest.mark.integration


def kill_connections(database_url: str) -> int:
    """pg_terminate_backend every other session on the test's database."""
    u = make_url(database_url)
    with psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password,
                         dbname="postgres", autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()", (u.database,)).fetchall()
    return len(rows)


def test_killed_database_connections_lose_nothing(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": topic, "lease_period": "3s"})
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    total = 400
    for i in range(total):
        producer.produce(topic, str(i).encode())
    assert producer.flush(30) == 0
    received: Counter[int] = Counter()
    with running_coordinator(settings) as coordinator:
        consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "WorkToDo",
                               max_backlog=10)
        try:
            consumer.subscribe()
            killed = False
            deadline = time.monotonic() + 90
            while len(received) < total and time.monotonic() < deadline:
                batch = consumer.poll(0.2)
                received.update(int(d.value or b"-1") for d in batch)
                consumer.ack(batch)
                if not killed and len(received) > total // 4:
                    assert kill_connections(settings.database_url) > 0
                    killed = True
            # The coordinator noticed, rebuilt from stored state and went on.
            deadline = time.monotonic() + 60
            with Store(settings.database_url) as store:
                while time.monotonic() < deadline:
                    if sum(store.load_recovery_points("WorkToDo").values()) == total:
                        break
                    batch = consumer.poll(0.2)
                    received.update(int(d.value or b"-1") for d in batch)
                    consumer.ack(batch)
                assert sum(store.load_recovery_points("WorkToDo").values()) == total
        finally:
            consumer.close()
        # Whichever of its PostgreSQL users met a killed connection first noticed it: a shard
        # (rebuilt from stored state), or the process's catalog load or registry report.
        noticed = coordinator.counters
        assert sum(noticed[k] for k in ("shard_failures", "round_failures",
                                        "report_failures")) >= 1, noticed
    assert set(received) == set(range(total))
