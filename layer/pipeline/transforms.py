"""Pure DataFrame functions over the events topic and the journals (docs/pipeline.md).

Nothing here reads or writes: every function takes DataFrames and returns a DataFrame, so the
same code runs on hand-built frames in unit tests, on `local[2]` and on a cluster.

``events`` has the columns of the ``Event`` Avro record (docs/protocol.md §11; ``type`` as a
string). ``journal`` has the Kafka source's ``topic``, ``partition``, ``offset`` and
``timestamp`` columns of the queue's underlying topic.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from layer.pipeline.views import ViewDefinition
from layer.protocol.records import EventType

__all__ = [
    "OUTCOME_TYPES",
    "PERCENTILES",
    "Outcome",
    "StoreState",
    "Violation",
    "available_entries",
    "counters",
    "entry_events",
    "event_schema",
    "lifecycle",
    "metric_samples",
    "metrics",
    "reconcile",
    "store_state",
    "view",
    "violations",
    "window_metrics",
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
    #: A journal record the queue must have admitted (not a delete, and PostgreSQL has a row
    #: for it, or the queue has no filter and admitted records before and after it in its
    #: partition) has no event at all.
    NO_EVENTS = "no_events"
    #: Events name a journal record that does not exist (an offset inside the journal's span
    #: that is not a record, or past its end).
    UNKNOWN_RECORD = "unknown_record"
    #: PostgreSQL holds the entry as ACKED, and no ACKED event says so.
    STORE_ACKED_NO_ACKED_EVENT = "store_acked_no_acked_event"
    #: PostgreSQL says the entry is done (below the recovery point, or an EXPIRED row) and
    #: the events give it no outcome.
    STORE_DONE_NO_OUTCOME = "store_done_no_outcome"
    #: The events give the entry an outcome; PostgreSQL still has it leased or available.
    OUTCOME_NOT_IN_STORE = "outcome_not_in_store"
    #: Pending in both, but one says leased and the other available.
    LEASE_DIFFERS = "lease_differs"


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


# Order of an entry's lease-related events within one millisecond and delivery: a lease is
# granted after the entry was (re)admitted, renewed after it was granted, ended after both.
_LEASE_STEP = {EventType.ENQUEUED.value: 0, EventType.REDRIVEN.value: 0,
               EventType.LEASED.value: 1, EventType.RENEWED.value: 2,
               EventType.RELEASED.value: 3, EventType.LEASE_EXPIRED.value: 3}
_HOLDING = (EventType.LEASED.value, EventType.RENEWED.value)


def _lease_step(kind: Column) -> Column:
    step = F.create_map(*[F.lit(x) for pair in _LEASE_STEP.items() for x in pair])
    return step[kind]


def _last_lease_event() -> Column:
    """An aggregate: the type of the entry's last lease-related event (LEASED or RENEWED:
    it is leased)."""
    return F.max(F.when(F.col("type").isin(*_LEASE_STEP), F.struct(
        F.col("timestamp_ms"), F.coalesce(F.col("delivery_count"), F.lit(0)),
        _lease_step(F.col("type")), F.col("type").alias("type")))).getField("type")


def _first_enqueued_order(events: DataFrame) -> list[str]:
    """The columns by which `entry_events` picks an entry's first ENQUEUED: its time, then
    the other columns as a tie-break."""
    return ["timestamp_ms", *[c for c in events.columns
                              if c not in ("queue", "bookmark", "timestamp_ms")]]


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
        .agg(F.min(F.struct(*_first_enqueued_order(events))).alias("e"))
        .select("queue", "bookmark", "e.*")
        .select(*events.columns)
    )
    return entries.where(~_is(EventType.ENQUEUED)).unionByName(first)


def _per_entry(events: DataFrame) -> DataFrame:
    """One row per (queue, bookmark) with the raw aggregates every job builds on.

    One aggregation over the events as read: the ENQUEUED deduplication of `entry_events`
    is folded in (the first ENQUEUED is an aggregate too, and the aggregates that look at
    ENQUEUED take only it), rather than a second aggregation and a union before this one.
    """
    delivery = _is(EventType.LEASED) | _is(EventType.DELIVERED_AT_MOST_ONCE)
    outcome = F.col("type").isin(*OUTCOME_TYPES)
    enqueued = _is(EventType.ENQUEUED)
    later = ~enqueued  # every event but the ENQUEUEDs, which count once (the first)
    first = F.col("first_enqueued")
    entries = events.where(F.col("queue").isNotNull() & F.col("bookmark").isNotNull())
    per = entries.groupBy("queue", "bookmark").agg(
        F.first("topic", ignorenulls=True).alias("topic"),
        F.first("partition", ignorenulls=True).alias("partition"),
        F.first("offset", ignorenulls=True).alias("offset"),
        F.min(F.when(enqueued, F.struct(*_first_enqueued_order(events))))
        .alias("first_enqueued"),
        # sort_array orders structs by their first field: deliveries and outcomes in time order.
        F.sort_array(F.collect_list(F.when(delivery, F.struct(
            F.col("timestamp_ms"), F.col("delivery_count"), F.col("consumer_id"),
            F.col("session_id"), F.col("type"),
        )))).alias("deliveries"),
        F.sort_array(F.collect_list(F.when(outcome, F.struct(
            F.col("timestamp_ms"), F.col("type"), F.col("reason"), F.col("consumer_id"),
            F.col("delivery_count"),
        )))).alias("outcomes"),
        # The DEAD_LETTERED event's reason ("" without one); null when not dead-lettered.
        F.max(F.when(_is(EventType.DEAD_LETTERED), F.coalesce(F.col("reason"), F.lit(""))))
        .alias("dead_lettered"),
        F.max(F.when(later, F.struct(F.col("timestamp_ms"), F.col("type"))))
        .alias("last_later"),
        F.max(F.when(later & F.col("type").isin(*_LEASE_STEP), F.struct(
            F.col("timestamp_ms"), F.coalesce(F.col("delivery_count"), F.lit(0)).alias("count"),
            _lease_step(F.col("type")).alias("step"), F.col("type").alias("type"))))
        .alias("lease_later"),
    )
    enqueued_type = F.lit(EventType.ENQUEUED.value)
    # greatest() skips nulls: the later events' maximum, or the first ENQUEUED, whichever is
    # later (the same maximum as over `entry_events`).
    last_type = F.greatest(F.col("last_later"), F.when(first.isNotNull(), F.struct(
        first.getField("timestamp_ms").alias("timestamp_ms"), enqueued_type.alias("type"))))
    lease_state = F.greatest(F.col("lease_later"), F.when(first.isNotNull(), F.struct(
        first.getField("timestamp_ms").alias("timestamp_ms"),
        F.coalesce(first.getField("delivery_count"), F.lit(0)).alias("count"),
        _lease_step(enqueued_type).alias("step"), enqueued_type.alias("type"))))
    return per.select(
        "queue", "bookmark", "topic", "partition", "offset",
        first.getField("timestamp_ms").alias("enqueued_ms"),
        first.getField("record_timestamp_ms").alias("record_timestamp_ms"),
        "deliveries", "outcomes", "dead_lettered",
        last_type.getField("type").alias("last_type"),
        lease_state.getField("type").alias("lease_state"),
    )


def lifecycle(events: DataFrame) -> DataFrame:
    """One row per (queue, bookmark): when it was enqueued, every delivery, its outcome.

    Columns: queue, bookmark, topic, partition, offset, record_timestamp_ms, enqueued_ms,
    deliveries (array of timestamp_ms, delivery_count, consumer_id, session_id, type in time
    order), delivery_count (how many deliveries), outcome (an `Outcome` value), outcome_reason,
    outcome_ms, outcome_consumer_id, outcome_count, time_in_queue_ms (enqueued to outcome),
    processing_time_ms (last delivery before the outcome to the outcome; null without one).
    """
    return _lifecycle_rows(_per_entry(events))


def _lifecycle_rows(per: DataFrame, *keep: str) -> DataFrame:
    """`lifecycle` from `_per_entry`'s rows, with the ``keep`` columns of those too."""
    # get / try_element_at: out of range is null, not an error, under ANSI mode (Spark 4).
    first = F.get(F.col("outcomes"), 0)
    outcome_ms = first.getField("timestamp_ms")
    kind = first.getField("type")
    before_outcome = F.filter("deliveries", lambda d: d.getField("timestamp_ms") <= outcome_ms)
    # An at-most-once delivery the broker refused as too large (a later DEAD_LETTERED, no
    # second outcome, docs/protocol.md §11) was dead-lettered, not delivered.
    refused = ((kind == EventType.DELIVERED_AT_MOST_ONCE.value)
               & F.col("dead_lettered").isNotNull())
    return per.select(
        "queue", "bookmark", "topic", "partition", "offset", "record_timestamp_ms",
        "enqueued_ms",
        F.transform("deliveries", lambda d: d.dropFields("type")).alias("deliveries"),
        F.size("deliveries").alias("delivery_count"),
        F.when(F.size("outcomes") == 0, F.lit(Outcome.PENDING))
        .when(((kind == EventType.EXPIRED.value) & F.col("dead_lettered").isNotNull())
              | refused, F.lit(Outcome.DEAD_LETTERED))
        .when(kind == EventType.EXPIRED.value, F.lit(Outcome.EXPIRED))
        .when(kind == EventType.ACKED.value, F.lit(Outcome.ACKED))
        .when(kind == EventType.DELIVERED_AT_MOST_ONCE.value, F.lit(Outcome.AT_MOST_ONCE))
        .otherwise(F.lit(Outcome.BARRIER)).alias("outcome"),
        F.when(refused, F.col("dead_lettered")).otherwise(first.getField("reason"))
        .alias("outcome_reason"),
        outcome_ms.alias("outcome_ms"),
        first.getField("consumer_id").alias("outcome_consumer_id"),
        F.size("outcomes").alias("outcome_count"),
        (outcome_ms - F.col("enqueued_ms")).alias("time_in_queue_ms"),
        (outcome_ms - F.try_element_at(before_outcome, F.lit(-1)).getField("timestamp_ms"))
        .alias("processing_time_ms"),
        *keep,
    )


def _epoch_ms(column: str) -> Column:
    return F.floor(F.unix_micros(F.col(column)) / 1000).cast("long")


class StoreState:
    """Values of `reconcile`'s ``store_state`` column: an entry as PostgreSQL has it."""

    #: Below its queue's recovery point, or an ACKED or EXPIRED row.
    DONE = "done"
    #: A LEASED row (an `entries` row or a run), the latest write of the entry.
    LEASED = "leased"
    #: Anything else: an AVAILABLE row, or no row at or above the recovery point.
    AVAILABLE = "available"


def store_state(state: DataFrame) -> DataFrame:
    """PostgreSQL's final state of a queue's entries, from the rows of
    `layer.store.reports.final_state_query` (kind, topic, partition, offset, state, seq).

    The storage model (docs/storage.md): per partition a recovery point below which every
    entry is done and no row is kept; above it, the latest write (highest ``seq``) of an entry
    wins, whether an `entries` row or one offset of an `entry_runs` run. Columns: topic,
    partition, recovery_point (per partition), offset, store_row (the entry's latest stored
    state; null for the recovery-point rows and for an entry with no row).
    """
    points = (state.where(F.col("kind") == F.lit("recovery_point"))
              .groupBy("topic", "partition").agg(F.max("offset").alias("recovery_point")))
    rows = (state.where(F.col("kind") == F.lit("entry"))
            .groupBy("topic", "partition", "offset")
            .agg(F.max_by("state", "seq").alias("store_row")))
    return (points.select("topic", "partition", "recovery_point",
                          F.lit(None).cast("long").alias("offset"),
                          F.lit(None).cast("string").alias("store_row"))
            .unionByName(rows.select("topic", "partition",
                                     F.lit(None).cast("long").alias("recovery_point"),
                                     "offset", "store_row")))


def reconcile(events: DataFrame, journal: DataFrame, queue: str,
              start_ms: int | None = None, end_ms: int | None = None,
              store: DataFrame | None = None, queue_has_filter: bool | None = None
              ) -> DataFrame:
    """For ``queue``: the status of every journal record in ``[start_ms, end_ms)`` it admitted,
    against the events and, given ``store`` (`store_state`), PostgreSQL's final state.

    A journal record is admitted when the queue has events for it. Each admitted entry gets
    ``status`` ``done`` (exactly one outcome, no violation), ``pending`` (no outcome yet and
    still in the queue: its last event is ENQUEUED, a delivery, a release, a renewal, an ended
    lease or a refused ack) or ``violation``, and ``violations``, the `Violation` names that
    apply. Two kinds of rows name what exists in one source only:

    - a journal record with no events that the queue must have admitted (not a delete, and
      PostgreSQL has a row for it, or the queue has no filter, ``queue_has_filter`` False, and
      admitted records before and after it in its partition): ``no_events``;
    - events for a record the journal does not have (an offset inside the span of the range
      read, or past the journal's end when the range is open): ``unknown_record``.

    With ``store``, each entry's ``store_state`` (`StoreState`) is compared with what the
    events say: ``store_acked_no_acked_event``, ``store_done_no_outcome``,
    ``outcome_not_in_store``, ``lease_differs``. Columns: queue, bookmark, topic, partition,
    offset, journal_timestamp_ms, outcome_count, store_state, status, violations.
    """
    keys = ["topic", "partition", "offset"]
    records = journal.select("topic", "partition", "offset",
                             _epoch_ms("timestamp").alias("journal_timestamp_ms"),
                             F.col("value").isNull().alias("tombstone"))
    if start_ms is not None:
        records = records.where(F.col("journal_timestamp_ms") >= F.lit(start_ms))
    if end_ms is not None:
        records = records.where(F.col("journal_timestamp_ms") < F.lit(end_ms))
    records = records.dropDuplicates(keys).withColumn("in_journal", F.lit(True))
    entries = (_per_entry(events.where(F.col("queue") == F.lit(queue)))
               .withColumn("in_events", F.lit(True)))
    joined = entries.join(records, keys, "full_outer")
    # Per partition: the span of the journal read, and of the records the queue admitted. A
    # window over the joined rows, not an aggregation joined back: that read the events, and
    # decoded and aggregated them, a second time (docs/pipeline.md "Speed"). A row without a
    # topic or partition has no span (it matched no partition's row in that join).
    partition = Window.partitionBy("topic", "partition")
    placed = F.col("topic").isNotNull() & F.col("partition").isNotNull()

    def span(value: Column, name: str) -> Column:
        return F.when(placed, value.over(partition)).alias(name)

    admitted = F.col("in_journal") & F.col("in_events")
    joined = joined.select(
        "*",
        span(F.min(F.when(F.col("in_journal"), F.col("offset"))), "journal_lo"),
        span(F.max(F.when(F.col("in_journal"), F.col("offset"))), "journal_hi"),
        span(F.min(F.when(admitted, F.col("offset"))), "admitted_lo"),
        span(F.max(F.when(admitted, F.col("offset"))), "admitted_hi"))
    if store is not None:
        points = store.where(F.col("recovery_point").isNotNull()).select(
            "topic", "partition", "recovery_point")
        rows = store.where(F.col("offset").isNotNull()).select(*keys, "store_row")
        joined = (joined.join(points, ["topic", "partition"], "left")
                  .join(rows, keys, "left"))
        below = F.coalesce(F.col("offset") < F.col("recovery_point"), F.lit(False))
        row = F.col("store_row")
        state = (F.when(below | row.isin("ACKED", "EXPIRED"), F.lit(StoreState.DONE))
                 .when(row == F.lit("LEASED"), F.lit(StoreState.LEASED))
                 .otherwise(F.lit(StoreState.AVAILABLE)))
    else:
        joined = joined.withColumn("store_row", F.lit(None).cast("string"))
        state = F.lit(None).cast("string")
    joined = joined.withColumn("store_state", state)

    in_journal = F.coalesce(F.col("in_journal"), F.lit(False))
    in_events = F.coalesce(F.col("in_events"), F.lit(False))
    inside = ((F.col("offset") >= F.col("journal_lo")) & (F.col("offset") <= F.col("journal_hi")))
    if end_ms is None:  # read to the journal's end: an offset past it was never written
        inside = inside | (F.col("offset") > F.col("journal_hi"))
    unknown = in_events & ~in_journal & F.coalesce(inside, F.lit(False))
    between = ((F.col("offset") > F.col("admitted_lo")) & (F.col("offset") < F.col("admitted_hi")))
    # A row in PostgreSQL means the entry was delivered: it has events whatever the filter.
    must_admit = ~F.coalesce(F.col("tombstone"), F.lit(True)) & (
        F.col("store_row").isNotNull()
        | (F.lit(queue_has_filter is False) & F.coalesce(between, F.lit(False))))
    no_events = in_journal & ~in_events & must_admit
    joined = joined.where((in_journal & in_events) | unknown | no_events)

    outcomes = F.coalesce(F.col("outcomes"), F.array())
    deliveries = F.coalesce(F.col("deliveries"), F.array())
    outcome_types = F.transform(outcomes, lambda o: o.getField("type"))
    acks = F.filter(outcomes, lambda o: o.getField("type") == F.lit(EventType.ACKED.value))
    first_ack = F.get(acks, 0)
    delivered_late = F.exists(
        deliveries,
        lambda d: (d.getField("timestamp_ms") > first_ack.getField("timestamp_ms"))
        | (d.getField("delivery_count") > first_ack.getField("delivery_count")),
    )
    has_outcome = F.size(outcomes) > 0
    events_leased = F.coalesce(F.col("lease_state").isin(*_HOLDING), F.lit(False))
    leaving = F.coalesce(F.col("last_type").isin(*_LEAVING_TYPES), F.lit(False))
    store_state_col = F.col("store_state")
    both = in_journal & in_events  # the store is compared on entries that exist in all three
    checks = [
        (F.size(acks) >= 2, Violation.ACKED_TWICE),
        ((F.size(outcomes) >= 2)
         & F.exists(outcome_types, lambda t: t != F.lit(EventType.ACKED.value)),
         Violation.SEVERAL_OUTCOMES),
        ((F.size(acks) >= 1) & F.coalesce(delivered_late, F.lit(False)),
         Violation.DELIVERED_AFTER_ACK),
        (in_events & ~has_outcome & leaving, Violation.MISSING_OUTCOME),
        (in_events & F.col("enqueued_ms").isNull(), Violation.MISSING_ENQUEUED),
        (no_events, Violation.NO_EVENTS),
        (unknown, Violation.UNKNOWN_RECORD),
        (both & (F.col("store_row") == F.lit("ACKED")) & (F.size(acks) == 0),
         Violation.STORE_ACKED_NO_ACKED_EVENT),
        (both & (store_state_col == F.lit(StoreState.DONE)) & ~has_outcome
         & ~F.coalesce(F.col("store_row") == F.lit("ACKED"), F.lit(False)),
         Violation.STORE_DONE_NO_OUTCOME),
        (both & has_outcome & store_state_col.isin(StoreState.LEASED, StoreState.AVAILABLE),
         Violation.OUTCOME_NOT_IN_STORE),
        (both & ~has_outcome & ~leaving
         & store_state_col.isin(StoreState.LEASED, StoreState.AVAILABLE)
         & ((store_state_col == F.lit(StoreState.LEASED)) != events_leased),
         Violation.LEASE_DIFFERS),
    ]
    found = F.filter(F.array(*[F.when(F.coalesce(cond, F.lit(False)), F.lit(name))
                               for cond, name in checks]),
                     lambda v: v.isNotNull())
    bookmark = F.coalesce(F.col("bookmark"), F.concat_ws(
        "/", F.col("topic"), F.col("partition").cast("string"), F.col("offset").cast("string")))
    return joined.select(
        F.lit(queue).alias("queue"), bookmark.alias("bookmark"), "topic", "partition", "offset",
        "journal_timestamp_ms", F.size(outcomes).alias("outcome_count"), "store_state",
        F.when(F.size(found) > 0, F.lit("violation"))
        .when(~has_outcome, F.lit("pending"))
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
    released, lease_expired, rejected (EXPIRED after REJECTED), expired (every other EXPIRED,
    dead letters included), dead_lettered (DEAD_LETTERED: with an EXPIRED, or alone after an
    at-most-once delivery the broker refused as too large).
    """
    e = entry_events(events)

    def count(condition: Column) -> Column:
        return F.count(F.when(condition, F.lit(1)))

    def marked(kind: EventType, column: str) -> DataFrame:
        return (e.where(_is(kind)).select("queue", "bookmark").distinct()
                .withColumn(column, F.lit(True)))

    expired = _is(EventType.EXPIRED)
    return (
        e.join(marked(EventType.REJECTED, "rejected_by"), ["queue", "bookmark"], "left")
        .groupBy("queue")
        .agg(
            count(_is(EventType.ENQUEUED)).alias("enqueued"),
            count(_is(EventType.LEASED)).alias("delivered"),
            count(_is(EventType.LEASED) & (F.col("delivery_count") > 1)).alias("redelivered"),
            count(_is(EventType.ACKED)).alias("acked"),
            count(_is(EventType.RELEASED)).alias("released"),
            count(_is(EventType.LEASE_EXPIRED)).alias("lease_expired"),
            count(expired & F.col("rejected_by").isNotNull()).alias("rejected"),
            count(expired & F.col("rejected_by").isNull()).alias("expired"),
            # One DEAD_LETTERED per dead-lettered entry: with its EXPIRED, or alone after an
            # at-most-once delivery the broker refused.
            count(_is(EventType.DEAD_LETTERED)).alias("dead_lettered"),
        )
    )


def available_entries(events: DataFrame, as_of_ms: int, include_leased: bool = False
                      ) -> DataFrame:
    """The entries waiting in their queue at ``as_of_ms``, from the events written up to then.

    An entry is *pending* when it has no outcome and has not left its queue (a REJECTED or
    DEAD_LETTERED last event means its EXPIRED is on the way); it is *available* when it is
    also not leased (its last lease event is not LEASED or RENEWED) and not delayed (the
    ``available_at_ms`` of its last ENQUEUED or RELEASED is not after ``as_of_ms``). With
    ``include_leased`` the leased and delayed entries are kept too (every pending entry).

    Columns: queue, bookmark, topic, partition, offset, enqueued_ms, record_timestamp_ms,
    delivery_count, leased (bool), available_at_ms.
    """
    e = entry_events(events.where(F.col("timestamp_ms") <= F.lit(as_of_ms)))
    delay_event = _is(EventType.ENQUEUED) | _is(EventType.RELEASED)
    per_entry = e.groupBy("queue", "bookmark").agg(
        F.first("topic", ignorenulls=True).alias("topic"),
        F.first("partition", ignorenulls=True).alias("partition"),
        F.first("offset", ignorenulls=True).alias("offset"),
        F.min(F.when(_is(EventType.ENQUEUED), F.col("timestamp_ms"))).alias("enqueued_ms"),
        F.min(F.when(_is(EventType.ENQUEUED), F.col("record_timestamp_ms")))
        .alias("record_timestamp_ms"),
        F.max(F.when(_is(EventType.LEASED), F.col("delivery_count"))).alias("delivery_count"),
        F.count(F.when(F.col("type").isin(*OUTCOME_TYPES, *_LEAVING_TYPES), F.lit(1)))
        .alias("finished"),
        _last_lease_event().alias("lease_state"),
        F.max(F.when(delay_event, F.struct(F.col("timestamp_ms"), F.col("available_at_ms"))))
        .getField("available_at_ms").alias("available_at_ms"),
    )
    pending = per_entry.where((F.col("finished") == 0) & F.col("enqueued_ms").isNotNull())
    pending = pending.withColumn("leased", F.col("lease_state").isin(*_HOLDING))
    if not include_leased:
        delayed = F.coalesce(F.col("available_at_ms") > F.lit(as_of_ms), F.lit(False))
        pending = pending.where(~F.col("leased") & ~delayed)
    return pending.select("queue", "bookmark", "topic", "partition", "offset", "enqueued_ms",
                          "record_timestamp_ms", "delivery_count", "leased", "available_at_ms")


def view(entries: DataFrame, journal: DataFrame, definition: ViewDefinition) -> DataFrame:
    """An AMPS view over ``entries`` (`available_entries`): the definition's fields per queue
    and group, computed over the entries' journal payloads (JSON documents).

    ``journal`` has the Kafka source's topic, partition, offset and value columns; entries
    whose record is not in it are left out (read the journal from the oldest entry's record
    time). Columns: queue, then the definition's fields in order.
    """
    records = journal.select("topic", "partition", "offset",
                             F.col("value").cast("string").alias("payload"))
    rows = entries.join(records.dropDuplicates(["topic", "partition", "offset"]),
                        ["topic", "partition", "offset"], "inner")
    if definition.where is not None:
        # A filter matches only when it is exactly true (null is no match), as in AMPS.
        rows = rows.where(F.coalesce(definition.where, F.lit(False)))
    keys = [f"_group{i}" for i in range(len(definition.group_by))]
    rows = rows.select("queue", "payload", *[c.alias(k)
                                             for c, k in zip(definition.group_by, keys,
                                                             strict=True)])
    aggregates = [f.column for f in definition.fields if f.group is None]
    if not aggregates:  # grouping fields only: the distinct groups
        aggregates = [F.count(F.lit(1)).alias("_rows")]
    grouped = rows.groupBy("queue", *keys).agg(*aggregates)
    return grouped.select("queue", *[
        F.col(f.name) if f.group is None else F.col(keys[f.group]).alias(f.name)
        for f in definition.fields])


#: The latency percentiles `metrics` reports, with their column suffixes.
PERCENTILES = ((0.5, "p50"), (0.99, "p99"), (0.999, "p999"))


def metrics(events: DataFrame, window: str = "1 minute") -> DataFrame:
    """Per queue and tumbling ``window`` (a Spark interval: ``1 minute``, ``10 seconds``): the
    SLA figures, each counted in the window in which it happened.

    Counts: enqueued, delivered (LEASED and at-most-once deliveries), redelivered (LEASED with
    delivery_count > 1), acked, dead_lettered, expired (EXPIRED that was not a dead letter),
    outcomes. Rates: throughput_per_s (acked / window length), redelivery_rate (redelivered /
    delivered), dead_letter_rate (dead_lettered / outcomes). Latencies in ms with
    `percentile_approx` (``_p50``, ``_p99``, ``_p999``): wait (enqueue to first delivery, in
    the window of the delivery), time_in_queue (enqueue to outcome, window of the outcome),
    processing (the acked delivery to its ack, window of the ack). ``consumers``: each
    consumer's acks and share of the window's acks, most first.
    """
    return window_metrics(metric_samples(events, window))


def metric_samples(events: DataFrame, window: str = "1 minute") -> DataFrame:
    """The samples `metrics` aggregates, one row per sample: queue, bookmark (the entry it
    comes from), window (the tumbling ``window`` it falls in), at_ms, measure (``enqueued``,
    ``wait``, ``time_in_queue``, ``processing``, ``delivered``, ``acked``, ``dead_lettered``,
    ``expired``, ``outcome``), value (the latency in ms; a delivery's count) and consumer_id (an
    ack's consumer). Every sample is a function of one entry's events, so the incremental
    stream recomputes only the entries a micro-batch touches (docs/pipeline.md).
    """
    # One per-entry aggregation gives every sample: the first ENQUEUED, each delivery, each
    # outcome (classified with the entry's DEAD_LETTERED), and the latencies of its lifecycle.
    table = _lifecycle_rows(_per_entry(events), "outcomes", "dead_lettered")
    first_delivery = F.get(F.col("deliveries"), 0).getField("timestamp_ms")
    acked = F.col("outcome") == F.lit(Outcome.ACKED)

    def sample(at: Column, measure: str | Column, value: Column | None = None,
               consumer: Column | None = None) -> Column:
        kind = F.lit(measure) if isinstance(measure, str) else measure
        return F.struct(
            at.cast("long").alias("at_ms"), kind.alias("measure"),
            (value if value is not None else F.lit(None)).cast("double").alias("value"),
            (consumer if consumer is not None else F.lit(None)).cast("string")
            .alias("consumer_id"))

    def outcome_sample(o: Column) -> Column:
        kind = o.getField("type")
        expired = kind == F.lit(EventType.EXPIRED.value)
        is_ack = kind == F.lit(EventType.ACKED.value)
        # An at-most-once delivery refused as too large is dead-lettered after its outcome.
        dead = ((expired | (kind == F.lit(EventType.DELIVERED_AT_MOST_ONCE.value)))
                & F.col("dead_lettered").isNotNull())
        measure = (F.when(is_ack, F.lit("acked"))
                   .when(dead, F.lit("dead_lettered"))
                   .when(expired, F.lit("expired")).otherwise(F.lit("outcome")))
        return sample(o.getField("timestamp_ms"), measure, None,
                      F.when(is_ack, o.getField("consumer_id")))

    once = F.filter(F.array(
        F.when(F.col("enqueued_ms").isNotNull(), sample(F.col("enqueued_ms"), "enqueued")),
        F.when(first_delivery.isNotNull(),
               sample(first_delivery, "wait", first_delivery - F.col("enqueued_ms"))),
        F.when(F.col("time_in_queue_ms").isNotNull(),
               sample(F.col("outcome_ms"), "time_in_queue", F.col("time_in_queue_ms"))),
        F.when(acked & F.col("processing_time_ms").isNotNull(),
               sample(F.col("outcome_ms"), "processing", F.col("processing_time_ms"))),
    ), lambda x: x.isNotNull())
    every = F.concat(
        once,
        F.transform("deliveries", lambda d: sample(d.getField("timestamp_ms"), "delivered",
                                                   d.getField("delivery_count"))),
        F.transform("outcomes", outcome_sample),
    )
    return (
        table.select("queue", "bookmark", F.explode(every).alias("s"))
        .select("queue", "bookmark", "s.*")
        .withColumn("window", F.window(F.timestamp_millis(F.col("at_ms")), window))
    )


def window_metrics(samples: DataFrame) -> DataFrame:
    """`metrics` from its samples (`metric_samples`): one row per queue and window."""

    def count(measure: str, extra: Column | None = None) -> Column:
        condition = F.col("measure") == F.lit(measure)
        if extra is not None:
            condition = condition & extra
        return F.count(F.when(condition, F.lit(1)))

    def latency(measure: str) -> list[Column]:
        values = F.percentile_approx(
            F.when(F.col("measure") == F.lit(measure), F.col("value")),
            [q for q, _ in PERCENTILES])
        return [values[i].alias(f"{measure}_ms_{suffix}")
                for i, (_, suffix) in enumerate(PERCENTILES)]

    # One pass over the samples: grouped by window and, for an "acked" sample, its consumer
    # (the other samples, whose percentiles need them all together, in one group of their
    # own), then the few groups of a window summed. A second aggregation of the samples for
    # the consumers' shares would compute the samples (read, decode, aggregate) twice.
    is_ack = (F.col("measure") == F.lit("acked")).alias("is_ack")
    counted = ("enqueued", "delivered", "redelivered", "acked", "dead_lettered", "expired",
               "other")
    latencies = [f"{m}_ms_{suffix}" for m in ("wait", "time_in_queue", "processing")
                 for _, suffix in PERCENTILES]
    by_group = samples.groupBy("queue", "window", is_ack,
                               F.when(is_ack, F.col("consumer_id")).alias("consumer_id")).agg(
        count("enqueued").alias("enqueued"),
        count("delivered").alias("delivered"),
        count("delivered", F.col("value") > 1).alias("redelivered"),
        count("acked").alias("acked"),
        count("dead_lettered").alias("dead_lettered"),
        count("expired").alias("expired"),
        count("outcome").alias("other"),
        *latency("wait"), *latency("time_in_queue"), *latency("processing"),
    )
    totals = by_group.groupBy("queue", "window").agg(
        *[F.sum(c).alias(c) for c in counted],
        *[F.max(F.when(~F.col("is_ack"), F.col(c))).alias(c) for c in latencies],
        F.sort_array(F.collect_list(F.when(F.col("is_ack"), F.struct(
            F.col("acked").alias("acks"), F.col("consumer_id")))), asc=False)
        .alias("by_consumer"),
    )
    outcomes = F.col("acked") + F.col("dead_lettered") + F.col("expired") + F.col("other")
    seconds = (F.unix_micros(F.col("window.end")) - F.unix_micros(F.col("window.start"))) / 1e6
    return (
        totals.select(
            "queue",
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "enqueued", "delivered", "redelivered", "acked", "dead_lettered", "expired",
            outcomes.alias("outcomes"),
            (F.col("acked") / seconds).alias("throughput_per_s"),
            F.when(F.col("delivered") > 0, F.col("redelivered") / F.col("delivered"))
            .alias("redelivery_rate"),
            F.when(outcomes > 0, F.col("dead_lettered") / outcomes).alias("dead_letter_rate"),
            *latencies,
            F.transform(F.col("by_consumer"), lambda c: F.struct(
                c.getField("consumer_id").alias("consumer_id"),
                c.getField("acks").alias("acks"),
                (c.getField("acks") / F.col("acked")).alias("share"),
            )).alias("consumers"),
        )
    )
