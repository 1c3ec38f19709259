"""The pipeline's jobs: read with Spark's Kafka source, transform, write Parquet or Postgres.

Two front ends run the same `run_job`: ``qlayer pipeline ...`` (cli/pipeline.py) and
``python -m layer.pipeline.jobs ...``, the file ``spark-submit`` runs on a cluster with
``--from-submit`` (docs/pipeline.md). Exit statuses, the same in both: 0 done, 1 the job failed
(Kafka unreachable, jars missing, a bad view definition), 2 usage error, 3 ``reconcile`` found a
violation.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from layer.domain.errors import QlayerError
from layer.pipeline import transforms
from layer.pipeline.io import (
    SOURCE_READS,
    Sink,
    kafka_options,
    local_session,
    merge_rows,
    parse_sink,
    read_events,
    read_journal,
    read_journal_offsets,
    read_store,
    stream_events,
    write_table,
)
from layer.pipeline.timerange import TimeRangeError, parse_range
from layer.pipeline.views import ViewDefinition, parse_view
from layer.protocol import TopicNames
from layer.store.reports import check_table_name

__all__ = [
    "CLOCK_SKEW_MS",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "EXIT_VIOLATIONS",
    "BatchChanges",
    "BatchProgress",
    "EventSource",
    "Job",
    "JobResult",
    "LifecycleJob",
    "MetricsJob",
    "PipelineUsageError",
    "ReconcileJob",
    "ReconcileReport",
    "SessionOptions",
    "StreamOptions",
    "StreamSummary",
    "ViewsJob",
    "ViolationRow",
    "check_window",
    "main",
    "print_result",
    "run",
    "run_job",
    "run_lifecycle",
    "run_lifecycle_stream",
    "run_metrics",
    "run_metrics_stream",
    "run_reconcile",
    "run_views",
    "run_views_stream",
]

#: Exit statuses of both front ends (the CLI's own: 0 ok, 1 error, 2 usage).
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_VIOLATIONS: Final = 3

#: Events are read from this long before the journal range starts: an entry's ENQUEUED is
#: written after its record was journaled, but the two timestamps come from different clocks.
CLOCK_SKEW_MS = 60_000


@dataclass(frozen=True)
class EventSource:
    """Where the events and journals are: the Kafka cluster and the coordinator's topic prefix.

    ``kafka`` holds Kafka Java client settings (security.protocol, sasl.jaas.config, ...).
    """

    bootstrap_servers: str
    topic_prefix: str = "qlayer."
    kafka: Mapping[str, str] = field(default_factory=dict)

    @property
    def events_topic(self) -> str:
        return TopicNames(self.topic_prefix).events

    def options(self) -> dict[str, str]:
        return kafka_options(self.bootstrap_servers, self.kafka)


@dataclass(frozen=True)
class ViolationRow:
    queue: str
    bookmark: str
    violation: str


@dataclass(frozen=True)
class ReconcileReport:
    """A reconciliation's verdict: entry counts by status and every violation found."""

    queue: str
    done: int
    pending: int
    violations: list[ViolationRow]
    #: Whether PostgreSQL's state was compared too (``store``), not only journal and events.
    store_read: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations


# ------------------------------------------------------------------------------------------
# Batch jobs: each reads its range, transforms, writes, and returns the (lazy) table.
# ------------------------------------------------------------------------------------------


def _sink(output: str | Sink | None, table: str) -> Sink | None:
    return parse_sink(output, table) if isinstance(output, str) else output


def run_lifecycle(spark: SparkSession, source: EventSource, *, queue: str | None = None,
                  start_ms: int | None = None, end_ms: int | None = None,
                  output: str | Sink | None = None) -> DataFrame:
    """The lifecycle table from the events written in ``[start_ms, end_ms)``; written to
    ``output`` (a Parquet directory, a Postgres URL or a `Sink`) when given."""
    events = read_events(spark, source.events_topic, source.options(), start_ms, end_ms)
    table = _lifecycle(queue)(events)
    sink = _sink(output, "qlayer_lifecycle")
    if sink is not None:
        write_table(table, sink)
    return table


def _lifecycle(queue: str | None) -> Callable[[DataFrame], DataFrame]:
    def build(events: DataFrame) -> DataFrame:
        if queue is not None:
            events = events.where(F.col("queue") == F.lit(queue))
        return transforms.lifecycle(events)

    return build


def run_reconcile(spark: SparkSession, source: EventSource, queue: str, journal: str, *,
                  start_ms: int | None = None, end_ms: int | None = None,
                  output: str | Sink | None = None,
                  store: str | Sink | None = None) -> ReconcileReport:
    """Reconcile ``queue`` over the records of ``journal`` (its underlying topic) journaled in
    ``[start_ms, end_ms)`` against every event written since and, given ``store`` (qlayer's
    PostgreSQL URL), the entries' state there; ``output`` gets the per-entry statuses.

    PostgreSQL is read first, in one statement: a running coordinator commits there before
    it publishes the events, so the events read after it have everything it had committed
    but the last iteration's (docs/pipeline.md).
    """
    state = None
    has_filter: bool | None = None
    if store is not None:
        # A PostgreSQL URL parsed as an output's is where to connect; no table is written.
        target = parse_sink(store, "-") if isinstance(store, str) else store
        if not target.is_jdbc:
            raise PipelineUsageError(f"--store {target.describe()!r}: give qlayer's PostgreSQL "
                                     "URL (postgresql://user@host/db)")
        read = read_store(spark, target, queue)
        state = transforms.store_state(read.state).cache()
        state.count()  # now, before the events
        has_filter = read.has_filter
    events_from = None if start_ms is None else start_ms - CLOCK_SKEW_MS
    events = read_events(spark, source.events_topic, source.options(), events_from, None)
    records = read_journal(spark, journal, source.options(), start_ms, end_ms)
    reconciled = transforms.reconcile(events, records, queue, start_ms, end_ms, state,
                                      has_filter).cache()
    try:
        sink = _sink(output, "qlayer_reconcile")
        if sink is not None:
            write_table(reconciled, sink)
        by_status = {row["status"]: int(row["count"])
                     for row in reconciled.groupBy("status").count().collect()}
        found = [ViolationRow(r["queue"], r["bookmark"], r["violation"])
                 for r in transforms.violations(reconciled)
                 .orderBy("topic", "partition", "offset", "violation").collect()]
    finally:
        reconciled.unpersist()
        if state is not None:
            state.unpersist()
    return ReconcileReport(queue, by_status.get("done", 0), by_status.get("pending", 0), found,
                           store_read=store is not None)


def run_views(spark: SparkSession, source: EventSource, queue: str, journal: str,
              definition: ViewDefinition, *, as_of_ms: int, include_leased: bool = False,
              start_ms: int | None = None, end_ms: int | None = None,
              output: str | Sink | None = None) -> DataFrame:
    """The view over ``queue``'s entries available at ``as_of_ms`` (with ``include_leased``:
    every pending entry), payloads from ``journal``. Computed and written at once (the state
    of the queue is read now); returns the computed view.

    Only the events written in ``[start_ms, min(end_ms, as_of_ms + 1))`` are read: events
    after ``as_of_ms`` cannot change the view as of then, and an entry enqueued before
    ``start_ms`` has no ENQUEUED in the range, so it is not in the view (docs/pipeline.md).
    """
    until = as_of_ms + 1 if end_ms is None else min(end_ms, as_of_ms + 1)
    events = read_events(spark, source.events_topic, source.options(), start_ms, until)
    table = _views(spark, source, queue, journal, definition, as_of_ms, include_leased)(events)
    sink = _sink(output, "qlayer_view")
    if sink is not None:
        write_table(table, sink)
    return table


def _views(spark: SparkSession, source: EventSource, queue: str, journal: str,
           definition: ViewDefinition, as_of_ms: int | None, include_leased: bool
           ) -> Callable[[DataFrame], DataFrame]:
    def build(events: DataFrame) -> DataFrame:
        at = as_of_ms if as_of_ms is not None else int(time.time() * 1000)
        entries = transforms.available_entries(
            events.where(F.col("queue") == F.lit(queue)), at, include_leased)
        # Read the journal only from the oldest waiting entry's record on: a queue's backlog
        # is usually a thin tail of a long journal.
        oldest = entries.agg(F.min("record_timestamp_ms")).collect()[0][0]
        records = read_journal(spark, journal, source.options(),
                               None if oldest is None else int(oldest))
        return transforms.view(entries, records, definition)

    return build


def run_metrics(spark: SparkSession, source: EventSource, *, queue: str | None = None,
                window: str = "1 minute", start_ms: int | None = None,
                end_ms: int | None = None, output: str | Sink | None = None) -> DataFrame:
    """SLA metrics per queue and ``window`` from the events written in ``[start_ms, end_ms)``
    (`transforms.metrics`); written to ``output`` when given."""
    # Not cached: `transforms.metrics` reads its events once (one per-entry aggregation gives
    # every sample), so the Kafka range is read and decoded once (docs/pipeline.md "Speed").
    events = read_events(spark, source.events_topic, source.options(), start_ms, end_ms)
    table = _metrics(queue, window)(events)
    sink = _sink(output, "qlayer_metrics")
    if sink is not None:
        write_table(table, sink)
    return table


def _metrics(queue: str | None, window: str) -> Callable[[DataFrame], DataFrame]:
    def build(events: DataFrame) -> DataFrame:
        if queue is not None:
            events = events.where(F.col("queue") == F.lit(queue))
        return transforms.metrics(events, window)

    return build


# ------------------------------------------------------------------------------------------
# Streaming: per-entry state in Spark's state store; a micro-batch recomputes only the rows
# its new events change (docs/pipeline.md, "Streaming with checkpoints").
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamOptions:
    """Structured streaming: ``checkpoint`` keeps the Kafka offsets and the stream's state;
    ``available_now`` processes what is there and stops, otherwise a micro-batch runs every
    ``trigger`` until the process is stopped."""

    checkpoint: str
    available_now: bool = False
    trigger: str = "1 minute"
    max_offsets_per_trigger: int | None = None
    #: How late an event may come (by its own time, after the latest one seen) and still be
    #: counted; also how long a finished entry's state is kept, and how long a metrics window
    #: stays open to changes after its end.
    watermark: str = "1 hour"


@dataclass(frozen=True)
class BatchProgress:
    """One micro-batch, from Spark's `StreamingQueryProgress`: the rows it read, for its
    stateful operator the state rows in all, updated and removed, and how long it took."""

    batch_id: int
    input_rows: int
    state_rows_total: int = 0
    state_rows_updated: int = 0
    state_rows_removed: int = 0
    duration_ms: int = 0


@dataclass(frozen=True)
class BatchChanges:
    """What one micro-batch of the metrics or views stream did after Spark's state step: the
    entries it recomputed, the parts it rewrote (metrics windows, views buckets), the rows it
    read from those parts, the output rows it wrote (removed keys included) and the closed
    windows it dropped."""

    batch_id: int
    entries: int
    parts: int
    part_rows_read: int
    rows_written: int
    parts_dropped: int = 0


@dataclass(frozen=True)
class StreamSummary:
    """A streaming run: its micro-batches, the event records it read, Spark's progress of each
    micro-batch and, for metrics and views, what each one changed."""

    batches: int
    events: int
    progress: tuple[BatchProgress, ...] = ()
    changes: tuple[BatchChanges, ...] = ()


def _progress(query: Any) -> tuple[BatchProgress, ...]:
    found = []
    for p in query.recentProgress:
        states = list(p.stateOperators or [])
        found.append(BatchProgress(
            int(p.batchId), int(p.numInputRows),
            sum(int(s.numRowsTotal) for s in states),
            sum(int(s.numRowsUpdated) for s in states),
            sum(int(s.numRowsRemoved) for s in states),
            int(p.batchDuration)))
    return tuple(found)


#: The stream's definition, kept in its checkpoint: the state there is only good for it.
_SPEC_FILE = "qlayer-stream.json"


def _check_checkpoint(spark: SparkSession, checkpoint: str, spec: dict[str, Any]) -> None:
    """Refuse a checkpoint written for another definition (a metrics window of another
    length, another view) or by the landing streams of earlier versions; remember this one."""
    from layer.pipeline.checkpoint import exists, read_text, write_text

    root = checkpoint.rstrip("/")
    if exists(spark, f"{root}/events") or exists(spark, f"{root}/offsets"):
        raise PipelineUsageError(
            f"checkpoint {checkpoint}: written by an earlier qlayer, which landed the events "
            "there (events/, offsets/); give a new --checkpoint and a new --output")
    text = json.dumps(spec, sort_keys=True)
    kept = read_text(spark, f"{root}/{_SPEC_FILE}")
    if kept is not None and kept != text:
        raise PipelineUsageError(
            f"checkpoint {checkpoint} keeps the state of another stream ({kept}); this one is "
            f"{text}: give a new --checkpoint (and --output)")
    if kept is None:
        write_text(spark, f"{root}/{_SPEC_FILE}", text)


def _touched_entries(spark: SparkSession, source: EventSource, stream: StreamOptions,
                     queue: str | None, until_ms: int | None = None) -> DataFrame:
    """The events stream through the per-entry state step (`applyInPandasWithState`, keyed
    by queue and bookmark, `layer.pipeline.entrystate`): per micro-batch, every event of each
    entry it has new events for, with `changes.STEP_COLUMNS` (``fresh``: new in this
    micro-batch; ``watermark_ms``). An entry's state is removed once it has an outcome and
    the watermark (the latest event time seen less ``stream.watermark``) has passed its last
    event; events later than the watermark are dropped by Spark (``numRowsDroppedByWatermark``
    in the progress). ``until_ms``: events after it are not read into the state. Why a
    Python function per entry: docs/pipeline.md.
    """
    from pyspark.sql.streaming.state import GroupStateTimeout
    from pyspark.sql.types import BooleanType, LongType, StructField, StructType

    from layer.pipeline.changes import STEP_COLUMNS
    from layer.pipeline.entrystate import entry_step, plain_rows

    events = stream_events(spark, source.events_topic, source.options(),
                           stream.max_offsets_per_trigger)
    events = events.where(F.col("queue").isNotNull() & F.col("bookmark").isNotNull())
    if queue is not None:
        events = events.where(F.col("queue") == F.lit(queue))
    if until_ms is not None:
        events = events.where(F.col("timestamp_ms") <= F.lit(until_ms))
    columns = list(events.columns)
    integral = [f.name for f in events.schema.fields
                if f.dataType.typeName() in ("integer", "long")]
    fresh, watermark = STEP_COLUMNS
    schema = StructType([*events.schema.fields, StructField(fresh, BooleanType()),
                         StructField(watermark, LongType())])

    def step(key: Any, frames: Any, state: Any) -> Any:
        import pandas as pd  # type: ignore[import-untyped]

        kept = state.get[0] if state.exists else None
        new = (row for frame in frames
               for row in plain_rows(frame[columns].to_dict("records"), integral))
        done = entry_step(kept, new, state.hasTimedOut)
        if done.state is None:
            if state.exists:
                state.remove()
        else:
            state.update((done.state,))
            if done.timeout_ms is not None:
                # Spark refuses a timeout the watermark has passed already.
                state.setTimeoutTimestamp(max(done.timeout_ms,
                                              state.getCurrentWatermarkMs() + 1))
        if done.emit:
            at = state.getCurrentWatermarkMs()
            yield pd.DataFrame([[event.get(c) for c in columns] + [i >= done.kept, at]
                                for i, event in enumerate(done.emit)],
                               columns=[*columns, fresh, watermark], dtype=object)

    return (events.withColumn("event_time", F.timestamp_millis(F.col("timestamp_ms")))
            .withWatermark("event_time", stream.watermark)
            .groupBy("queue", "bookmark")
            .applyInPandasWithState(step, schema, "events string", "update",
                                    GroupStateTimeout.EventTimeTimeout))


def _run_stream(touched: DataFrame, stream: StreamOptions,
                each_batch: Callable[[DataFrame, int], None]) -> tuple[BatchProgress, ...]:
    writer = (touched.writeStream.outputMode("update").foreachBatch(each_batch)
              .option("checkpointLocation", stream.checkpoint.rstrip("/") + "/state"))
    if stream.available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=stream.trigger)
    query = writer.start()
    try:
        query.awaitTermination()
    finally:
        query.stop()
    return _progress(query)


def _summary(progress: tuple[BatchProgress, ...], batches: int,
             changes: Sequence[BatchChanges] = ()) -> StreamSummary:
    records = sum(p.input_rows for p in progress) // SOURCE_READS
    return StreamSummary(batches, records, progress, tuple(changes))


def run_lifecycle_stream(spark: SparkSession, source: EventSource, sink: Sink,
                         stream: StreamOptions, queue: str | None = None) -> StreamSummary:
    """The lifecycle table kept up to date incrementally: a micro-batch costs its new events.

    Each open entry's events are kept in Spark's state store (`_touched_entries`); a
    micro-batch gets all the events of the entries it has new events for, recomputes their
    rows with the batch job's own `transforms.lifecycle` and merges just those rows into the
    output (`io.merge_rows`).
    """
    from layer.pipeline.changes import entry_events

    _check_checkpoint(spark, stream.checkpoint, {"job": "lifecycle", "queue": queue})
    counted = {"batches": 0}

    def each_batch(batch: DataFrame, batch_id: int) -> None:
        rows = transforms.lifecycle(entry_events(batch)).cache()
        try:
            merge_rows(rows, sink, ["queue", "bookmark"], batch_id)
            counted["batches"] += 1
        finally:
            rows.unpersist()

    progress = _run_stream(_touched_entries(spark, source, stream, queue), stream, each_batch)
    return _summary(progress, counted["batches"])


def run_metrics_stream(spark: SparkSession, source: EventSource, sink: Sink,
                       stream: StreamOptions, queue: str | None = None,
                       window: str = "1 minute") -> StreamSummary:
    """The metrics table kept up to date incrementally (docs/pipeline.md).

    A micro-batch gets every event of the entries it has new events for (`_touched_entries`)
    and computes their samples with the batch job's `transforms.metric_samples`, as they were
    before it and as they are now: the windows where they differ are the ones it changes.
    Each window's samples are kept whole under the checkpoint (``windows/``, one part per
    window start), so the micro-batch reads those windows only, replaces the touched entries'
    samples there, recomputes their figures with the batch job's `transforms.window_metrics`
    (percentiles over every sample of the window, as the batch job has them) and merges those
    rows into the output. A window the watermark has passed is final: its samples are
    removed, and a change to it (an event of one of its entries that moves an older sample)
    is not applied.
    """
    from layer.pipeline.changes import (
        changed_windows,
        entry_events,
        replace_entries,
        window_ms,
        window_samples,
        with_tombstones,
    )
    from layer.pipeline.checkpoint import PART, PartStore

    _check_checkpoint(spark, stream.checkpoint, {"job": "metrics", "queue": queue,
                                                 "window": window})
    length = window_ms(window)
    store = PartStore(spark, stream.checkpoint.rstrip("/") + "/windows")
    keys = ["queue", "window_start"]
    done: list[BatchChanges] = []

    def each_batch(batch: DataFrame, batch_id: int) -> None:
        batch = batch.persist()
        try:
            entries = batch.select("queue", "bookmark").distinct().count()
            if entries == 0:
                done.append(BatchChanges(batch_id, 0, 0, 0, 0))
                return
            watermark = int(batch.agg(F.max("watermark_ms")).collect()[0][0])
            after = window_samples(entry_events(batch), window)
            before = window_samples(entry_events(batch, before=True), window)
            # A closed window (its end at or before the watermark) is final.
            changed = [(str(r["queue"]), int(r[PART]))
                       for r in changed_windows(after, before).collect()
                       if int(r[PART]) + length > watermark]
            parts = sorted({part for _, part in changed})
            read = written = 0
            if parts:
                stored = store.read(parts, batch_id, after.schema)
                merged = replace_entries(stored, batch,
                                         after.where(F.col(PART).isin(parts))).persist()
                try:
                    read = stored.count()
                    store.write(merged, parts, batch_id)
                    windows = spark.createDataFrame(changed, f"queue string, {PART} long")
                    rows = transforms.window_metrics(
                        merged.join(windows, ["queue", PART], "left_semi"))
                    out = with_tombstones(rows, windows.select(
                        "queue", F.timestamp_millis(F.col(PART)).alias("window_start")),
                        keys).persist()
                    written = out.count()
                    merge_rows(out, sink, keys, batch_id, deletes=True)
                    out.unpersist()
                finally:
                    merged.unpersist()
            closed = [part for part in store.parts() if part + length <= watermark]
            store.drop(closed)
            done.append(BatchChanges(batch_id, entries, len(parts), read, written, len(closed)))
        finally:
            batch.unpersist()

    progress = _run_stream(_touched_entries(spark, source, stream, queue), stream, each_batch)
    return _summary(progress, len(done), done)


def run_views_stream(spark: SparkSession, source: EventSource, sink: Sink,
                     stream: StreamOptions, job: ViewsJob,
                     definition: ViewDefinition) -> StreamSummary:
    """The view kept up to date incrementally (docs/pipeline.md).

    A micro-batch gets every event of the entries it has new events for (`_touched_entries`).
    Those pending before it or now have their journal records read by offset (their payload
    says which group they belong to); the view's members (pending entries whose payload
    matches the filter, with the payload) are kept under the checkpoint in buckets of groups
    (``members/``, a hash of the group), so the micro-batch reads the buckets of those
    entries' groups only, replaces those entries there, recomputes the buckets' groups with
    the batch job's `transforms.view` and merges those rows into the output, keyed by the
    queue and the projected grouping fields. A view whose grouping fields are not all
    projected has no such key: it is recomputed from every member and replaced whole. As of
    ``job.as_of_ms`` (events after it are not read) or, without it, of each micro-batch's
    start; a delayed member whose time has come is counted at the next micro-batch.
    """
    from layer.pipeline.changes import (
        DELAY_SCHEMA,
        candidate_parts,
        delayed,
        entry_events,
        member_keys,
        offset_rounds,
        pending_keys,
        replace_entries,
        view_key_columns,
        view_members,
        view_of_members,
        with_tombstones,
    )
    from layer.pipeline.checkpoint import PART, PartStore

    _check_checkpoint(spark, stream.checkpoint, {
        "job": "views", "queue": job.queue, "journal": job.journal, "fields": job.fields,
        "group_by": job.group_by, "where": job.where, "include_leased": job.include_leased,
        "as_of_ms": job.as_of_ms})
    root = stream.checkpoint.rstrip("/")
    members, delays = PartStore(spark, f"{root}/members"), PartStore(spark, f"{root}/delays")
    keys = view_key_columns(definition)
    done: list[BatchChanges] = []

    def each_batch(batch: DataFrame, batch_id: int) -> None:
        as_of = job.as_of_ms if job.as_of_ms is not None else int(time.time() * 1000)
        batch = batch.persist()
        cached: list[DataFrame] = [batch]
        try:
            entries = batch.select("queue", "bookmark").distinct().count()
            after, before = entry_events(batch), entry_events(batch, before=True)
            candidates = pending_keys(after, before, as_of).persist()
            cached.append(candidates)
            offsets = [(str(r["topic"]), int(r["partition"]), int(r["offset"]))
                       for r in candidates.select("topic", "partition", "offset").collect()]
            records = read_journal_offsets(spark, source.options(), offset_rounds(offsets))
            payloads = (records.join(candidates.select("topic", "partition", "offset"),
                                     ["topic", "partition", "offset"], "left_semi")
                        .select("topic", "partition", "offset",
                                F.col("value").cast("string").alias("payload"))
                        .dropDuplicates(["topic", "partition", "offset"]).persist())
            cached.append(payloads)
            parts = {int(r[PART]) for r in
                     candidate_parts(candidates, payloads, definition).collect()}
            index = None
            if not job.include_leased:
                index = delays.read([0], batch_id, DELAY_SCHEMA)
                parts |= {int(r["bucket"]) for r in index.where(
                    F.col("available_at_ms") <= F.lit(as_of)).select("bucket").collect()}
            if keys is None and parts:
                parts |= set(members.parts())  # no key to merge by: the whole view
            elif payloads.count() < len(offsets):
                # A record retention deleted: the entry's group is unknown, and it may be a
                # member since before. Every bucket is read, so it leaves whichever it is in.
                parts |= set(members.parts())
            read = written = 0
            if parts:
                ordered = sorted(parts)
                fresh = view_members(after, payloads, definition, as_of, job.include_leased)
                stored = members.read(ordered, batch_id, fresh.schema)
                merged = replace_entries(stored, batch, fresh).persist()
                cached.append(merged)
                read = stored.count()
                members.write(merged, ordered, batch_id)
                rows = view_of_members(merged, definition, as_of, job.include_leased)
                if keys is None:
                    rows = rows.persist()
                    cached.append(rows)
                    written = rows.count()
                    write_table(rows, sink)
                else:
                    groups = member_keys(stored, definition).unionByName(
                        member_keys(merged, definition))
                    out = with_tombstones(rows, groups, keys).persist()
                    cached.append(out)
                    written = out.count()
                    merge_rows(out, sink, keys, batch_id, deletes=True, null_safe=True)
                if index is not None:
                    kept = index.where(~F.col("bucket").isin(ordered))
                    delays.write(kept.unionByName(delayed(merged, as_of)), [0], batch_id)
            done.append(BatchChanges(batch_id, entries, len(parts), read, written))
        finally:
            for frame in cached:
                frame.unpersist()

    touched = _touched_entries(spark, source, stream, job.queue, job.as_of_ms)
    progress = _run_stream(touched, stream, each_batch)
    return _summary(progress, len(done), done)


# ------------------------------------------------------------------------------------------
# One entry point for both front ends.
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionOptions:
    """How to get a SparkSession: a local one on ``master`` or spark-submit's own."""

    master: str = "local[2]"
    from_submit: bool = False


@dataclass(frozen=True)
class LifecycleJob:
    queue: str | None = None


@dataclass(frozen=True)
class ReconcileJob:
    queue: str
    journal: str
    #: qlayer's PostgreSQL URL: its state of the queue is the third source.
    store: str | None = None


@dataclass(frozen=True)
class ViewsJob:
    queue: str
    journal: str
    fields: tuple[str, ...]
    group_by: tuple[str, ...] = ()
    where: str | None = None
    include_leased: bool = False
    as_of_ms: int | None = None


@dataclass(frozen=True)
class MetricsJob:
    queue: str | None = None
    window: str = "1 minute"


Job = LifecycleJob | ReconcileJob | ViewsJob | MetricsJob


@dataclass(frozen=True)
class JobResult:
    """What a job did: ``rows`` a small summary to show (the view itself, the metrics, counts
    by outcome), ``report`` for reconcile, ``stream`` for a streaming run."""

    job: str
    rows: list[dict[str, Any]]
    output: str | None = None
    report: ReconcileReport | None = None
    stream: StreamSummary | None = None

    @property
    def exit_status(self) -> int:
        return EXIT_VIOLATIONS if self.report is not None and not self.report.ok else EXIT_OK


class PipelineUsageError(QlayerError, ValueError):
    """Options that do not go together (``--stream`` for reconcile, no checkpoint)."""


_WINDOW: Final = re.compile(
    r"^\s*(\d+\s+(millisecond|second|minute|hour|day|week)s?\s*)+$", re.IGNORECASE)


def check_window(window: str) -> str:
    """A metrics window as Spark's `window()` takes it (``1 minute``, ``90 seconds``,
    ``1 hour 30 minutes``); raises `PipelineUsageError` before any JVM starts otherwise."""
    if not _WINDOW.match(window):
        raise PipelineUsageError(
            f"window {window!r}: give a length such as '1 minute', '30 seconds', '1 hour'")
    return window.strip()


_NAMES: Final[dict[type[Any], str]] = {LifecycleJob: "lifecycle", ReconcileJob: "reconcile",
                                      ViewsJob: "views", MetricsJob: "metrics"}
_TABLES: Final[dict[str, str]] = {"lifecycle": "qlayer_lifecycle",
                                  "reconcile": "qlayer_reconcile", "views": "qlayer_view",
                                  "metrics": "qlayer_metrics"}


@contextmanager
def _session(options: SessionOptions, job: str) -> Iterator[SparkSession]:
    if options.from_submit:
        # Under spark-submit the application ends with the driver: leave the session be.
        yield SparkSession.builder.appName(f"qlayer-{job}").getOrCreate()
        return
    spark = local_session(options.master, app_name=f"qlayer-{job}")
    try:
        yield spark
    finally:
        spark.stop()


def _rows(frame: DataFrame, limit: int) -> list[dict[str, Any]]:
    return [row.asDict(recursive=True) for row in frame.limit(limit).collect()]


def run_job(job: Job, source: EventSource, *, session: SessionOptions | None = None,
            spark: SparkSession | None = None, start_ms: int | None = None,
            end_ms: int | None = None, output: str | None = None, table: str | None = None,
            stream: StreamOptions | None = None, limit: int = 100) -> JobResult:
    """Run one job in a session of its own (or ``spark``, left running) and say what it did.

    Raises `QlayerError` subclasses for definitions and options that cannot work (a view
    that does not parse, ``--stream`` without an output).
    """
    name = _NAMES[type(job)]
    sink = parse_sink(output, table or _TABLES[name]) if output is not None else None
    if sink is not None and sink.is_jdbc and sink.table is not None:
        check_table_name(sink.table)  # before any JVM starts
    if stream is not None:
        if isinstance(job, ReconcileJob):
            raise PipelineUsageError(
                "reconcile runs in batch only: its verdict is about a closed range of journal "
                "time (docs/pipeline.md)")
        if sink is None:
            raise PipelineUsageError("--stream needs --output: the table it keeps up to date")
        if start_ms is not None or end_ms is not None:
            raise PipelineUsageError(
                "--since/--until bound a batch job's read; a stream reads from where its "
                "checkpoint stopped")
    # Checked before any JVM starts: a typo fails in a second, not after Spark's start.
    if isinstance(job, MetricsJob):
        check_window(job.window)
    definition = (parse_view(job.fields, job.group_by, job.where)
                  if isinstance(job, ViewsJob) else None)
    if spark is not None:
        return _run(job, definition, spark, source, start_ms, end_ms, sink, stream, limit)
    with _session(session or SessionOptions(), name) as own:
        return _run(job, definition, own, source, start_ms, end_ms, sink, stream, limit)


def _run(job: Job, definition: ViewDefinition | None, spark: SparkSession,
         source: EventSource, start_ms: int | None, end_ms: int | None, sink: Sink | None,
         stream: StreamOptions | None, limit: int) -> JobResult:
    name = _NAMES[type(job)]
    where = sink.describe() if sink is not None else None
    if stream is not None and sink is not None:
        summary: StreamSummary
        if isinstance(job, LifecycleJob):
            summary = run_lifecycle_stream(spark, source, sink, stream, job.queue)
        elif isinstance(job, MetricsJob):
            summary = run_metrics_stream(spark, source, sink, stream, job.queue, job.window)
        else:
            assert isinstance(job, ViewsJob) and definition is not None
            summary = run_views_stream(spark, source, sink, stream, job, definition)
        return JobResult(name, [], where, stream=summary)
    if isinstance(job, LifecycleJob):
        life = run_lifecycle(spark, source, queue=job.queue, start_ms=start_ms, end_ms=end_ms,
                             output=sink)
        counts = life.groupBy("queue", "outcome").count().orderBy("queue", "outcome")
        return JobResult(name, _rows(counts, limit), where)
    if isinstance(job, ReconcileJob):
        report = run_reconcile(spark, source, job.queue, job.journal, start_ms=start_ms,
                               end_ms=end_ms, output=sink, store=job.store)
        return JobResult(name, [], where, report=report)
    if isinstance(job, ViewsJob):
        assert definition is not None
        at = job.as_of_ms if job.as_of_ms is not None else int(time.time() * 1000)
        result = run_views(spark, source, job.queue, job.journal, definition, as_of_ms=at,
                           include_leased=job.include_leased, start_ms=start_ms,
                           end_ms=end_ms, output=sink)
        return JobResult(name, _rows(result, limit), where)
    found = run_metrics(spark, source, queue=job.queue, window=job.window, start_ms=start_ms,
                        end_ms=end_ms, output=sink)
    return JobResult(name, _rows(found.orderBy("queue", "window_start"), limit), where)


# ------------------------------------------------------------------------------------------
# python -m layer.pipeline.jobs: the spark-submit entry point.
# ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m layer.pipeline.jobs", description="qlayer's Spark jobs",
        epilog="exit status: 0 done, 1 failed, 2 usage error, 3 reconcile found violations")
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--topic-prefix", default="qlayer.",
                        help="the coordinator's topic prefix (its events topic is <prefix>events)")
    parser.add_argument("--kafka-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a Kafka Java client setting for the source (security.protocol=...)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--from-submit", action="store_true",
                        help="use the session spark-submit configured (its --master and --jars)")
    parser.add_argument("--since", metavar="T",
                        help="range start: epoch ms, ISO-8601 (UTC if no zone) or a length "
                        "before now (1h, 30m, 2d)")
    parser.add_argument("--until", metavar="T",
                        help="range end (exclusive), in the same forms as --since")
    parser.add_argument("--start-ms", type=int, help="range start, epoch milliseconds "
                        "(the older name of --since)")
    parser.add_argument("--end-ms", type=int, help="range end (exclusive), epoch milliseconds "
                        "(the older name of --until)")
    parser.add_argument("--output", help="a directory for Parquet, or a postgresql:// URL")
    parser.add_argument("--table", help="the Postgres table (default qlayer_<job>)")
    parser.add_argument("--stream", action="store_true",
                        help="structured streaming with --checkpoint (not for reconcile)")
    parser.add_argument("--checkpoint", help="the stream's checkpoint directory")
    parser.add_argument("--available-now", action="store_true",
                        help="with --stream: process what is there, then stop")
    parser.add_argument("--trigger", default="1 minute",
                        help="with --stream: how often a micro-batch runs")
    jobs = parser.add_subparsers(dest="job", required=True)
    life = jobs.add_parser("lifecycle", help="one row per (queue, bookmark)")
    life.add_argument("--queue")
    recon = jobs.add_parser("reconcile", help="every admitted message has exactly one outcome")
    recon.add_argument("--queue", required=True)
    recon.add_argument("--journal", required=True, help="the queue's underlying topic")
    recon.add_argument("--store", metavar="URL",
                       help="qlayer's PostgreSQL (postgresql://user@host/db): compare the "
                       "entries' stored state too")
    views = jobs.add_parser("views", help="aggregates over a queue's available entries")
    views.add_argument("--queue", required=True)
    views.add_argument("--journal", required=True, help="the queue's underlying topic")
    views.add_argument("--field", action="append", required=True, dest="fields",
                       help="a projection field: /path or 'SUM(/a * /b) AS /name'")
    views.add_argument("--group-by", action="append", default=[],
                       help="a grouping field or expression")
    views.add_argument("--where", help="a filter on the payloads")
    views.add_argument("--include-leased", action="store_true",
                       help="every pending entry, leased and delayed ones too")
    views.add_argument("--as-of-ms", type=int, help="the queue as it was then (default now)")
    met = jobs.add_parser("metrics", help="throughput, latencies and rates per window")
    met.add_argument("--queue")
    met.add_argument("--window", default="1 minute", help="a Spark interval: '1 minute'")
    return parser


def _source(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EventSource:
    pairs = [item.partition("=") for item in args.kafka_option]
    bad = [key for key, sep, _ in pairs if not sep]
    if bad:
        parser.error(f"--kafka-option takes KEY=VALUE; got {', '.join(bad)}")  # exits 2
    return EventSource(args.bootstrap_servers, args.topic_prefix,
                       {key: value for key, _, value in pairs})


def _job(args: argparse.Namespace) -> Job:
    if args.job == "lifecycle":
        return LifecycleJob(args.queue)
    if args.job == "reconcile":
        return ReconcileJob(args.queue, args.journal, args.store)
    if args.job == "views":
        return ViewsJob(args.queue, args.journal, tuple(args.fields), tuple(args.group_by),
                        args.where, args.include_leased, args.as_of_ms)
    return MetricsJob(args.queue, args.window)


def _range(args: argparse.Namespace, parser: argparse.ArgumentParser
           ) -> tuple[int | None, int | None]:
    if args.since is not None and args.start_ms is not None:
        parser.error("give --since or --start-ms, not both")
    if args.until is not None and args.end_ms is not None:
        parser.error("give --until or --end-ms, not both")
    try:
        start, end = parse_range(args.since, args.until, int(time.time() * 1000))
    except TimeRangeError as exc:
        parser.error(str(exc))  # exits 2
    return (start if start is not None else args.start_ms,
            end if end is not None else args.end_ms)


def print_result(result: JobResult) -> None:
    """The plain-text report both front ends print (tab-separated, for scripts)."""
    if result.stream is not None:
        s = result.stream
        print(f"{result.job}: {s.batches} micro-batches, {s.events} new event records")
    elif result.report is not None:
        report = result.report
        print(f"{report.queue}: {report.done} done, {report.pending} pending, "
              f"{len(report.violations)} violations")
        if not report.store_read:
            print("PostgreSQL not compared (no --store): journal and events only",
                  file=sys.stderr)
        for v in report.violations:
            print(f"{v.violation}\t{v.queue}\t{v.bookmark}")
    else:
        for row in result.rows:
            print("\t".join("" if v is None else str(v) for v in row.values()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    source = _source(args, parser)
    if args.stream and not args.checkpoint:
        parser.error("--stream needs --checkpoint DIR")
    stream = (StreamOptions(args.checkpoint, args.available_now, args.trigger)
              if args.stream else None)
    start_ms, end_ms = _range(args, parser)
    result = run_job(_job(args), source,
                     session=SessionOptions(args.master, args.from_submit),
                     start_ms=start_ms, end_ms=end_ms, output=args.output,
                     table=args.table, stream=stream)
    print_result(result)
    return result.exit_status


def run(argv: Sequence[str] | None = None) -> int:
    """`main`, with a failure of the job itself as status 1 (3 means violations)."""
    try:
        return main(argv)
    except QlayerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception:
        traceback.print_exc()
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(run())

