"""What one micro-batch of the incremental `metrics` and `views` streams changes
(docs/pipeline.md, "Incremental metrics and views").

The per-entry step (`layer.pipeline.entrystate`) hands a micro-batch every event of each entry
it has new events for, the ones kept from earlier micro-batches marked ``fresh = false``. From
those, with the batch job's own transforms, this module says which samples and windows, which
view members and groups, change; `layer.pipeline.jobs` reads and writes the parts that hold
them (`layer.pipeline.checkpoint.PartStore`) and the output. Pure: DataFrames in, DataFrames
out, and plain Python for the rest.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Final

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StructField, StructType

from layer.pipeline import transforms
from layer.pipeline.checkpoint import PART
from layer.pipeline.io import BATCH_ID_COLUMNS, DELETED
from layer.pipeline.views import ViewDefinition

__all__ = [
    "BUCKETS",
    "DELAY_SCHEMA",
    "STEP_COLUMNS",
    "candidate_parts",
    "changed_windows",
    "delayed",
    "entry_events",
    "member_keys",
    "offset_rounds",
    "pending_keys",
    "replace_entries",
    "view_key_columns",
    "view_members",
    "view_of_members",
    "window_ms",
    "window_samples",
    "with_bucket",
    "with_tombstones",
]

#: Columns the per-entry step adds to each event it hands over: whether the event is new in
#: this micro-batch, and the watermark the micro-batch runs with (epoch ms).
STEP_COLUMNS: Final = ("fresh", "watermark_ms")
#: The index of delayed view members (`delayed`).
DELAY_SCHEMA: Final = StructType([StructField(PART, LongType()), StructField("bucket", LongType()),
                                  StructField("available_at_ms", LongType())])
#: How many parts a view's members are spread over, by a hash of their group: a micro-batch
#: reads and rewrites the buckets of the groups its entries belong to.
BUCKETS: Final = 64

_UNITS: Final = {"millisecond": 1, "second": 1000, "minute": 60_000, "hour": 3_600_000,
                 "day": 86_400_000, "week": 604_800_000}
_LENGTH: Final = re.compile(r"(\d+)\s+(millisecond|second|minute|hour|day|week)s?", re.IGNORECASE)


def window_ms(window: str) -> int:
    """A metrics window (``1 minute``, ``1 hour 30 minutes``: what `jobs.check_window`
    accepts) in milliseconds, as Spark's tumbling `window()` measures it (a day is 24 hours)."""
    found = _LENGTH.findall(window)
    if not found:
        raise ValueError(f"window {window!r} has no length")
    return sum(int(n) * _UNITS[unit.lower()] for n, unit in found)


def offset_rounds(offsets: Iterable[tuple[str, int, int]], max_gap: int = 1000,
                  max_rounds: int = 8) -> list[dict[tuple[str, int], tuple[int, int]]]:
    """Journal records to read, as rounds of ``{(topic, partition): (start, end)}`` (``end``
    exclusive): the Kafka source reads one range per partition per read, so a round is one
    read. Each partition's offsets are split into runs where two of them are more than
    ``max_gap`` apart, at most ``max_rounds`` runs (split at the widest gaps): a queue's head
    and its tail are two runs, not a read of everything between."""
    by_partition: dict[tuple[str, int], list[int]] = {}
    for topic, partition, offset in offsets:
        by_partition.setdefault((topic, partition), []).append(offset)
    rounds: list[dict[tuple[str, int], tuple[int, int]]] = []
    for key, found in sorted(by_partition.items()):
        ordered = sorted(set(found))
        gaps = sorted(((ordered[i + 1] - ordered[i], i) for i in range(len(ordered) - 1)
                       if ordered[i + 1] - ordered[i] > max_gap), reverse=True)
        cuts = sorted(i for _, i in gaps[:max_rounds - 1])
        starts = [0, *[i + 1 for i in cuts]]
        ends = [*[i + 1 for i in cuts], len(ordered)]
        for n, (a, b) in enumerate(zip(starts, ends, strict=True)):
            if n == len(rounds):
                rounds.append({})
            rounds[n][key] = (ordered[a], ordered[b - 1] + 1)
    return rounds


def entry_events(touched: DataFrame, before: bool = False) -> DataFrame:
    """The events of the touched entries, as the batch jobs read them (the event columns
    only): all of them, or with ``before`` only those kept from earlier micro-batches (the
    entries as the previous micro-batch left them)."""
    if before:
        touched = touched.where(~F.col("fresh"))
    return touched.drop(*BATCH_ID_COLUMNS, *STEP_COLUMNS)


# ------------------------------------------------------------------------------------------
# metrics: samples kept per window
# ------------------------------------------------------------------------------------------


def window_samples(events: DataFrame, window: str) -> DataFrame:
    """`transforms.metric_samples` with each sample's part: its window's start (epoch ms)."""
    samples = transforms.metric_samples(events, window)
    return samples.withColumn(PART, F.unix_millis(F.col("window.start")))


def changed_windows(after: DataFrame, before: DataFrame) -> DataFrame:
    """(queue, part) of every window where the touched entries' samples differ between
    ``before`` and ``after`` (`window_samples` of the entries without, and with, this
    micro-batch's events). A window whose samples did not change keeps its figures: an entry
    that only got an ack changes the ack's window, not the one of its enqueue."""
    gone = before.exceptAll(after)
    added = after.exceptAll(before)
    return gone.unionByName(added).select("queue", PART).distinct()


def replace_entries(stored: DataFrame, entries: DataFrame, fresh: DataFrame) -> DataFrame:
    """The rows of ``stored`` (a part's samples or members) with those of ``entries`` (queue,
    bookmark) replaced by ``fresh``: the touched entries' rows as they are now."""
    kept = stored.join(entries.select("queue", "bookmark").distinct(), ["queue", "bookmark"],
                       "left_anti")
    return kept.unionByName(fresh.select(*stored.columns))


def with_tombstones(rows: DataFrame, keys: DataFrame, key_columns: Sequence[str]) -> DataFrame:
    """``rows`` to merge into the output, with `DELETED` false, and for each of ``keys`` (rows
    of ``key_columns``) that has no row any more, a row of its keys with `DELETED` true: a
    window or group that lost its last sample or member leaves the table. Keys compare
    null-safe (a group whose field is missing is the group ``null``)."""
    k, r = keys.select(*key_columns).distinct().alias("k"), rows.alias("r")
    match = [F.col(f"k.{c}").eqNullSafe(F.col(f"r.{c}")) for c in key_columns]
    gone = k.join(r, match, "left_anti")
    others = [F.lit(None).cast(f.dataType).alias(f.name) for f in rows.schema.fields
              if f.name not in key_columns]
    tombstones = gone.select(*[F.col(c) for c in key_columns], *others,
                             F.lit(True).alias(DELETED))
    return (rows.withColumn(DELETED, F.lit(False))
            .unionByName(tombstones.select(*rows.columns, DELETED)))


# ------------------------------------------------------------------------------------------
# views: members kept per bucket of groups
# ------------------------------------------------------------------------------------------


def pending_keys(after: DataFrame, before: DataFrame, as_of_ms: int) -> DataFrame:
    """The touched entries that were pending before this micro-batch or are now (queue,
    bookmark, topic, partition, offset): only those can leave or join a view, and their
    payloads tell which group they are in."""
    def pending(events: DataFrame) -> DataFrame:
        return transforms.available_entries(events, as_of_ms, include_leased=True).select(
            "queue", "bookmark", "topic", "partition", "offset")

    return pending(after).unionByName(pending(before)).distinct()


def with_bucket(rows: DataFrame, definition: ViewDefinition, buckets: int = BUCKETS
                ) -> DataFrame:
    """``rows`` (with a ``payload``) with their part: a hash of the queue and the group's
    values, so every member of a group is in one part."""
    hashed = F.xxhash64(F.col("queue"), *definition.group_by)
    return rows.withColumn(PART, F.pmod(hashed, F.lit(buckets)).cast("long"))


def _matches(definition: ViewDefinition) -> Column:
    where = definition.where
    return F.lit(True) if where is None else F.coalesce(where, F.lit(False))


def candidate_parts(candidates: DataFrame, payloads: DataFrame, definition: ViewDefinition,
                    buckets: int = BUCKETS) -> DataFrame:
    """The parts (buckets) of the `pending_keys` entries whose payload matches the view's
    filter: the groups they left or joined are there. An entry that does not match was never
    a member and changes nothing."""
    joined = candidates.join(payloads, ["topic", "partition", "offset"], "inner")
    return with_bucket(joined.where(_matches(definition)), definition, buckets).select(
        PART).distinct()


def view_members(after: DataFrame, payloads: DataFrame, definition: ViewDefinition,
                 as_of_ms: int, include_leased: bool, buckets: int = BUCKETS) -> DataFrame:
    """The touched entries that are members of the view now: pending (and, unless
    ``include_leased``, not leased), their payload matching the filter. Delayed entries are
    members too, with their ``available_at_ms``: they count once their time comes
    (`view_of_members`). ``payloads``: topic, partition, offset, payload (JSON text).

    Columns: `transforms.available_entries`' with ``payload`` and `PART`.
    """
    pending = transforms.available_entries(after, as_of_ms, include_leased=True)
    if not include_leased:
        pending = pending.where(~F.col("leased"))
    joined = pending.join(payloads, ["topic", "partition", "offset"], "inner")
    return with_bucket(joined.where(_matches(definition)), definition, buckets)


def view_of_members(members: DataFrame, definition: ViewDefinition, as_of_ms: int,
                    include_leased: bool) -> DataFrame:
    """The view's rows over ``members`` (`view_members` rows) at ``as_of_ms``, by the batch
    job's own `transforms.view`: a delayed member counts once its time has come."""
    if not include_leased:
        due = F.coalesce(F.col("available_at_ms") <= F.lit(as_of_ms), F.lit(True))
        members = members.where(due)
    journal = members.select("topic", "partition", "offset", F.col("payload").alias("value"))
    return transforms.view(members.drop("payload"), journal, definition)


def view_key_columns(definition: ViewDefinition) -> list[str] | None:
    """The columns that identify a view's row: the queue and the projected grouping fields;
    None when a grouping expression is not projected (two groups could then give the same
    row, so rows cannot be replaced one by one)."""
    keyed = [f for f in definition.fields if f.group is not None]
    if {f.group for f in keyed} != set(range(len(definition.groups))):
        return None
    return ["queue", *[f.name for f in keyed]]


def member_keys(members: DataFrame, definition: ViewDefinition) -> DataFrame:
    """The view rows' keys (`view_key_columns`) of the groups ``members`` belong to."""
    keyed = [f for f in definition.fields if f.group is not None]
    return members.select("queue", *[definition.groups[f.group]().alias(f.name)
                                     for f in keyed if f.group is not None]).distinct()


def delayed(members: DataFrame, as_of_ms: int) -> DataFrame:
    """The index of members whose time has not come at ``as_of_ms``: their bucket and
    ``available_at_ms`` (one part, 0). A micro-batch recomputes the buckets whose members'
    time has come since, though no event touched them."""
    return members.where(F.col("available_at_ms") > F.lit(as_of_ms)).select(
        F.lit(0).cast("long").alias(PART), F.col(PART).alias("bucket"), "available_at_ms")
