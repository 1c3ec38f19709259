"""`--since` / `--until` against the real broker: only the range is read from Kafka (the
source's startingTimestamp), and events whose own time is outside it are not counted."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from layer.pipeline.jobs import EventSource, run_lifecycle, run_views
from layer.pipeline.synthetic import workload
from layer.pipeline.views import parse_view
from layer.protocol import Codec, EventType, TopicNames
from layer.protocol.bookmark import Bookmark
from layer.protocol.records import Event
from tests.support.coordinator import produce
from tests.support.kafka import create_topic

pytestmark = pytest.mark.integration

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
HOUR = 3_600_000


def old_events_topic(bootstrap: str, prefix: str) -> str:
    """An events topic that keeps records stamped in the past: the broker's time retention
    would otherwise delete them while the test reads."""
    topic = TopicNames(prefix).events
    create_topic(bootstrap, topic, 1, config={"retention.ms": "-1"})
    return topic


def write_at(bootstrap: str, topic: str, records: list[tuple[Event, int]]) -> None:
    """Each event as a single Event record whose Kafka timestamp is the one given."""
    codec = Codec()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for event, kafka_ms in records:
        producer.produce(topic, codec.encode_event(event), partition=0, timestamp=kafka_ms)
    assert producer.flush(30) == 0


def test_events_before_since_are_not_counted(
    spark: SparkSession, bootstrap_servers: str, unique_name: Callable[[str], str],
    tmp_path: Path,
) -> None:
    prefix = unique_name("qr") + "."
    topic = old_events_topic(bootstrap_servers, prefix)
    journal = unique_name("orders")
    trail = list(workload("Orders", journal, 1, 20, T0, spacing_ms=1000))
    # Entries 0-9 happen at T0, entries 10-19 an hour later; --since is half-way.
    old = [e for e in trail if e.bookmark is not None and e.bookmark.offset < 10]
    new = [replace(e, timestamp_ms=e.timestamp_ms + HOUR) for e in trail
           if e.bookmark is not None and e.bookmark.offset >= 10]
    since = T0 + HOUR // 2

    def ack(offset: int, at: int) -> Event:
        return Event(type=EventType.ACKED, timestamp_ms=at, coordinator_id="c",
                     coordinator_epoch=1, queue="Orders", bookmark=Bookmark(journal, 0, offset),
                     consumer_id="c1", delivery_count=2)

    # An ack of pending entry 19 in a record stamped before --since (placed before the new
    # entries' records): counted only if the job read the topic from its start and filtered.
    early_record = ack(19, T0 + HOUR + 19_500)
    # An ack of old pending entry 9 in a record published after --since (an outbox drained
    # late): read from Kafka, but its event time is before --since.
    late_record = ack(9, T0 + 9_500)
    write_at(bootstrap_servers, topic,
             [(e, e.timestamp_ms) for e in old] + [(early_record, since - 60_000)]
             + [(e, e.timestamp_ms) for e in new] + [(late_record, T0 + HOUR + 60_000)])

    source = EventSource(bootstrap_servers, prefix)
    everything = run_lifecycle(spark, source, queue="Orders")
    assert everything.count() == 20
    table = run_lifecycle(spark, source, queue="Orders", start_ms=since,
                          output=str(tmp_path / "life"))
    rows = {r["offset"]: r for r in table.collect()}
    assert sorted(rows) == list(range(10, 20))
    outcomes = {o: sum(1 for r in rows.values() if r["outcome"] == o)
                for o in ("acked", "dead_lettered", "pending")}
    assert outcomes == {"acked": 8, "dead_lettered": 1, "pending": 1}
    assert rows[19]["outcome"] == "pending"
    # --until closes the range: entries 10-14's events only (each within 31 s of its ENQUEUED).
    until = T0 + HOUR + 15_000
    window = run_lifecycle(spark, source, queue="Orders", start_ms=since, end_ms=until)
    assert sorted(r["offset"] for r in window.collect()) == list(range(10, 15))


def test_a_view_since_a_time_counts_only_the_entries_enqueued_since(
    spark: SparkSession, bootstrap_servers: str, unique_name: Callable[[str], str],
) -> None:
    prefix = unique_name("qw") + "."
    topic = old_events_topic(bootstrap_servers, prefix)
    journal = unique_name("orders")
    create_topic(bootstrap_servers, journal, 1)
    produce(bootstrap_servers, journal,
            [json.dumps({"region": "east", "qty": q}).encode() for q in (1, 2, 4, 8)],
            partition=0)

    def enqueued(offset: int, at: int) -> tuple[Event, int]:
        return (Event(type=EventType.ENQUEUED, timestamp_ms=at, coordinator_id="c",
                      coordinator_epoch=1, queue="Orders",
                      bookmark=Bookmark(journal, 0, offset), record_timestamp_ms=T0), at)

    write_at(bootstrap_servers, topic, [enqueued(0, T0), enqueued(1, T0 + 1),
                                        enqueued(2, T0 + HOUR), enqueued(3, T0 + HOUR + 1)])
    source = EventSource(bootstrap_servers, prefix)
    definition = parse_view(["/region", "SUM(/qty) AS /qty", "COUNT(*) AS /n"], ["/region"], None)
    whole = run_views(spark, source, "Orders", journal, definition, as_of_ms=T0 + 2 * HOUR)
    assert [(r["qty"], r["n"]) for r in whole.collect()] == [(15, 4)]
    since = run_views(spark, source, "Orders", journal, definition, as_of_ms=T0 + 2 * HOUR,
                      start_ms=T0 + HOUR // 2)
    assert [(r["qty"], r["n"]) for r in since.collect()] == [(12, 2)]
    # As of before the later entries were enqueued, the view has none of them.
    before = run_views(spark, source, "Orders", journal, definition,
                       as_of_ms=T0 + HOUR // 2, start_ms=T0 - HOUR)
    assert [(r["qty"], r["n"]) for r in before.collect()] == [(3, 2)]
