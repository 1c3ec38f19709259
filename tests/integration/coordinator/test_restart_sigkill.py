"""Crash safety: the coordinator SIGKILLed again and again, and a hot standby taking over.

The coordinators here are real `qlayer coordinator run` processes; consumers are built from
the wire protocol only (tests/support/coordinator.py) and keep working throughout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from layer.protocol import Codec, EventType, TopicNames
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import RawConsumer, put_queues

pytestmark = pytest.mark.integration


class CoordinatorProcess:
    """One `qlayer coordinator run` subprocess, logging to a file."""

    def __init__(self, settings: Settings, log_dir: Path, name: str, *extra: str) -> None:
        env = {**os.environ, "QLAYER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
               "QLAYER_DATABASE_URL": settings.database_url,
               "QLAYER_TOPIC_PREFIX": settings.topic_prefix}
        self.log = log_dir / f"{name}.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "coordinator", "run", "--owner-id", name,
                 "--group-session-timeout", "6", "--session-timeout", "10", *extra],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def coordinators() -> Iterator[list[CoordinatorProcess]]:
    procs: list[CoordinatorProcess] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def produce_numbers(bootstrap: str, topic: str, n: int, start: int = 0) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 10})
    for i in range(start, start + n):
        producer.produce(topic, str(i).encode(), key=str(i % 97).encode())
        if i % 5000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def all_acked(settings: Settings, queue: str, total: int) -> bool:
    with Store(settings.database_url) as store:
        return sum(store.load_recovery_points(queue).values()) == total


def read_events(settings: Settings, queue: str) -> list[object]:
    """Every event the coordinators published for the queue, in topic order per partition."""
    topics = TopicNames(settings.topic_prefix)
    codec = Codec()
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers,
                         "group.id": f"audit-{time.time_ns()}", "enable.auto.commit": False,
                         "isolation.level": "read_committed"})
    md = consumer.list_topics(topics.events, timeout=10)
    parts = list(md.topics[topics.events].partitions)
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topics.events, p))[1] for p in parts}
    consumer.assign([TopicPartition(topics.events, p, 0) for p in parts])
    events = []
    done = {p for p, end in ends.items() if end == 0}
    deadline = time.monotonic() + 60
    while len(done) < len(parts) and time.monotonic() < deadline:
        for m in consumer.consume(10_000, 0.5):
            if m.error() is not None:
                continue
            event = codec.decode_event(m.value())
            if event.queue == queue:
                events.append(event)
            if m.offset() >= ends[m.partition()] - 1:
                done.add(m.partition())
    consumer.close()
    return events


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
        procs.append(CoordinatorProcess(settings, tmp_path, "c0"))
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
                    procs.append(CoordinatorProcess(settings, tmp_path, f"c{kills}"))
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
    events = read_events(settings, "WorkToDo")
    acked: Counter[str] = Counter()
    acked_at: dict[str, int] = {}
    leased_at: defaultdict[str, list[int]] = defaultdict(list)
    for e in events:
        if e.bookmark is None:  # type: ignore[attr-defined]
            continue  # consumer events
        key = e.bookmark.format()  # type: ignore[attr-defined]
        if e.type is EventType.ACKED:  # type: ignore[attr-defined]
            acked[key] += 1
            acked_at[key] = e.timestamp_ms  # type: ignore[attr-defined]
        elif e.type is EventType.LEASED:  # type: ignore[attr-defined]
            leased_at[key].append(e.timestamp_ms)  # type: ignore[attr-defined]
    # None acked twice, and none delivered after its ack was recorded.
    assert acked and max(acked.values()) == 1
    late = [k for k, t in acked_at.items() if any(lt > t for lt in leased_at[k])]
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
        procs.append(CoordinatorProcess(settings, tmp_path, "primary"))
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
            procs.append(CoordinatorProcess(settings, tmp_path, "standby"))
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
