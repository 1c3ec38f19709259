"""The lifecycle stream keeps per-entry state in Spark's state store: each micro-batch reads
only its new events and touches only their entries, and finished entries leave the state once
the watermark has passed them, while the history grows (rows counted from Spark's
StreamingQueryProgress, not time)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy
from pyspark.sql import SparkSession

from layer.pipeline import transforms
from layer.pipeline.io import SOURCE_READS, latest_rows, read_events
from layer.pipeline.jobs import EventSource, LifecycleJob, StreamOptions, run_job
from layer.pipeline.synthetic import workload
from layer.protocol import Codec, EventType, TopicNames
from tests.support.coordinator import produce

pytestmark = pytest.mark.integration

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
HOUR = 3_600_000
ROUND = 20  # entries per round, 5 events each


def test_each_micro_batch_costs_its_new_events_and_finished_entries_are_evicted(
    spark: SparkSession, bootstrap_servers: str, unique_name: Callable[[str], str],
    create_topic: Callable[..., str], tmp_path: Path,
) -> None:
    prefix = unique_name("qi") + "."
    topic = create_topic(TopicNames(prefix).events, 1)
    journal = unique_name("orders")
    source = EventSource(bootstrap_servers, prefix)
    # Three rounds of 20 entries, an hour apart in event time: each round moves the
    # watermark (5 s behind the latest event) past every event of the rounds before.
    trail = [replace(e, timestamp_ms=e.timestamp_ms + (e.bookmark.offset // ROUND) * HOUR)
             for e in workload("Orders", journal, 1, 3 * ROUND, T0, spacing_ms=1000)
             if e.bookmark is not None]
    stream = StreamOptions(str(tmp_path / "ckpt"), available_now=True, watermark="5 seconds")
    codec = Codec()
    runs = []
    for r in range(3):
        produce(bootstrap_servers, topic,
                [codec.encode_event(e) for e in trail if e.bookmark is not None
                 and e.bookmark.offset // ROUND == r], partition=0)
        done = run_job(LifecycleJob("Orders"), source, spark=spark, stream=stream,
                       output=str(tmp_path / "lifecycle"))
        assert done.stream is not None and done.stream.events == 100
        runs.append(done.stream.progress)

    # Each run reads its round's 100 event records only, and updates the state of its 20
    # entries only, however many came before. (Spark counts the records once per read of
    # the source in the plan: decoding reads it for single events and for batches.)
    assert [sum(p.input_rows for p in run) for run in runs] == [SOURCE_READS * 100] * 3, runs
    # Spark's applyInPandasWithState store holds a fixed number of rows per entry (two in
    # Spark 4.2): the first batch, 20 new entries, tells how many.
    per_entry = runs[0][0].state_rows_total // ROUND
    assert per_entry >= 1 and runs[0][0].state_rows_total == per_entry * ROUND, runs
    assert all(p.state_rows_updated <= per_entry * ROUND for run in runs for p in run), runs
    # Finished entries left the state: round 1's 18 (two of each round stay pending, they
    # have no outcome) once round 2 moved the watermark past them, and so on.
    removed = sum(p.state_rows_removed for run in runs for p in run)
    assert removed >= per_entry * 18, runs
    final = runs[2][-1].state_rows_total
    assert final == per_entry * 3 * ROUND - removed, runs
    assert final <= per_entry * (ROUND + 4), runs  # round 3 and the four pending before

    # And the table is the batch job's, entry for entry.
    table = latest_rows(spark.read.parquet(str(tmp_path / "lifecycle")), ["queue", "bookmark"])
    batch = transforms.lifecycle(read_events(spark, topic, source.options()))
    columns = [c for c in batch.columns if c != "deliveries"]
    assert table.count() == 3 * ROUND
    assert table.select(*columns).exceptAll(batch.select(*columns)).count() == 0
    assert batch.select(*columns).exceptAll(table.select(*columns)).count() == 0


def test_a_postgres_output_gets_the_changed_rows_in_place(
    spark: SparkSession, bootstrap_servers: str, database_url: str,
    unique_name: Callable[[str], str], create_topic: Callable[..., str], tmp_path: Path,
) -> None:
    prefix = unique_name("qp") + "."
    topic = create_topic(TopicNames(prefix).events, 1)
    journal = unique_name("orders")
    source = EventSource(bootstrap_servers, prefix)
    trail = list(workload("Orders", journal, 1, 2 * ROUND, T0, spacing_ms=1000))
    codec = Codec()
    stream = StreamOptions(str(tmp_path / "ckpt"), available_now=True)
    produce(bootstrap_servers, topic, [codec.encode_event(e) for e in trail[:5 * ROUND]],
            partition=0)
    run_job(LifecycleJob("Orders"), source, spark=spark, stream=stream, output=database_url,
            table="orders_lifecycle")
    # Round 2, and the ack of round 1's pending entry 9: its row must change, not double.
    acked = replace(trail[5 * 9 + 4], type=EventType.ACKED, timestamp_ms=T0 + 60_000,
                    lease_expires_ms=None)
    produce(bootstrap_servers, topic,
            [codec.encode_event(e) for e in [*trail[5 * ROUND:], acked]], partition=0)
    run_job(LifecycleJob("Orders"), source, spark=spark, stream=stream, output=database_url,
            table="orders_lifecycle")

    engine = sqlalchemy.create_engine(database_url)
    with engine.connect() as db:
        found = db.execute(sqlalchemy.text(
            'SELECT "offset", outcome, outcome_count FROM orders_lifecycle')).all()
    engine.dispose()
    rows = {r.offset: r for r in found}
    assert len(found) == 2 * ROUND and sorted(rows) == list(range(2 * ROUND))  # one row each
    assert (rows[9].outcome, rows[9].outcome_count) == ("acked", 1)
    assert rows[19].outcome == "pending"
