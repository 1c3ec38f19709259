"""`qlayer view` and `qlayer stats`: what a queue holds, computed read-only from stored state.

There is no RPC to the coordinator, so both read what it persisted: recovery points, touched
entries and counters in PostgreSQL, and the journals themselves in Kafka. Neither leases,
acknowledges or writes anything.

Approximations, by design (the coordinator's memory is the only exact answer):

- what the coordinator decided but has not committed yet (a lease of the last few
  milliseconds, an ack in flight) is not seen: such an entry still shows as AVAILABLE;
- delayed entries (a future ``qlayer.deliver-at``, or released with a delay) are left out, as
  the coordinator would not deliver them now; entries past the queue's ``expiration`` too;
- with ``target_queue_depth`` only the active entries are listed (AMPS: inactive messages
  "do not appear in a sow query"): the first N entries that are not done, in delivery order,
  the AVAILABLE ones among them; across partitions that order is approximated by record
  timestamp, as the coordinator takes them in the order it reads them;
- barriers are not modelled;
- stats' ``depth`` counts every journal record past the recovery point that is not done,
  including records the queue's enqueue filter refuses (reading them all to apply the filter
  would make ``stats`` as expensive as ``view``) and the commit markers of transactional
  producers (a redrive writes one per run), which take an offset each.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

from layer.domain.definitions import QueueDefinition
from layer.domain.errors import QueueConfigError, UnknownQueueError
from layer.domain.expressions import Document, as_number, compile_expression, parse_document
from layer.domain.likepattern import name_matcher
from layer.kafka import JournalRecord, KafkaAdmin
from layer.kafka.admin import TopicListing
from layer.kafka.scan import RangeScanner
from layer.protocol.headers import parse_deliver_at
from layer.protocol.topics import TopicNames
from layer.settings import Settings
from layer.store.rows import ConsumerRow, EntryRow, PartitionKey, QueueCounters
from layer.store.store import Store

__all__ = [
    "FAULT_COUNTERS",
    "RATE_COUNTERS",
    "MatchCount",
    "PartitionLag",
    "QueueStats",
    "ViewEntry",
    "count_matching",
    "queue_definition",
    "queue_stats",
    "rates",
    "sort_for_delivery",
    "view_queue",
]

#: The counters `qlayer stats` turns into per-second rates.
RATE_COUNTERS = ("enqueued", "delivered", "acked", "redelivered", "rejected", "dead_lettered",
                 "expired")
#: Journal records read with a fault that stays with the record, and entries lost with a
#: journal deleted while read (shown, not rated).
FAULT_COUNTERS = ("unparseable", "deletes", "malformed_headers", "journal_deleted")
_DONE = ("ACKED", "EXPIRED")


def queue_definition(store: Store, queue: str) -> QueueDefinition:
    """The live definition of ``queue``; ``UnknownQueueError`` when there is none."""
    record = store.get_queue(queue)
    if record is None:
        raise UnknownQueueError(queue)
    return QueueDefinition.from_mapping(record.definition)


def _journal_partitions(admin: KafkaAdmin, definition: QueueDefinition, prefix: str
                        ) -> list[tuple[str, int]]:
    """The journal partitions the coordinator reads for this queue (internal topics never)."""
    names = TopicNames(prefix)
    return [(topic, p) for topic, count in sorted(admin.topics().items())
            if not names.is_internal(topic) and definition.matches_topic(topic)
            for p in range(count)]


def _start_positions(admin: KafkaAdmin, definition: QueueDefinition,
                     pairs: list[tuple[str, int]], stored: Mapping[PartitionKey, int]
                     ) -> dict[tuple[str, int], int]:
    """Each partition's recovery point; where none is stored yet, where the queue would start
    (its `recovery_point` setting), exactly as the coordinator decides it."""
    name = definition.name
    return _all_start_positions(admin, {name: definition}, {name: pairs}, stored)[name]


# --- view --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ViewEntry:
    """One AVAILABLE entry, as a consumer would receive it."""

    bookmark: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    delivery_count: int
    priority: float | None
    document: Document | None


def _live(record: JournalRecord, row: EntryRow | None, definition: QueueDefinition,
          now: float) -> bool:
    """Still in the queue (AVAILABLE, LEASED or DELAYED): what counts toward a target depth."""
    if row is not None and row.state in ("ACKED", "EXPIRED"):
        return False
    if definition.expiration is not None and (row is None or row.state != "LEASED"):
        return record.timestamp_ms / 1000 + definition.expiration > now
    return True


def _available(record: JournalRecord, row: EntryRow | None, definition: QueueDefinition,
               now: float) -> bool:
    if row is not None:
        if row.state != "AVAILABLE":
            return False  # LEASED, ACKED or EXPIRED: not available
        if row.available_at is not None and row.available_at > now:
            return False  # released with a delay
    else:
        deliver_at = _deliver_at_ms(record)
        if deliver_at is not None and deliver_at > now * 1000:
            return False
        if definition.delivery_delay and (
                record.timestamp_ms / 1000 + definition.delivery_delay > now):
            return False  # the queue's delivery delay
    if definition.expiration is not None:
        # An unleased entry older than `expiration` leaves the queue (DESIGN §4).
        return record.timestamp_ms / 1000 + definition.expiration > now
    return True


def _deliver_at_ms(record: JournalRecord) -> int | None:
    try:
        return parse_deliver_at(record.headers)
    except ValueError:
        return None  # a malformed header: the coordinator delivers at once too


def view_queue(settings: Settings, queue: str, *, now: float, filter: str | None = None,
               limit: int | None = 20) -> list[ViewEntry]:
    """The queue's AVAILABLE entries in delivery order (priority first when it has one),
    those matching ``filter``, the first ``limit``. Reads only; see the module's caveats."""
    expression = None if filter is None else compile_expression(filter)
    with Store(settings.database_url) as store:
        definition = queue_definition(store, queue)
        stored = store.load_recovery_points(queue)
        rows = {(r.topic, r.partition, r.offset): r for r in store.load_entries(queue)}
    admin = KafkaAdmin(settings.kafka_config())
    pairs = _journal_partitions(admin, definition, settings.topic_prefix)
    if not pairs:
        return []
    starts = _start_positions(admin, definition, pairs, stored)
    ends = admin.end_offsets(pairs)
    queue_filter = definition.filter_expression
    priority = definition.priority_expression
    depth = definition.target_queue_depth
    # Without a priority, delivery follows each partition's journal order, so a partition can
    # stop being read once it has `limit` entries to show (`depth` live ones with a target
    # depth: no more can be active); with one, every entry competes.
    early_stop = priority is None and (limit is not None or depth is not None)
    enough = depth if depth is not None else (limit or 0)
    found: list[ViewEntry] = []
    available: set[tuple[str, int, int]] = set()
    per_partition: dict[tuple[str, int], int] = {}
    reader = RangeScanner(settings.kafka_config(), settings.topic_prefix + "cli")
    try:
        for record in reader.read(starts, ends):
            row = rows.get((record.topic, record.partition, record.offset))
            if depth is not None:
                # Every live entry takes a place in the active part, leased or delayed too.
                if not _live(record, row, definition, now):
                    continue
            elif not _available(record, row, definition, now):
                continue
            document = parse_document(record.value)
            if queue_filter is not None and not queue_filter.matches(document):
                continue
            if depth is not None:
                if _available(record, row, definition, now):
                    available.add((record.topic, record.partition, record.offset))
            elif expression is not None and not expression.matches(document):
                continue
            rank = None
            if priority is not None:
                value = as_number(priority.evaluate(document))
                rank = None if value is None else float(value)
            found.append(ViewEntry(
                bookmark=f"{record.topic}/{record.partition}/{record.offset}",
                topic=record.topic, partition=record.partition, offset=record.offset,
                key=record.key, value=record.value, timestamp_ms=record.timestamp_ms,
                delivery_count=row.delivery_count if row is not None else 0,
                priority=rank, document=document))
            tp = (record.topic, record.partition)
            per_partition[tp] = per_partition.get(tp, 0) + 1
            if early_stop and per_partition[tp] >= enough:
                reader.stop(tp)
    finally:
        reader.close()
    ordered = sort_for_delivery(found, by_priority=priority is not None)
    if depth is not None:
        # The active part: the first `depth` live entries; shown are its AVAILABLE ones.
        ordered = [e for e in ordered[:depth]
                   if (e.topic, e.partition, e.offset) in available
                   and (expression is None or expression.matches(e.document))]
    return ordered if limit is None else ordered[:limit]


@dataclass(frozen=True, slots=True)
class MatchCount:
    """The entries an ack by filter would take, counted read-only (`qlayer queue ack
    --dry-run`): a snapshot, with `view`'s caveats."""

    available: int
    leased: int
    delayed: int
    #: The first few matching bookmarks, in journal order.
    sample: tuple[str, ...]

    @property
    def total(self) -> int:
        return self.available + self.leased + self.delayed


def count_matching(settings: Settings, queue: str, *, now: float, filter: str | None,
                   sample: int = 5) -> MatchCount:
    """The entries of the queue that are not done and match ``filter`` (None: all), as
    `QueueEngine.ack_matching` would take them: available, leased or delayed. Reads only;
    ``target_queue_depth`` is not modelled (entries past it are counted, though an ack by
    filter leaves them alone)."""
    expression = None if filter is None else compile_expression(filter)
    with Store(settings.database_url) as store:
        definition = queue_definition(store, queue)
        stored = store.load_recovery_points(queue)
        rows = {(r.topic, r.partition, r.offset): r for r in store.load_entries(queue)}
    admin = KafkaAdmin(settings.kafka_config())
    pairs = _journal_partitions(admin, definition, settings.topic_prefix)
    if not pairs:
        return MatchCount(0, 0, 0, ())
    starts = _start_positions(admin, definition, pairs, stored)
    ends = admin.end_offsets(pairs)
    queue_filter = definition.filter_expression
    counts = {"available": 0, "leased": 0, "delayed": 0}
    found: list[str] = []
    reader = RangeScanner(settings.kafka_config(), settings.topic_prefix + "cli")
    try:
        for record in reader.read(starts, ends):
            row = rows.get((record.topic, record.partition, record.offset))
            if record.value is None or (row is not None and row.state in _DONE):
                continue
            if definition.expiration is not None and (
                    record.timestamp_ms / 1000 + definition.expiration <= now):
                continue  # left the queue by age, or about to
            document = parse_document(record.value)
            if queue_filter is not None and not queue_filter.matches(document):
                continue
            if expression is not None and not expression.matches(document):
                continue
            if row is not None and row.state == "LEASED":
                counts["leased"] += 1
            elif _available(record, row, definition, now):
                counts["available"] += 1
            else:
                counts["delayed"] += 1
            if len(found) < sample:
                found.append(f"{record.topic}/{record.partition}/{record.offset}")
    finally:
        reader.close()
    return MatchCount(counts["available"], counts["leased"], counts["delayed"], tuple(found))


def sort_for_delivery(entries: Iterable[ViewEntry], *, by_priority: bool) -> list[ViewEntry]:
    """The order a consumer would get them in: with a priority, highest first (non-numeric
    last), ties by age; else each partition in journal order, partitions interleaved by
    record timestamp (the coordinator takes them in the order it reads them)."""
    if by_priority:
        return sorted(entries, key=_delivery_order)
    partitions: dict[tuple[str, int], list[ViewEntry]] = {}
    for entry in entries:
        partitions.setdefault((entry.topic, entry.partition), []).append(entry)
    runs = [sorted(run, key=lambda e: e.offset) for _, run in sorted(partitions.items())]
    return list(heapq.merge(*runs, key=lambda e: e.timestamp_ms))


def _age_order(entry: ViewEntry) -> tuple[int, str, int, int]:
    return (entry.timestamp_ms, entry.topic, entry.partition, entry.offset)


def _delivery_order(entry: ViewEntry) -> tuple[int, float, int, str, int, int]:
    # Highest priority first; non-numeric or null priority is lowest; ties by age.
    missing = 1 if entry.priority is None else 0
    return (missing, -(entry.priority or 0.0), *_age_order(entry))


# --- stats -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionLag:
    topic: str
    partition: int
    recovery_point: int
    end_offset: int

    @property
    def lag(self) -> int:
        return max(0, self.end_offset - self.recovery_point)


@dataclass(frozen=True, slots=True)
class QueueStats:
    """One sample of a queue's figures; ``rates`` are per second since the previous sample."""

    queue: str
    depth: int
    leased: int
    consumers: int
    oldest_available_age: float | None
    counters: dict[str, int]
    partitions: list[PartitionLag]
    sampled_at: float
    rates: dict[str, float] | None = field(default=None)
    problem: str | None = None
    """Why the queue is not served (its stored definition no longer validates), or None."""


def rates(previous: QueueStats, current: QueueStats) -> dict[str, float]:
    """Per-second rates of the counters between two samples of one queue."""
    elapsed = current.sampled_at - previous.sampled_at
    if elapsed <= 0:
        return dict.fromkeys(RATE_COUNTERS, 0.0)
    return {name: max(0, current.counters.get(name, 0) - previous.counters.get(name, 0))
            / elapsed for name in RATE_COUNTERS}


def _subscribed(row: ConsumerRow, queue: str) -> bool:
    if row.is_regex:
        try:
            return name_matcher(row.queue)(queue)
        except re.error:
            return False
    return row.queue == queue


def _oldest_timestamps(settings: Settings, wanted: Mapping[str, Mapping[tuple[str, int], int]],
                       ends: Mapping[tuple[str, int], int],
                       done: Mapping[str, set[tuple[str, int, int]]]) -> dict[str, int]:
    """Per queue, the timestamp of its first not-done record at or after each start.

    One Kafka consumer and one pass for all queues: each partition is read once, from the
    smallest start of the queues that want it, and each record is judged for every one of
    them still looking; a partition stops being read once every such queue found its first
    not-done record. (Read once per queue sharing it, fifty queues over one journal took
    fifty reads of half a second each: the console's first page waited 30 s.)"""
    looking: dict[tuple[str, int], dict[str, int]] = {}
    for queue in sorted(wanted):
        for tp, start in wanted[queue].items():
            looking.setdefault(tp, {})[queue] = start
    oldest: dict[str, int] = {}
    if not looking:
        return oldest
    reader = RangeScanner(settings.kafka_config(), settings.topic_prefix + "cli")
    try:
        starts = {tp: min(queues.values()) for tp, queues in looking.items()}
        for record in reader.read(starts, {tp: ends[tp] for tp in looking}):
            tp = (record.topic, record.partition)
            queues = looking[tp]
            for queue, start in list(queues.items()):
                if record.offset < start or (
                        (record.topic, record.partition, record.offset) in done.get(queue, ())):
                    continue
                del queues[queue]
                if queue not in oldest or record.timestamp_ms < oldest[queue]:
                    oldest[queue] = record.timestamp_ms
            if not queues:
                reader.stop(tp)
    finally:
        reader.close()
    return oldest


def _counter_values(counters: QueueCounters | None) -> dict[str, int]:
    return {name: 0 if counters is None else int(getattr(counters, name))
            for name in (*RATE_COUNTERS, *FAULT_COUNTERS)}


def _all_start_positions(admin: KafkaAdmin, definitions: Mapping[str, QueueDefinition],
                         pairs: Mapping[str, list[tuple[str, int]]],
                         stored: Mapping[PartitionKey, int]
                         ) -> dict[str, dict[tuple[str, int], int]]:
    """`_start_positions` of every queue in a constant number of offset requests: one per
    kind of ``recovery_point`` among queues with no stored point, and one for log starts."""
    starts: dict[str, dict[tuple[str, int], int]] = {name: {} for name in pairs}
    fresh: dict[str, list[tuple[str, tuple[str, int]]]] = {}
    for name, queue_pairs in pairs.items():
        definition = definitions[name]
        for tp in queue_pairs:
            point = stored.get(PartitionKey(name, *tp))
            if point is not None:
                starts[name][tp] = point
                continue
            kind = definition.recovery_point
            if kind not in ("end", "beginning"):
                moment = definition.recovery_timestamp
                assert moment is not None
                kind = str(int(moment.timestamp() * 1000))
            fresh.setdefault(kind, []).append((name, tp))
    for kind, wanted in fresh.items():
        tps = sorted({tp for _, tp in wanted})
        if kind == "end":
            found = admin.end_offsets(tps)
        elif kind == "beginning":
            found = admin.log_start_offsets(tps)
        else:
            found = admin.offsets_for_time(tps, int(kind))
        for name, tp in wanted:
            starts[name][tp] = found[tp]
    # Retention may have deleted what a recovery point still points at.
    every = sorted({tp for queue_starts in starts.values() for tp in queue_starts})
    firsts = admin.log_start_offsets(every) if every else {}
    return {name: {tp: max(offset, firsts.get(tp, 0)) for tp, offset in queue_starts.items()}
            for name, queue_starts in starts.items()}


def queue_stats(settings: Settings, queues: Iterable[str] | None = None, *, now: float,
                store: Store | None = None, listing: TopicListing | None = None
                ) -> list[QueueStats]:
    """One sample of every queue's figures (or of the named ones).

    In a constant number of round trips, whatever the number of queues (issue 33): a few
    PostgreSQL queries for every queue's definition, consumers, counters, recovery points and
    entries; one topic listing and a few offset requests for every journal partition; one
    Kafka consumer for the oldest records (`_oldest_timestamps`). ``store``: one the caller
    keeps open across samples (a new one otherwise); ``listing``: the topic listing the caller
    asked for early (`KafkaAdmin.topics_soon`), used once."""
    admin = listing.admin if listing is not None else KafkaAdmin(settings.kafka_config())
    with nullcontext(store) if store is not None else Store(settings.database_url) as store:
        records = {r.name: r for r in store.list_queues()}
        names = sorted(records) if queues is None else sorted(set(queues))
        missing = [name for name in names if name not in records]
        if missing:
            raise UnknownQueueError(missing[0])
        consumers = store.load_consumers()
        counters = store.load_counters()
        stored = store.load_recovery_points()
        entries = store.load_entries_of(names)
    definitions: dict[str, QueueDefinition] = {}
    problems: dict[str, str] = {}
    for name in names:
        try:
            definitions[name] = QueueDefinition.from_mapping(records[name].definition)
        except QueueConfigError as exc:
            # One queue's bad definition must not hide every other queue's figures.
            problems[name] = f"not served: its stored definition is invalid ({exc})"
    listed = (listing.result() if listing is not None else admin.topics()) if definitions else {}
    internal = TopicNames(settings.topic_prefix)
    # Looked up, not tried on every topic: a thousand queues on a thousand journals were a
    # million `matches_topic` calls.
    pairs = {name: [(topic, p) for topic in definition.journal_topics(listed)
                    if not internal.is_internal(topic) for p in range(listed[topic])]
             for name, definition in definitions.items()}
    starts = _all_start_positions(admin, definitions, pairs, stored)
    every = sorted({tp for queue_pairs in pairs.values() for tp in queue_pairs})
    ends = admin.end_offsets(every) if every else {}
    out: list[QueueStats] = []
    lags: dict[str, list[PartitionLag]] = {}
    done: dict[str, set[tuple[str, int, int]]] = {}
    wanted: dict[str, dict[tuple[str, int], int]] = {}
    for name in definitions:
        queue_starts = starts[name]
        lags[name] = [PartitionLag(t, p, queue_starts[(t, p)],
                                   ends.get((t, p), queue_starts[(t, p)]))
                      for t, p in pairs[name]]
        done[name] = {(r.topic, r.partition, r.offset) for r in entries.get(name, ())
                      if r.state in _DONE
                      and r.offset >= queue_starts.get((r.topic, r.partition), 0)}
        if sum(lag.lag for lag in lags[name]) > len(done[name]):
            wanted[name] = {(lag.topic, lag.partition): lag.recovery_point
                            for lag in lags[name] if lag.lag}
    oldest = _oldest_timestamps(settings, wanted, ends, done)
    for name in names:
        rows = entries.get(name, ())
        leased = sum(1 for r in rows if r.state == "LEASED")
        subscribed = sum(1 for c in consumers if _subscribed(c, name))
        values = _counter_values(counters.get(name))
        if name in problems:
            out.append(QueueStats(
                queue=name, depth=0, leased=leased, consumers=subscribed,
                oldest_available_age=None, counters=values, partitions=[], sampled_at=now,
                problem=problems[name]))
            continue
        first = oldest.get(name)
        out.append(QueueStats(
            queue=name, depth=max(0, sum(lag.lag for lag in lags[name]) - len(done[name])),
            leased=leased, consumers=subscribed,
            oldest_available_age=None if first is None else max(0.0, now - first / 1000),
            counters=values, partitions=lags[name], sampled_at=now))
    return out


def shard_counters(settings: Settings, store: Store | None = None
                   ) -> dict[str, dict[str, int]]:
    """Each shard's stored counters of input faults and isolated poison input (malformed ack
    and control records, refusals by status, records too large to deliver, journals deleted
    while read; written by the shard's owner every report interval): shard -> name -> n,
    shards with nothing counted left out."""
    with nullcontext(store) if store is not None else Store(settings.database_url) as store:
        found = store.all_shard_counters()
    return {shard: dict(sorted(c.items())) for shard, c in found.items() if c}
