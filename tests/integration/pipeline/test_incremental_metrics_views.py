"""The metrics and views streams are incremental: each micro-batch reads only its new event
records, updates the state of its entries only, reads back only the windows or groups those
entries change, and the table equals the batch job's, while the history grows (rows counted
from Spark's StreamingQueryProgress and from what each micro-batch read, not time)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy
from pyspark.sql import DataFrame, SparkSession

from layer.pipeline import transforms
from layer.pipeline.changes import window_ms, with_bucket
from layer.pipeline.checkpoint import PartStore
from layer.pipeline.io import SOURCE_READS, latest_rows, read_events, read_journal
from layer.pipeline.jobs import (
    EventSource,
    MetricsJob,
    PipelineUsageError,
    StreamOptions,
    StreamSummary,
    ViewsJob,
    run_job,
)
from layer.pipeline.synthetic import workload
from layer.pipeline.views import parse_view
from layer.protocol import Codec, EventType, TopicNames
from layer.protocol.bookmark import Bookmark
from layer.protocol.records import Event
from tests.support.coordinator import produce

pytestmark = pytest.mark.integration

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
HOUR = 3_600_000
ROUND = 20  # entries per round
WINDOW = "10 seconds"
KEYS = ["queue", "window_start"]


def same(a: DataFrame, b: DataFrame) -> bool:
    b = b.select(*a.columns)
    return a.exceptAll(b).count() == 0 and b.exceptAll(a).count() == 0


def state_rows_per_entry(summary: StreamSummary, entries: int) -> int:
    """Spark's applyInPandasWithState store holds a fixed number of rows per entry (two in
    Spark 4.2): a first micro-batch of ``entries`` new entries tells how many."""
    total = summary.progress[0].state_rows_total
    assert total % entries == 0, summary.progress
    return total // entries


def test_metrics_micro_batches_cost_their_new_events_and_closed_windows_are_dropped(
    spark: SparkSession, bootstrap_servers: str, unique_name: Callable[[str], str],
    create_topic: Callable[..., str], tmp_path: Path,
) -> None:
    prefix = unique_name("qm") + "."
    topic = create_topic(TopicNames(prefix).events, 1)
    source = EventSource(bootstrap_servers, prefix)
    # Three rounds of 20 entries, an hour apart in event time, each written in two halves:
    # each entry's ENQUEUED and first LEASED, then its last three events. A round's events
    # span under a minute: the second half changes windows the first half wrote (so it reads
    # them back), and the next round moves the watermark (a minute behind the latest event)
    # past all of them.
    trail = [replace(e, timestamp_ms=e.timestamp_ms + (e.bookmark.offset // ROUND) * HOUR)
             for e in workload("Orders", unique_name("orders"), 1, 3 * ROUND, T0,
                               spacing_ms=1000) if e.bookmark is not None]

    def round_of(e: Event) -> int:
        assert e.bookmark is not None
        return e.bookmark.offset // ROUND

    def half(r: int, second: bool) -> list[Event]:
        events = [e for e in trail if round_of(e) == r]
        return [e for i, e in enumerate(events) if (i % 5 >= 2) == second]

    checkpoint = str(tmp_path / "ckpt")
    stream = StreamOptions(checkpoint, available_now=True, watermark="1 minute")
    output = str(tmp_path / "metrics")
    codec = Codec()
    runs: list[tuple[int, bool, int, StreamSummary]] = []
    for r in range(3):
        for second in (False, True):
            events = half(r, second)
            produce(bootstrap_servers, topic, [codec.encode_event(e) for e in events],
                    partition=0)
            done = run_job(MetricsJob("Orders", WINDOW), source, spark=spark, stream=stream,
                           output=output)
            assert done.stream is not None and done.stream.events == len(events)
            runs.append((r, second, len(events), done.stream))

    # Each run reads its own records only, however many came before.
    for _, _, records, summary in runs:
        assert sum(p.input_rows for p in summary.progress) == SOURCE_READS * records, summary
    per_entry = state_rows_per_entry(runs[0][3], ROUND)
    round_windows = {
        r: {(e.timestamp_ms // window_ms(WINDOW)) for e in trail if round_of(e) == r}
        for r in range(3)}
    for r, second, _, summary in runs:
        # ...updates the state of its round's 20 entries only...
        assert all(p.state_rows_updated <= per_entry * ROUND for p in summary.progress), summary
        # ...recomputes those entries only and rewrites only its round's windows...
        assert sum(c.entries for c in summary.changes) == ROUND, summary.changes
        assert sum(c.parts for c in summary.changes) <= len(round_windows[r]), summary.changes
        # ...and reads back only samples of its round: none in a first half (its windows
        # are new), in a second half at most the first half's (two samples per entry:
        # enqueued, delivered; a wait too for the first delivery).
        read = sum(c.part_rows_read for c in summary.changes)
        if second:
            assert 0 < read <= 3 * ROUND, summary.changes
        else:
            assert read == 0, summary.changes

    # Finished entries left Spark's state store once the watermark passed them (two of each
    # round stay: they have no outcome), and closed windows left the checkpoint.
    removed = sum(p.state_rows_removed for _, _, _, s in runs for p in s.progress)
    assert removed >= per_entry * 2 * (ROUND - 2), [s.progress for *_, s in runs]
    dropped = sum(c.parts_dropped for _, _, _, s in runs for c in s.changes)
    assert dropped >= len(round_windows[0]) + len(round_windows[1])
    kept = {p // window_ms(WINDOW) for p in PartStore(spark, f"{checkpoint}/windows").parts()}
    assert kept <= round_windows[2], (kept, round_windows[2])

    # And the table is the batch job's, window for window.
    table = latest_rows(spark.read.parquet(output), KEYS)
    batch = transforms.metrics(read_events(spark, topic, source.options()), WINDOW)
    assert table.count() == batch.count() == sum(len(w) for w in round_windows.values())
    assert same(table, batch)


def test_a_checkpoint_of_another_definition_or_of_the_landing_stream_is_refused(
    spark: SparkSession, bootstrap_servers: str, tmp_path: Path,
) -> None:
    source = EventSource(bootstrap_servers, "unused.")
    landed = tmp_path / "landed"
    (landed / "events").mkdir(parents=True)
    with pytest.raises(PipelineUsageError, match="landed the events"):
        run_job(MetricsJob("Orders"), source, spark=spark,
                stream=StreamOptions(str(landed), available_now=True),
                output=str(tmp_path / "out"))
    from layer.pipeline.checkpoint import write_text

    other = tmp_path / "other"
    other.mkdir()
    write_text(spark, str(other / "qlayer-stream.json"),
               json.dumps({"job": "metrics", "queue": "Orders", "window": "1 minute"},
                          sort_keys=True))
    with pytest.raises(PipelineUsageError, match="keeps the state of another stream"):
        run_job(MetricsJob("Orders", "5 minutes"), source, spark=spark,
                stream=StreamOptions(str(other), available_now=True),
                output=str(tmp_path / "out"))


def distinct_buckets(spark: SparkSession, queue: str, count: int) -> list[str]:
    """Group names whose members fall in buckets of their own, so what a micro-batch reads
    back can be bounded by the groups it touches."""
    definition = parse_view(["/region"], ["/region"])
    names = [f"g{i}" for i in range(200)]
    rows = spark.createDataFrame([(queue, json.dumps({"region": n})) for n in names],
                                 "queue string, payload string")
    found: dict[int, str] = {}
    for row in with_bucket(rows, definition).collect():
        found.setdefault(int(row["part"]), json.loads(row["payload"])["region"])
    chosen = sorted(found.values(), key=lambda n: int(n[1:]))[:count]
    assert len(chosen) == count
    return chosen


def test_views_micro_batches_touch_their_groups_and_the_postgres_table_changes_in_place(
    spark: SparkSession, bootstrap_servers: str, database_url: str,
    unique_name: Callable[[str], str], create_topic: Callable[..., str], tmp_path: Path,
) -> None:
    prefix = unique_name("qv") + "."
    topic = create_topic(TopicNames(prefix).events, 1)
    journal = create_topic(unique_name("orders"), 1)
    source = EventSource(bootstrap_servers, prefix)
    # Round r enqueues 20 entries into three groups of its own; the next round acks every
    # entry of the round's first group (that group leaves the view) and leases one more of
    # each of the other two (they shrink).
    groups = distinct_buckets(spark, "Orders", 3 * 4)
    payloads = [{"region": groups[3 * r + i % 3], "qty": i + 1}
                for r in range(4) for i in range(ROUND)]
    produce(bootstrap_servers, journal, [json.dumps(p).encode() for p in payloads],
            partition=0)

    def event(kind: EventType, at: int, offset: int, **fields: object) -> Event:
        return Event(type=kind, timestamp_ms=at, coordinator_id="c", coordinator_epoch=1,
                     queue="Orders", bookmark=Bookmark(journal, 0, offset),
                     **fields)  # type: ignore[arg-type]

    def round_events(r: int) -> list[Event]:
        at = T0 + r * HOUR
        events = [event(EventType.ENQUEUED, at + i, r * ROUND + i, record_timestamp_ms=T0)
                  for i in range(ROUND)]
        if r > 0:
            for i in range(ROUND):
                offset = (r - 1) * ROUND + i
                if i % 3 == 0:
                    events += [event(EventType.LEASED, at + 100 + i, offset, consumer_id="w",
                                     session_id="s", delivery_count=1,
                                     lease_expires_ms=at + 60_000),
                               event(EventType.ACKED, at + 200 + i, offset, consumer_id="w",
                                     delivery_count=1)]
                elif i in (1, 2):
                    events.append(event(EventType.LEASED, at + 100 + i, offset,
                                        consumer_id="w", session_id="s", delivery_count=1,
                                        lease_expires_ms=at + 60_000))
        return events

    fields = ["/region", "SUM(/qty) AS /units", "COUNT(*) AS /orders"]
    as_of = T0 + 10 * HOUR
    job = ViewsJob("Orders", journal, tuple(fields), ("/region",), None, False, as_of)
    stream = StreamOptions(str(tmp_path / "ckpt"), available_now=True, watermark="5 seconds")
    codec = Codec()
    summaries = []
    for r in range(4):
        events = round_events(r)
        produce(bootstrap_servers, topic, [codec.encode_event(e) for e in events], partition=0)
        done = run_job(job, source, spark=spark, stream=stream, output=database_url,
                       table="orders_view")
        assert done.stream is not None and done.stream.events == len(events)
        summaries.append((len(events), done.stream))

    touched_entries = [ROUND] + [ROUND + 7 + 2] * 3  # new ones; the previous round's acked
    for (records, summary), entries in zip(summaries, touched_entries, strict=True):
        assert sum(p.input_rows for p in summary.progress) == SOURCE_READS * records, summary
        assert sum(c.entries for c in summary.changes) == entries, summary.changes
        # Its own three groups and the previous round's three: six buckets at most, and
        # what it reads back is the previous round's members only (20), not the backlog.
        assert sum(c.parts for c in summary.changes) <= 6, summary.changes
        assert sum(c.part_rows_read for c in summary.changes) <= ROUND, summary.changes
        # The rows of those groups, and one deletion: the group that was acked away.
        assert sum(c.rows_written for c in summary.changes) <= 6, summary.changes
    per_entry = state_rows_per_entry(summaries[0][1], ROUND)
    for _, summary in summaries:
        assert all(p.state_rows_updated <= per_entry * (ROUND + 9) for p in summary.progress)
    removed = sum(p.state_rows_removed for _, s in summaries for p in s.progress)
    assert removed >= per_entry * 7 * 2, [s.progress for _, s in summaries]  # acked, evicted

    engine = sqlalchemy.create_engine(database_url)
    with engine.connect() as db:
        found = {(r.queue, r.region, r.units, r.orders) for r in db.execute(sqlalchemy.text(
            "SELECT queue, region, units, orders FROM orders_view")).all()}
    engine.dispose()
    events = read_events(spark, topic, source.options())
    batch = transforms.view(transforms.available_entries(events, as_of),
                            read_journal(spark, journal, source.options()),
                            parse_view(fields, ["/region"]))
    expected = {(r["queue"], r["region"], r["units"], r["orders"]) for r in batch.collect()}
    assert found == expected
    # Every round's first group but the last round's was acked away; the others stay.
    assert {g for _, g, _, _ in found} == {groups[3 * r + i] for r in range(4) for i in (1, 2)
                                           } | {groups[9]}
    assert len(found) == 9
