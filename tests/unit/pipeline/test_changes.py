"""The incremental metrics and views steps on hand-built frames: a micro-batch changes only
the windows and groups its entries' events move, and applying the micro-batches one after the
other gives the batch job's table (the parts and the output kept in memory here; the stream
keeps them under its checkpoint and in its output, tests/integration/pipeline)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType

from layer.pipeline.changes import (
    candidate_parts,
    changed_windows,
    delayed,
    entry_events,
    member_keys,
    pending_keys,
    replace_entries,
    view_key_columns,
    view_members,
    view_of_members,
    window_samples,
    with_tombstones,
)
from layer.pipeline.checkpoint import PART
from layer.pipeline.io import DELETED, latest_rows
from layer.pipeline.transforms import available_entries, event_schema, metrics, view
from layer.pipeline.views import ViewDefinition, parse_view
from tests.unit.pipeline.frames import T0, acked, ev, frame, journal, leased

MINUTE = 60_000
KEYS = ["queue", "window_start"]


def touched(spark: SparkSession, kept: list[dict[str, Any]], new: list[dict[str, Any]]
            ) -> DataFrame:
    """What the per-entry step hands a micro-batch: every event of the entries ``new`` has
    events for, those of ``kept`` marked as not fresh."""
    entries = {(e["queue"], e["bookmark"]) for e in new}
    rows = [(e, False) for e in kept if (e["queue"], e["bookmark"]) in entries]
    rows += [(e, True) for e in new]
    schema = event_schema().add("fresh", BooleanType())
    return spark.createDataFrame(
        [(*[e[n] for n in event_schema().fieldNames()], fresh) for e, fresh in rows], schema)


def metrics_micro_batch(batch: DataFrame, stored: DataFrame | None, window: str
                        ) -> tuple[DataFrame, DataFrame, set[int]]:
    """One micro-batch of the metrics stream, its parts in memory: (the samples kept, the
    output rows with tombstones, the windows it changed)."""
    after = window_samples(entry_events(batch), window)
    before = window_samples(entry_events(batch, before=True), window)
    changed = changed_windows(after, before)
    parts = {int(r[PART]) for r in changed.collect()}
    kept = stored if stored is not None else after.limit(0)
    # Materialised, its lineage cut (as the stream's parts are read back from storage each
    # micro-batch): kept in memory with `cache`, each batch's plan held every earlier batch's
    # and Spark spent most of a minute planning a few rows (issue 35).
    samples = replace_entries(kept, batch, after).localCheckpoint()
    rows = metrics_of(samples.join(changed, ["queue", PART], "left_semi"))
    out = with_tombstones(rows, changed.select(
        "queue", F.timestamp_millis(F.col(PART)).alias("window_start")), KEYS)
    return samples, out.localCheckpoint(), parts


def metrics_of(samples: DataFrame) -> DataFrame:
    from layer.pipeline.transforms import window_metrics

    return window_metrics(samples)


def change_log(batches: Iterable[DataFrame]) -> DataFrame:
    found = None
    for n, rows in enumerate(batches):
        logged = rows.withColumn("batch", F.lit(n))
        found = logged if found is None else found.unionByName(logged)
    assert found is not None
    return found


def same(a: DataFrame, b: DataFrame) -> bool:
    b = b.select(*a.columns)
    return a.exceptAll(b).count() == 0 and b.exceptAll(a).count() == 0


def test_an_ack_changes_the_window_of_the_ack_only(spark: SparkSession) -> None:
    first = [ev("ENQUEUED", 0, o) for o in range(4)] + [leased(10 + o, o, "a", 1)
                                                          for o in range(4)]
    second = [acked(MINUTE + 5 + o, o, "a" if o < 3 else "b", 1) for o in range(4)]
    samples, out1, parts1 = metrics_micro_batch(touched(spark, [], first), None, "1 minute")
    assert parts1 == {T0 // MINUTE * MINUTE}
    samples, out2, parts2 = metrics_micro_batch(touched(spark, first, second), samples,
                                                "1 minute")
    # The entries' enqueue and delivery samples did not move: minute 0 is not recomputed.
    assert parts2 == {T0 // MINUTE * MINUTE + MINUTE}
    table = latest_rows(change_log([out1, out2]), KEYS)
    assert same(table, metrics(frame(spark, first + second), "1 minute"))


def test_a_window_left_without_samples_is_deleted_from_the_table(spark: SparkSession) -> None:
    # An ENQUEUED read late, earlier than the one seen: the entry's enqueue sample moves to
    # the earlier window, and the later window, which had only that sample, has no row now.
    later = [ev("ENQUEUED", 2 * MINUTE + 1, 0)]
    earlier = [ev("ENQUEUED", 1, 0)]
    samples, out1, _ = metrics_micro_batch(touched(spark, [], later), None, "1 minute")
    samples, out2, parts = metrics_micro_batch(touched(spark, later, earlier), samples,
                                               "1 minute")
    start = T0 // MINUTE * MINUTE
    assert parts == {start, start + 2 * MINUTE}
    assert [r[DELETED] for r in out2.where(F.col("window_start") == F.timestamp_millis(
        F.lit(start + 2 * MINUTE))).collect()] == [True]
    table = latest_rows(change_log([out1, out2]), KEYS)
    assert same(table, metrics(frame(spark, later + earlier), "1 minute"))
    assert table.count() == 1


def test_tombstones_match_null_keys_and_the_change_log_drops_them(spark: SparkSession) -> None:
    rows = spark.createDataFrame([("Q", "east", 3)], "queue string, region string, n long")
    keys = spark.createDataFrame([("Q", "east"), ("Q", None)], "queue string, region string")
    out = with_tombstones(rows, keys, ["queue", "region"])
    assert sorted((r["region"] or "", r["n"], r[DELETED]) for r in out.collect()) == [
        ("", None, True), ("east", 3, False)]
    before = spark.createDataFrame([("Q", None, 1, False)],
                                   f"queue string, region string, n long, {DELETED} boolean")
    log = change_log([before, out])
    assert [r.asDict() for r in latest_rows(log, ["queue", "region"]).collect()] == [
        {"queue": "Q", "region": "east", "n": 3}]


ORDERS = {0: {"region": "east", "qty": 2}, 1: {"region": "west", "qty": 3},
          2: {"region": "east", "qty": 5}, 3: {"qty": 7}, 4: {"region": "west", "qty": 1}}


def views_micro_batch(spark: SparkSession, batch: DataFrame, stored: DataFrame | None,
                      definition: ViewDefinition, as_of: int, include_leased: bool = False
                      ) -> tuple[DataFrame, DataFrame, set[int]]:
    """One micro-batch of the views stream, its parts in memory (every part read): the
    members kept, the output rows with tombstones, the parts it changed."""
    after, before = entry_events(batch), entry_events(batch, before=True)
    candidates = pending_keys(after, before, as_of)
    payloads = (journal(spark, ORDERS, values={o: json.dumps(d) for o, d in ORDERS.items()})
                .join(candidates.select("topic", "partition", "offset"),
                      ["topic", "partition", "offset"], "left_semi")
                .select("topic", "partition", "offset",
                        F.col("value").cast("string").alias("payload")))
    parts = {int(r[PART]) for r in candidate_parts(candidates, payloads, definition).collect()}
    fresh = view_members(after, payloads, definition, as_of, include_leased)
    kept = stored if stored is not None else fresh.limit(0)
    members = replace_entries(kept, batch, fresh).localCheckpoint()  # as in metrics_micro_batch
    rows = view_of_members(members.where(F.col(PART).isin(list(parts))), definition, as_of,
                           include_leased)
    keys = view_key_columns(definition)
    assert keys is not None
    groups = member_keys(kept.where(F.col(PART).isin(list(parts))), definition).unionByName(
        member_keys(members.where(F.col(PART).isin(list(parts))), definition))
    return members, with_tombstones(rows, groups, keys).localCheckpoint(), parts


def test_a_view_kept_up_by_micro_batches_is_the_batch_jobs_view(spark: SparkSession) -> None:
    definition = parse_view(["/region", "SUM(/qty) AS /units", "COUNT(*) AS /orders"],
                            group_by=["/region"])
    assert view_key_columns(definition) == ["queue", "region"]
    as_of = T0 + 10 * MINUTE
    rounds = [
        [ev("ENQUEUED", 0, o) for o in range(4)],
        # 0 leased, 1 acked: both leave; 4 arrives; 3 (no region: the null group) stays.
        [leased(10, 0, "a", 1), leased(10, 1, "a", 1), acked(20, 1, "a", 1),
         ev("ENQUEUED", 30, 4)],
        # 0 released: back in east; the west entries both leave: the group goes.
        [ev("RELEASED", 40, 0, consumer_id="a", delivery_count=1), leased(50, 4, "b", 1)],
    ]
    seen: list[dict[str, Any]] = []
    members = None
    outputs = []
    for events in rounds:
        members, out, parts = views_micro_batch(spark, touched(spark, seen, events), members,
                                                definition, as_of)
        assert parts  # each round moves an entry in or out
        outputs.append(out)
        seen += events
        table = latest_rows(change_log(outputs), ["queue", "region"])
        batch = view(available_entries(frame(spark, seen), as_of),
                     journal(spark, ORDERS, values={o: json.dumps(d)
                                                    for o, d in ORDERS.items()}), definition)
        assert same(table, batch), (table.collect(), batch.collect())
    final = {r["region"]: (r["units"], r["orders"]) for r in table.collect()}
    assert final == {"east": (7.0, 2), None: (7.0, 1)}


def test_a_delayed_member_counts_once_its_time_comes(spark: SparkSession) -> None:
    definition = parse_view(["COUNT(*) AS /orders"])
    events = [ev("ENQUEUED", 0, 0), ev("ENQUEUED", 0, 2, available_at_ms=T0 + MINUTE)]
    members, out, _ = views_micro_batch(spark, touched(spark, [], events), None, definition,
                                        T0 + 1000)
    assert [r["orders"] for r in out.where(~F.col(DELETED)).collect()] == [1]
    index = delayed(members, T0 + 1000)
    assert [(r["available_at_ms"]) for r in index.collect()] == [T0 + MINUTE]
    # A minute later, with no new event: the delayed member's bucket is recomputed.
    later = view_of_members(members, definition, T0 + MINUTE, include_leased=False)
    assert [r["orders"] for r in later.collect()] == [2]
    assert delayed(members, T0 + MINUTE).count() == 0
