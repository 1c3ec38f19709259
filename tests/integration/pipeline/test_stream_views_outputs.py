"""Streaming with checkpoints, Postgres output, views and the `qlayer pipeline` command,
against the real broker and Postgres, on synthetic protocol-correct events (layer.pipeline
.synthetic) written with the protocol's Codec to a fresh events topic."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy
from pyspark.sql import SparkSession

from layer.pipeline.io import latest_rows
from layer.pipeline.jobs import (
    EventSource,
    LifecycleJob,
    MetricsJob,
    StreamOptions,
    run_job,
)
from layer.pipeline.synthetic import expected_outcomes, workload
from layer.protocol import Codec, EventType, TopicNames
from layer.protocol.bookmark import Bookmark
from layer.protocol.records import Event
from tests.support.coordinator import produce

pytestmark = pytest.mark.integration

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def write_events(bootstrap: str, topic: str, events: list[Event]) -> None:
    codec = Codec()
    produce(bootstrap, topic, [codec.encode_event(e) for e in events], partition=0)


def test_a_second_streaming_run_counts_only_new_events(
    spark: SparkSession, bootstrap_servers: str, database_url: str,
    unique_name: Callable[[str], str], create_topic: Callable[..., str], tmp_path: Path,
) -> None:
    prefix = unique_name("qs") + "."
    events_topic = create_topic(TopicNames(prefix).events, 1)
    journal = unique_name("orders")
    source = EventSource(bootstrap_servers, prefix)
    trail = list(workload("Orders", journal, 1, 40, T0, spacing_ms=1000))
    first, second = trail[:100], trail[100:]  # entries 0-19, then 20-39
    life = StreamOptions(str(tmp_path / "life-ckpt"), available_now=True)
    metrics_ckpt = StreamOptions(str(tmp_path / "metrics-ckpt"), available_now=True)

    write_events(bootstrap_servers, events_topic, first)
    one = run_job(LifecycleJob("Orders"), source, spark=spark, stream=life,
                  output=str(tmp_path / "lifecycle"))
    assert one.stream is not None and one.stream.events == 100
    run_job(MetricsJob("Orders", "1 minute"), source, spark=spark, stream=metrics_ckpt,
            output=database_url, table="orders_metrics")

    write_events(bootstrap_servers, events_topic, second)
    two = run_job(LifecycleJob("Orders"), source, spark=spark, stream=life,
                  output=str(tmp_path / "lifecycle"))
    assert two.stream is not None and two.stream.events == 100
    again = run_job(MetricsJob("Orders", "1 minute"), source, spark=spark, stream=metrics_ckpt,
                    output=database_url, table="orders_metrics")
    assert again.stream is not None and again.stream.events == 100

    # Nothing new: a third run reads nothing and changes nothing.
    three = run_job(LifecycleJob("Orders"), source, spark=spark, stream=life,
                    output=str(tmp_path / "lifecycle"))
    assert three.stream is not None and three.stream.events == 0

    # The lifecycle stream writes a change log: the table is each entry's latest row.
    table = latest_rows(spark.read.parquet(str(tmp_path / "lifecycle")), ["queue", "bookmark"])
    assert table.count() == 40 == table.select("bookmark").distinct().count()
    outcomes = {r["outcome"]: r["count"] for r in table.groupBy("outcome").count().collect()}
    assert outcomes == expected_outcomes(40, 1)

    engine = sqlalchemy.create_engine(database_url)
    with engine.connect() as db:
        rows = db.execute(sqlalchemy.text(
            "SELECT window_start, acked, dead_lettered, consumers FROM orders_metrics "
            "ORDER BY window_start")).all()
    engine.dispose()
    # Entries were enqueued 1 s apart from T0: 40 s of acks, some 30 s later (redeliveries).
    assert len(rows) == len({r.window_start for r in rows})  # each window once
    assert sum(r.acked for r in rows) == expected_outcomes(40, 1)["acked"]
    assert sum(r.dead_lettered for r in rows) == expected_outcomes(40, 1)["dead_lettered"]
    shares = json.loads(rows[0].consumers)
    assert {c["consumer_id"] for c in shares} <= {"c1", "c2", "c3"}
    assert abs(sum(c["share"] for c in shares) - 1.0) < 1e-9


def test_views_through_the_command_line(
    bootstrap_servers: str, unique_name: Callable[[str], str],
    create_topic: Callable[..., str], tmp_path: Path,
) -> None:
    prefix = unique_name("qv") + "."
    events_topic = create_topic(TopicNames(prefix).events, 1)
    journal = create_topic(unique_name("orders"), 1)
    regions = ["east", "west", "east", "north", "west", "east"]
    orders = [{"region": r, "price": 10 * (i + 1), "qty": i + 1} for i, r in enumerate(regions)]
    produce(bootstrap_servers, journal, [json.dumps(o).encode() for o in orders], partition=0)
    # Offsets 0-3 wait in the queue; 4 is leased, 5 was acked: neither counts.
    def event(kind: EventType, at: int, offset: int, **fields: object) -> Event:
        return Event(type=kind, timestamp_ms=T0 + at, coordinator_id="c", coordinator_epoch=1,
                     queue="Orders", bookmark=Bookmark(journal, 0, offset),
                     **fields)  # type: ignore[arg-type]

    events = [event(EventType.ENQUEUED, 0, i, record_timestamp_ms=T0) for i in range(6)]
    events += [event(EventType.LEASED, 5, i, consumer_id="w", session_id="s", delivery_count=1,
                     lease_expires_ms=T0 + 60_000) for i in (4, 5)]
    events.append(event(EventType.ACKED, 9, 5, consumer_id="w", delivery_count=1))
    write_events(bootstrap_servers, events_topic, events)

    done = subprocess.run(
        [sys.executable, "-m", "layer_cli.main", "pipeline", "views", "Orders", "--journal",
         journal,
         "--group-by", "/region", "--field", "/region",
         "--field", "SUM(/price * /qty) AS /total", "--field", "COUNT(*) AS /orders",
         "--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix,
         "--output", str(tmp_path / "view"), "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(done.stdout)
    assert sorted((r["region"], r["total"], r["orders"]) for r in document["rows"]) == [
        ("east", 10 * 1 + 30 * 3, 2), ("north", 40 * 4, 1), ("west", 20 * 2, 1)]
    assert document["output"] == str(tmp_path / "view")
    assert (tmp_path / "view" / "_SUCCESS").exists()
