"""Pure DataFrame functions over the events topic and the journals (docs/pipeline.md).

Nothing here reads or writes: every function takes DataFrames and returns a DataFrame, so the
same code runs on hand-built frames in unit tests, on `local[2]` and on a cluster.

``events`` has the columns of the ``Event`` Avro record (docs/protocol.md §11; ``type`` as a
string). ``journal`` has the Kafka source's ``topic``, ``partition``, ``offset`` and
``timestamp`` columns of the queue's underlying topic.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from layer.protocol.records import EventType

__all__ = [
    "OUTCOME_TYPES",
    "Outcome",
    "Violation",
    "counters",
    "entry_events",
    "event_schema",
    "lifecycle",
    "reconcile",
    "violations",
]

#: The events that end an entry (docs/protocol.md §11): exactly one per entry.
OUTCOME_TYPES = (
    EventType.ACKED.value,
    EventType.EXPIRED.value,
    EventType.DELIVERED_AT_MOST_ONCE.value,
    EventType.BARRIER_DELIVERED.value,
)

#: Events after which an entry has left its queue; an outcome must follow at once
#: (REJECTED -> DEAD_LETTERED -> EXPIRED are written in one coordinator iteration).
_LEAVING_TYPES = (EventType.REJECTED.value, EventType.DEAD_LETTERED.value)


class Outcome:
    """Values of the lifecycle's ``outcome`` column."""

    ACKED = "acked"
    DEAD_LETTERED = "dead_lettered"
    EXPIRED = "expired"
    AT_MOST_ONCE = "delivered_at_most_once"
    BARRIER = "barrier_delivered"
    PENDING = "pending"


class Violation:
    """Names of the reconciliation's violations (the ``violation`` column)."""

    #: Two or more ACKED events for one entry.
    ACKED_TWICE = "acked_twice"
    #: Two or more outcome events of which not all are ACKED (e.g. ACKED then EXPIRED).
    SEVERAL_OUTCOMES = "several_outcomes"
    #: A delivery (LEASED or at-most-once) later than the entry's first ACKED, by time or by
    #: delivery count.
    DELIVERED_AFTER_ACK = "delivered_after_ack"
    #: The entry left the queue (REJECTED or DEAD_LETTERED is its last event) but no outcome
    #: followed: the message is neither finished nor pending.
    MISSING_OUTCOME = "missing_outcome"
    #: The entry has events (a delivery, an outcome) but was never ENQUEUED.
    MISSING_ENQUEUED = "missing_enqueued"


def event_schema() -> StructType:
    """The columns `from_avro` gives an ``Event`` (docs/protocol.md §11), for hand-built frames."""
    text, long, integer = StringType(), LongType(), IntegerType()
    fields = [("type", text, False), ("timestamp_ms", long, False),
              ("coordinator_id", text, False), ("coordinator_epoch", long, False),
              ("queue", text, True), ("bookmark", text, True), ("topic", text, True),
              ("partition", integer, True), ("offset", long, True), ("consumer_id", text, True),
              ("session_id", text, True), ("delivery_count", integer, True),
              ("reason", text, True), ("lease_expires_ms", long, True),
              ("available_at_ms", long, True), ("record_timestamp_ms", long, True)]
    return StructType([StructField(name, kind, nullable) for name, kind, nullable in fields])


def _is(kind: EventType) -> Column:
    return F.col("type") == F.lit(kind.value)


def entry_events(events: DataFrame) -> DataFrame:
    """The events about entries (queue and bookmark set), with ENQUEUED deduplicated.

    A coordinator that restarts re-reads its journals from the recovery point and announces
    those entries as ENQUEUED again (docs/coordinator.md), so only the first ENQUEUED of a
    (queue, bookmark) is kept. Every other event is kept as written: a second ACKED is exactly
    what the reconciliation must find.
    """
    entries = events.where(F.col("queue").isNotNull() & F.col("bookmark").isNotNull())
    enqueued = entries.where(_is(EventType.ENQUEUED))
    first = (
        enqueued.groupBy("queue", "bookmark")
        .agg(F.min(F.struct("timestamp_ms", *[c for c in events.columns
                                                if c not in ("queue", "bookmark",
                                                             "timestamp_ms")])).alias("e"))
        .select("queue", "bookmark", "e.*")
        .select(*events.columns)
    )
    return entries.where(~_is(EventType.ENQUEUED)).unionByName(first)


def _per_entry(events: DataFrame) -> DataFrame:
    """One row per (queue, bookmark) with the raw aggregates both jobs build on."""
    delivery = _is(EventType.LEASED) | _is(EventType.DELIVERED_AT_MOST_ONCE)
    outcome = F.col("type").isin(*OUTCOME_TYPES)
    return entry_events(events).groupBy("queue", "bookmark").agg(
        F.first("topic", ignorenulls=True).alias("topic"),
        F.first("partition", ignorenulls=True).alias("partition"),
        F.first("offset", ignorenulls=True).alias("offset"),
        F.min(F.when(_is(EventType.ENQUEUED), F.col("timestamp_ms"))).alias("enqueued_ms"),
        F.min(F.when(_is(EventType.ENQUEUED), F.col("record_timestamp_ms")))
        .alias("record_timestamp_ms"),
        # sort_array orders structs by their first field: deliveries and outcomes in time order.
        F.sort_array(F.collect_list(F.when(delivery, F.struct(
            F.col("timestamp_ms"), F.col("delivery_count"), F.col("consumer_id"),
            F.col("session_id"), F.col("type"),
        )))).alias("deliveries"),
        F.sort_array(F.collect_list(F.when(outcome, F.struct(
            F.col("timestamp_ms"), F.col("type"), F.col("reason"), F.col("consumer_id"),
            F.col("delivery_count"),
        )))).alias("outcomes"),
        F.max(F.when(_is(EventType.DEAD_LETTERED), F.lit(True))).alias("dead_lettered"),
        F.max(F.struct(F.col("timestamp_ms"), F.col("type"))).getField("type")
        .alias("last_type"),
    )


def lifecycle(events: DataFrame) -> DataFrame:
    """One row per (queue, bookmark): when it was enqueued, every delivery, its outcome.

    Columns: queue, bookmark, topic, partition, offset, record_timestamp_ms, enqueued_ms,
    deliveries (array of timestamp_ms, delivery_count, consumer_id, session_id, type in time
    order), delivery_count (how many deliveries), outcome (an `Outcome` value), outcome_reason,
    outcome_ms, outcome_consumer_id, outcome_count, time_in_queue_ms (enqueued to outcome),
    processing_time_ms (last delivery before the outcome to the outcome; null without one).
    """
    # get / try_element_at: out of range is null, not an error, under ANSI mode (Spark 4).
    first = F.get(F.col("outcomes"), 0)
    outcome_ms = first.getField("timestamp_ms")
    kind = first.getField("type")
    before_outcome = F.filter("deliveries", lambda d: d.getField("timestamp_ms") <= outcome_ms)
    return _per_entry(events).select(
        "queue", "bookmark", "topic", "partition", "offset", "record_timestamp_ms",
        "enqueued_ms",
        F.transform("deliveries", lambda d: d.dropFields("type")).alias("deliveries"),
        F.size("deliveries").alias("delivery_count"),
        F.when(F.size("outcomes") == 0, F.lit(Outcome.PENDING))
        .when((kind == EventType.EXPIRED.value) & F.col("dead_lettered").isNotNull(),
              F.lit(Outcome.DEAD_LETTERED))
        .when(kind == EventType.EXPIRED.value, F.lit(Outcome.EXPIRED))
        .when(kind == EventType.ACKED.value, F.lit(Outcome.ACKED))
        .when(kind == EventType.DELIVERED_AT_MOST_ONCE.value, F.lit(Outcome.AT_MOST_ONCE))
        .otherwise(F.lit(Outcome.BARRIER)).alias("outcome"),
        first.getField("reason").alias("outcome_reason"),
        outcome_ms.alias("outcome_ms"),
        first.getField("consumer_id").alias("outcome_consumer_id"),
        F.size("outcomes").alias("outcome_count"),
        (outcome_ms - F.col("enqueued_ms")).alias("time_in_queue_ms"),
        (outcome_ms - F.try_element_at(before_outcome, F.lit(-1)).getField("timestamp_ms"))
        .alias("processing_time_ms"),
    )


def _epoch_ms(column: str) -> Column:
    return F.floor(F.unix_micros(F.col(column)) / 1000).cast("long")


def reconcile(events: DataFrame, journal: DataFrame, queue: str,
              start_ms: int | None = None, end_ms: int | None = None) -> DataFrame:
    """For ``queue``: the status of every journal record in ``[start_ms, end_ms)`` it admitted.

    A journal record is admitted when the queue has events for it (a queue's filter may turn
    records away; those have none and are not the queue's to account for). Each admitted entry
    gets ``status`` ``done`` (exactly one outcome, no violation), ``pending`` (no outcome yet
    and still in the queue: its last event is ENQUEUED, a delivery, a release, a renewal, an
    ended lease or a refused ack) or ``violation``, and ``violations``, the `Violation` names
    that apply. Columns: queue, bookmark, topic, partition, offset, journal_timestamp_ms,
    outcome_count, status, violations.
    """
    records = journal.select("topic", "partition", "offset",
                             _epoch_ms("timestamp").alias("journal_timestamp_ms"))
    if start_ms is not None:
        records = records.where(F.col("journal_timestamp_ms") >= F.lit(start_ms))
    if end_ms is not None:
        records = records.where(F.col("journal_timestamp_ms") < F.lit(end_ms))
    entries = _per_entry(events.where(F.col("queue") == F.lit(queue)))
    joined = entries.join(records.dropDuplicates(["topic", "partition", "offset"]),
                          ["topic", "partition", "offset"], "inner")

    outcome_types = F.transform("outcomes", lambda o: o.getField("type"))
    acks = F.filter("outcomes", lambda o: o.getField("type") == F.lit(EventType.ACKED.value))
    first_ack = F.get(acks, 0)
    delivered_late = F.exists(
        "deliveries",
        lambda d: (d.getField("timestamp_ms") > first_ack.getField("timestamp_ms"))
        | (d.getField("delivery_count") > first_ack.getField("delivery_count")),
    )
    checks = [
        (F.size(acks) >= 2, Violation.ACKED_TWICE),
        ((F.size("outcomes") >= 2)
         & F.exists(outcome_types, lambda t: t != F.lit(EventType.ACKED.value)),
         Violation.SEVERAL_OUTCOMES),
        ((F.size(acks) >= 1) & F.coalesce(delivered_late, F.lit(False)),
         Violation.DELIVERED_AFTER_ACK),
        ((F.size("outcomes") == 0) & F.col("last_type").isin(*_LEAVING_TYPES),
         Violation.MISSING_OUTCOME),
        (F.col("enqueued_ms").isNull(), Violation.MISSING_ENQUEUED),
    ]
    found = F.filter(F.array(*[F.when(cond, F.lit(name)) for cond, name in checks]),
                     lambda v: v.isNotNull())
    return joined.select(
        "queue", "bookmark", "topic", "partition", "offset", "journal_timestamp_ms",
        F.size("outcomes").alias("outcome_count"),
        F.when(F.size(found) > 0, F.lit("violation"))
        .when(F.size("outcomes") == 0, F.lit("pending"))
        .otherwise(F.lit("done")).alias("status"),
        found.alias("violations"),
    )


def violations(reconciled: DataFrame) -> DataFrame:
    """One row per (entry, violation) of a `reconcile` result: queue, bookmark, violation."""
    return reconciled.select(
        "queue", "bookmark", "topic", "partition", "offset",
        F.explode("violations").alias("violation"),
    )


def counters(events: DataFrame) -> DataFrame:
    """Per queue, the coordinator's running totals (``queue_counters``) recomputed from events.

    Same names and meaning as the coordinator's counters: enqueued (entries, ENQUEUED
    deduplicated), delivered (LEASED), redelivered (LEASED with delivery_count > 1), acked,
    released, lease_expired, expired (every EXPIRED, dead letters included), dead_lettered
    (EXPIRED after DEAD_LETTERED).
    """
    e = entry_events(events)

    def count(condition: Column) -> Column:
        return F.count(F.when(condition, F.lit(1)))

    dead = (e.where(_is(EventType.DEAD_LETTERED)).select("queue", "bookmark")
            .distinct().withColumn("dead", F.lit(True)))
    return (
        e.join(dead, ["queue", "bookmark"], "left")
        .groupBy("queue")
        .agg(
            count(_is(EventType.ENQUEUED)).alias("enqueued"),
            count(_is(EventType.LEASED)).alias("delivered"),
            count(_is(EventType.LEASED) & (F.col("delivery_count") > 1)).alias("redelivered"),
            count(_is(EventType.ACKED)).alias("acked"),
            count(_is(EventType.RELEASED)).alias("released"),
            count(_is(EventType.LEASE_EXPIRED)).alias("lease_expired"),
            count(_is(EventType.EXPIRED)).alias("expired"),
            count(_is(EventType.EXPIRED) & F.col("dead").isNotNull()).alias("dead_lettered"),
        )
    )
