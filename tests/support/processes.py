"""Test support: real `qlayer coordinator run` processes and consumer processes, and what
they left in Kafka (the events topic) to check afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from layer.kafka.logs import logged
from layer.protocol import Codec, Event, EventType, SchemaKind, TopicNames
from layer.settings import Settings


def _env(settings: Settings) -> dict[str, str]:
    return {**os.environ, "QLAYER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "QLAYER_DATABASE_URL": settings.database_url,
            "QLAYER_TOPIC_PREFIX": settings.topic_prefix}


class Subprocess:
    """A child process logging to a file, stopped by SIGTERM (SIGKILL if it hangs)."""

    def __init__(self, args: list[str], settings: Settings, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                         env=_env(settings), start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


class CoordinatorSubprocess(Subprocess):
    """One `qlayer coordinator run` process."""

    def __init__(self, settings: Settings, log_dir: Path, name: str, *extra: str) -> None:
        self.name = name
        super().__init__([sys.executable, "-m", "layer_cli.main", "coordinator", "run",
                          "--owner-id", name, "--group-session-timeout", "6",
                          "--session-timeout", "20", *extra],
                         settings, log_dir / f"{name}.log")


class ConsumerWorker(Subprocess):
    """One consumer process (tests/support/consumer_worker.py) over some queues."""

    def __init__(self, settings: Settings, log_dir: Path, name: str, queues: list[str]) -> None:
        self.out = log_dir / f"{name}.received"
        self.out.touch()
        super().__init__([sys.executable, "-m", "tests.support.consumer_worker",
                          str(self.out), *queues], settings, log_dir / f"{name}.log")

    def received(self) -> list[tuple[str, str]]:
        lines = self.out.read_text(encoding="utf-8").splitlines()
        return [(q, v) for q, _, v in (line.partition("\t") for line in lines) if v]


def produce_numbers(bootstrap: str, topic: str, n: int, start: int = 0) -> None:
    producer = Producer(logged({"bootstrap.servers": bootstrap, "linger.ms": 10}))
    for i in range(start, start + n):
        producer.produce(topic, str(i).encode(), key=str(i % 97).encode())
        if i % 5000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def read_events(settings: Settings, queues: set[str] | None = None) -> list[Event]:
    """Every committed event of these queues (all with None), in order per partition; an
    event batch published twice (docs/protocol.md §4.4b) counts once, as readers must."""
    topics = TopicNames(settings.topic_prefix)
    codec = Codec()
    batch_fingerprint = codec.schema(SchemaKind.EVENT_BATCH).fingerprint
    consumer = Consumer(logged({"bootstrap.servers": settings.bootstrap_servers,
                                "group.id": f"audit-{time.time_ns()}",
                                "enable.auto.commit": False,
                                "isolation.level": "read_committed"}))
    md = consumer.list_topics(topics.events, timeout=10)
    parts = list(md.topics[topics.events].partitions)
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topics.events, p))[1] for p in parts}
    consumer.assign([TopicPartition(topics.events, p, 0) for p in parts])
    events: list[Event] = []
    batches: set[int] = set()
    done = {p for p, end in ends.items() if end == 0}
    deadline = time.monotonic() + 60
    while len(done) < len(parts) and time.monotonic() < deadline:
        for m in consumer.consume(10_000, 0.5):
            if m.error() is not None:
                continue
            value = m.value()
            if value is not None and value[2:10] == batch_fingerprint:
                batch = codec.decode_event_batch(value)
                if batch.batch_id in batches:
                    continue
                batches.add(batch.batch_id)
                found: Iterable[Event] = batch.events
            else:
                found = [codec.decode_event(value)]
            events.extend(e for e in found if queues is None or e.queue in queues)
            if m.offset() >= ends[m.partition()] - 1:
                done.add(m.partition())
        # A transactional coordinator's last offset is its commit marker, which no consumer
        # is given: only the position says the end is reached (waiting for a record there
        # cost each transactional test the whole deadline, 60 s).
        waiting = [TopicPartition(topics.events, p) for p in parts if p not in done]
        if waiting:
            done.update(tp.partition for tp in consumer.position(waiting)
                        if tp.offset >= ends[tp.partition])
    consumer.close()
    if len(done) < len(parts):
        raise TimeoutError(f"{topics.events}: partitions {sorted(set(parts) - done)} not read "
                           f"to their end ({ends}) within 60 s")
    return events


def audit(events: list[Event]) -> tuple[Counter[tuple[str, str]], list[tuple[str, str]]]:
    """(ACKED count per (queue, bookmark), entries leased again after their ACKED)."""
    acked: Counter[tuple[str, str]] = Counter()
    acked_at: dict[tuple[str, str], int] = {}
    leased_at: defaultdict[tuple[str, str], list[int]] = defaultdict(list)
    for e in events:
        if e.bookmark is None or e.queue is None:
            continue
        key = (e.queue, e.bookmark.format())
        if e.type is EventType.ACKED:
            acked[key] += 1
            acked_at[key] = e.timestamp_ms
        elif e.type is EventType.LEASED:
            leased_at[key].append(e.timestamp_ms)
    late = [k for k, t in acked_at.items() if any(lt > t for lt in leased_at[k])]
    return acked, late
