"""Crash safety: the coordinator SIGKILLed again and again, and a hot standby taking over.

The coordinators here are real `qlayer coordinator run` processes; consumers are built from
the wire protocol only (tests/support/coordinator.py) and keep working throughout.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from layer.protocol import EventType
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import RawConsumer, put_queues
from tests.support.processes import (
    CoordinatorSubprocess,
    audit,
    produce_numbers,
    read_events,
)

pytestmark = pytest.mark.integration


@contextmanager
def coordinators() -> Iterator[list[CoordinatorSubprocess]]:
    procs: list[CoordinatorSubprocess] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def all_acked(settings: Settings, queue: str, total: int) -> bool:
    with Store(settings.database_url) as store:
        return sum(store.load_recovery_points(queue).values()) == total


def work(consumer: RawConsumer, stop: threading.Event, received: Counter[bytes],
         lock: threading.Lock) -> None:
    consumer.subscribe(timeout=60)
    while not stop.is_set():
        batch = consumer.poll(0.1)
        if batch:
            consumer.ack(batch)
            with lock:
                received.update(d.value for d in batch if d.value is not None)


def test_coordinator_sigkilled_repeatedly_loses_nothing(
    settings: Settings, journal: Callable[..., str], tmp_path: Path
) -> None:
    total = 20_000
    topic = journal("Work")
    put_queues(settings, {"name": "WorkToDo", "underlying_topic": topic, "lease_period": "5s"})
    produce_numbers(settings.bootstrap_servers, topic, total)
    received: Counter[bytes] = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    with coordinators() as procs:
        procs.append(CoordinatorSubprocess(settings, tmp_path, "c0"))
        consumers = [RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "WorkToDo",
                                 max_backlog=200) for _ in range(3)]
        threads = [threading.Thread(target=work, args=(c, stop, received, lock), daemon=True)
                   for c in consumers]
        for t in threads:
            t.start()
        kills = 0
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and not all_acked(settings, "WorkToDo", total):
            time.sleep(2.5)
            if kills < 4:
                with lock:
                    progress = sum(received.values())
                if progress > 0:  # kill mid-run, once work is flowing
                    procs[-1].kill()
                    kills += 1
                    procs.append(CoordinatorSubprocess(settings, tmp_path, f"c{kills}"))
        stop.set()
        for t in threads:
            t.join(10)
        for c in consumers:
            c.close()
        assert kills == 4, "the run ended before the coordinator could be killed four times"
        assert all_acked(settings, "WorkToDo", total), (
            "not every message was acked; logs in " + str(tmp_path))
    # Nothing missing: every journal message reached a consumer.
    assert {int(v) for v in received} == set(range(total))
    events = read_events(settings, {"WorkToDo"})
    acked, late = audit(events)
    # Every state change has exactly one event across the SIGKILLs (the outbox): each message
    # was announced once and acked once, and none delivered after its ack was recorded.
    assert len(acked) == total and max(acked.values()) == 1
    enqueued = Counter(e.bookmark for e in events if e.type is EventType.ENQUEUED)
    assert len(enqueued) == total and max(enqueued.values()) == 1
    assert late == []


def test_hot_standby_takes_over_while_consumers_keep_working(
    settings: Settings, journal: Callable[..., str], tmp_path: Path
) -> None:
    total = 3_000
    topic = journal("Standby")
    put_queues(settings, {"name": "Jobs", "underlying_topic": topic, "lease_period": "5s"})
    received: Counter[bytes] = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    with coordinators() as procs:
        procs.append(CoordinatorSubprocess(settings, tmp_path, "primary"))
        deadline = time.monotonic() + 60
        with Store(settings.database_url) as store:
            record = store.get_queue("Jobs")
            assert record is not None
            shard = str(record.shard)
            while time.monotonic() < deadline:
                owner = store.owner(shard)
                if owner is not None and owner.owner_id == "primary":
                    break
                time.sleep(0.2)
            procs.append(CoordinatorSubprocess(settings, tmp_path, "standby"))
            consumers = [RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Jobs",
                                     max_backlog=50) for _ in range(3)]
            threads = [threading.Thread(target=work, args=(c, stop, received, lock), daemon=True)
                       for c in consumers]
            for t in threads:
                t.start()
            produce_numbers(settings.bootstrap_servers, topic, total // 2)
            while time.monotonic() < deadline:
                with lock:
                    if sum(received.values()) >= total // 4:
                        break
                time.sleep(0.1)
            procs[0].kill()
            killed_at = time.monotonic()
            while time.monotonic() < killed_at + 30:
                owner = store.owner(shard)
                if owner is not None and owner.owner_id == "standby":
                    break
                time.sleep(0.1)
            takeover = time.monotonic() - killed_at
            assert owner is not None and owner.owner_id == "standby"
            produce_numbers(settings.bootstrap_servers, topic, total // 2, start=total // 2)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all_acked(settings, "Jobs", total):
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(10)
        for c in consumers:
            c.close()
    # The group's session timeout is 6 s: Kafka gives the standby the shard once it passed,
    # and the standby takes it at once.
    assert takeover < 15, f"standby took {takeover:.1f}s to take over"
    assert all_acked(settings, "Jobs", total)
    # Everything published before and after the takeover reached a consumer.
    assert {int(v) for v in received} == set(range(total))


def test_a_coordinator_restarted_under_its_instance_id_takes_its_shards_back_at_once(
    settings: Settings, journal: Callable[..., str], tmp_path: Path
) -> None:
    """`--instance-id` (Kafka static membership): the process that replaces a SIGKILLed one
    under the same name is given its shards without waiting for the group's session timeout
    (45 s here), and serves the queue."""
    topic = journal("Static")
    put_queues(settings, {"name": "StaticJobs", "underlying_topic": topic})
    static = ("--instance-id", "coordinator-a", "--group-session-timeout", "45")

    def owner_becomes(name: str, within: float) -> float:
        started = time.monotonic()
        with Store(settings.database_url) as store:
            record = store.get_queue("StaticJobs")
            assert record is not None
            while time.monotonic() - started < within:
                owner = store.owner(str(record.shard))
                if owner is not None and owner.owner_id == name:
                    return time.monotonic() - started
                time.sleep(0.1)
        raise AssertionError(f"{name} does not own the queue's shard after {within}s; "
                             f"logs in {tmp_path}")

    with coordinators() as procs:
        procs.append(CoordinatorSubprocess(settings, tmp_path, "first", *static))
        owner_becomes("first", 60)
        procs[-1].kill()
        procs.append(CoordinatorSubprocess(settings, tmp_path, "second", *static))
        # A dynamic member would get the shards only once Kafka gave up on "first" (45 s).
        took = owner_becomes("second", 25)
        assert took < 25
        consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "StaticJobs",
                               max_backlog=10)
        try:
            consumer.subscribe(timeout=30)
            produce_numbers(settings.bootstrap_servers, topic, 5)
            got: set[bytes] = set()
            deadline = time.monotonic() + 30
            while len(got) < 5 and time.monotonic() < deadline:
                batch = consumer.poll(0.2)
                consumer.ack(batch)
                got.update(d.value for d in batch if d.value is not None)
            assert got == {str(i).encode() for i in range(5)}
        finally:
            consumer.close()
