"""A shard's periodic work besides its records, each a small service with ``run_once(now)``
(like river's ``internal/maintenance``): picking up queue changes from the catalog (created,
changed, moved, deleted, purged or acked by filter, reset; consumers evicted), new journal
partitions, and the queues' recovery points as consumer-group offsets for lag tools.

`QueueLoader` is the I/O a queue's (re)build needs: its stored state from PostgreSQL and its
partitions and offsets from Kafka, handed to the pure `ShardCore.add_queue`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from contextlib import nullcontext

from layer.coordinator.core import ShardCore
from layer.coordinator.deleted import lost_to_deletion
from layer.coordinator.loader import QueueLoader, read_from
from layer.coordinator.logformat import fields
from layer.coordinator.ports import TopicAdmin
from layer.coordinator.translate import add_outbox, event_fields
from layer.domain import events as ev
from layer.domain.definitions import QueueDefinition
from layer.domain.errors import ExpressionError, QlayerError, QueueConfigError
from layer.domain.positions import ResetTargetError, parse_target, resolve_target
from layer.domain.states import AckSource, Bookmark, ExpiryReason, LeaveReason
from layer.kafka import OutgoingRecord
from layer.kafka.errors import RetentionGap
from layer.protocol import SessionEndReason
from layer.store.batch import WriteBatch
from layer.store.rows import ConsumerRow, PartitionKey, QueueRecord

log = logging.getLogger(__name__)

__all__ = ["GroupOffsets", "PartitionCheck", "QueueLoader", "Refresh", "evict", "purge",
           "read_from", "reset"]

#: Past every offset: a rewound partition closes every entry its queue holds.
_ALL = 1 << 62
_DONE = ("ACKED", "EXPIRED")


class Refresh:
    """Queue changes from the process's catalog: created, changed, moved, deleted, purged,
    and consumers an operator evicted."""

    def __init__(self, core: ShardCore, loader: QueueLoader, interval: float) -> None:
        self.core = core
        self.loader = loader
        self.interval = interval
        self.next_at = 0.0
        self.seen = -1.0
        # queue -> the reset request this owner carried out: the catalog shows it done only
        # after its next load, and a reset must not be done twice (a rewind would replay
        # again).
        self.resets_done: dict[str, float] = {}

    def due(self, now: float) -> bool:
        return now >= self.next_at or self.core.catalog().loaded_at != self.seen

    def run_once(self, now: float, batch: WriteBatch, replies: list[OutgoingRecord]) -> None:
        core = self.core
        catalog = core.catalog()
        self.seen = catalog.loaded_at
        self.next_at = now + self.interval
        known = catalog.on_shard(core.shard)
        rows = catalog.session_rows
        for name, record in known.items():
            # Before purges and evictions: a reset takes what its queue's engine has to say
            # since the last step, which is only what the reset itself decides.
            if (record.reset_pending and name in core.engines
                    and self.resets_done.get(name) != record.reset_requested_at):
                assert record.reset_requested_at is not None
                reset(core, self.loader, record, rows, now, batch)
                self.resets_done[name] = record.reset_requested_at
                batch.reset_done(name, record.reset_requested_at)
        for name, record in known.items():
            if record.purge_pending and name in core.engines:
                acked = purge(core, name, now, record.purge_filter)
                assert record.purge_requested_at is not None
                batch.purge_done(name, record.purge_requested_at, acked)
                # A purge bumps the version; it is not a definition change to rebuild for.
                core.versions[name] = record.version
        evict(core, catalog.consumers.values(), now, batch, replies)
        # Principals removed or rotated, grants revoked: their sessions end (protocol 7).
        core.control.revoke(now, batch, replies)
        for name in list(core.engines):
            if name not in known:
                elsewhere = catalog.shard_of(name)
                core.drop_queue(name)
                if elsewhere is None:
                    log.info("queue %s was deleted", name,
                             extra=fields(queue=name, shard=core.shard, reason="deleted"))
                else:
                    log.info("queue %s moved to shard %d", name, elsewhere,
                             extra=fields(queue=name, shard=core.shard, reason="moved"))
                    core.forget_empty_sessions()
        new = [name for name in known if name not in core.engines]
        with self.loader.together() if len(new) > 1 else nullcontext():
            self._add_or_rebuild(known, rows, now)

    def _add_or_rebuild(self, known: Mapping[str, QueueRecord], rows: Iterable[ConsumerRow],
                        now: float) -> None:
        core = self.core
        for name, record in known.items():
            if name not in core.engines:
                log.info("queue %s is served by shard %d from now on", name, core.shard,
                         extra=fields(queue=name, shard=core.shard, epoch=core.epoch))
                if self.loader.add(record, rows, now):
                    core.subscribe_regex_sessions(name, now)
                    # The sessions of a queue that moved here: their consumers still write to
                    # the old shard, which passes their records on.
                    core.restore_sessions(rows, now, only=name)
            elif record.version != core.versions.get(name):
                # Rebuild the queue from its persisted state under the new definition: leases
                # are persisted, so they survive; what is in flight is not lost because the
                # journal is re-read from the recovery points.
                log.info("queue %s changed (version %d); rebuilding it", name, record.version,
                         extra=fields(queue=name, shard=core.shard, reason="changed"))
                core.drop_queue(name, keep_sessions=True)
                if self.loader.add(record, rows, now):
                    core.resubscribe(name, now)


class PartitionCheck:
    """New partitions or topics for the queues that exist: one topic listing for them all (a
    metadata request over every topic, which stalls the loop on a large cluster)."""

    def __init__(self, core: ShardCore, loader: QueueLoader, interval: float) -> None:
        self.core = core
        self.loader = loader
        self.interval = interval
        self.next_at = 0.0

    def run_once(self, now: float, batch: WriteBatch | None = None,
                 out_of_range: set[tuple[str, int]] | None = None) -> None:
        """New partitions; with ``batch``, also journals deleted (and made again) since the
        last look, and partitions the reader found outside their log (``out_of_range``)."""
        if now < self.next_at and not out_of_range:
            return
        self.next_at = now + self.interval
        if not self.core.engines:
            return  # a shard without queues has no partitions to look for
        listed = self.loader.admin.topics()
        if batch is not None:
            self._lost_journals(listed, out_of_range or set(), now, batch)
        for name, engine in list(self.core.engines.items()):
            points = engine.recovery_points()
            missing = [tp for tp in self.loader.journal_partitions(engine.definition, listed)
                       if tp not in points]
            if missing:
                # A partition listed but not known to its leader (a topic being deleted a
                # moment ago) is left for the next look, not failing the shard's iteration.
                starts = self.loader.admin.log_start_offsets(missing, known_only=True)
                if starts:
                    self.core.add_partitions(name, starts)
                    # A journal made again after it was deleted: a new consumer reads it.
                    self.loader.read_from(starts)

    def _lost_journals(self, listed: dict[str, int], out_of_range: set[tuple[str, int]],
                       now: float, batch: WriteBatch) -> None:
        """Journal partitions a queue reads that are gone (the topic deleted, or fewer
        partitions), or whose log now ends before the queue's position (deleted and made
        again: the old records are gone, offsets start over). Their entries expire (reason
        ``journal_deleted``), the queue forgets the partition and is rebuilt without it, and
        a partition there again is read from its new log start. Only that queue changes:
        the shard is not rebuilt (issue 15, 2b). A position below the log start is
        retention's, reported as before (the shard's rebuild expires those entries)."""
        core, admin = self.core, self.loader.admin
        # Every listed partition a queue reads, not only those the reader found outside their
        # log: a journal deleted and made again (auto-created, empty) while its partition was
        # read to its end was found by neither (the reader met no offset out of range; the
        # soak's deleted journal, found after the fix for a takeover). A log's end never moves
        # back, so one below what was read or admitted of it means a new log.
        watched = {tp for engine in core.engines.values() for tp in engine.recovery_points()}
        # A topic deleted a moment ago can still be listed while its leader already answers
        # UNKNOWN_TOPIC_OR_PART: its partitions are left out of `ends` and so judged at the
        # next look, when the listing no longer shows them. Failing here cost the whole shard
        # a rebuild (found by CI: a journal deleted while read).
        ends = admin.end_offsets(sorted(tp for tp in watched | out_of_range
                                        if tp[1] < listed.get(tp[0], 0)), known_only=True)
        remade: set[tuple[str, int]] = set()
        reader = self.loader.reader
        for name, engine in list(core.engines.items()):
            points = engine.recovery_points()
            # A log that now ends before what was read of it was made again: retention moves
            # a log's start, never its end back. The reader's position says so even when the
            # recovery point is inside the new log (nothing acked yet; found by the soak).
            # The admitted offset too: the reader may have gone back for another queue.
            lost = [tp for tp in points if tp[1] >= listed.get(tp[0], 0)
                    or (tp in ends and max(points[tp], reader.position(*tp) or 0,
                                           core.admitted_to(name, tp)) > ends[tp])]
            if lost:
                remade.update(tp for tp in lost if tp in ends)
                journal_deleted(core, self.loader, name, lost, listed, now, batch)
        retention = sorted(tp for tp in out_of_range if tp in ends and tp not in remade)
        if retention:
            raise RetentionGap(f"{', '.join(f'{t}[{p}]' for t, p in retention)}: the offset "
                               "to read was deleted by retention")
        # Partitions of deleted topics no queue reads any more.
        self.loader.stop_reading([tp for tp in self.loader.reader.assignment
                                  if not core.topics.is_internal(tp[0])
                                  and tp[1] >= listed.get(tp[0], 0)])


def journal_deleted(core: ShardCore, loader: QueueLoader, name: str,
                    lost: list[tuple[str, int]], listed: dict[str, int], now: float,
                    batch: WriteBatch) -> None:
    """The queue's journal partitions ``lost`` are gone: every entry of theirs expires (reason
    ``journal_deleted``, no dead letter: there is no record to write), with its EXPIRED event;
    the stored entries and positions of the partitions are forgotten (a journal made again
    is read from its new start, offsets starting over) and the queue is rebuilt, with its
    sessions, from what is stored."""
    engine = core.engines[name]
    points = engine.recovery_points()
    # Partitions there again (the topic made again): read from the new log's start.
    remade = [tp for tp in lost if tp[1] < listed.get(tp[0], 0)]
    # How far the journal was read: entries the stored admitted offset says the queue had,
    # past it, were not replayed yet after a takeover (queued, never leased: no row).
    reached = {tp: loader.reader.position(*tp) for tp in lost}
    # Read again, once the journal is made again, by a new Kafka consumer (`read_from`): at
    # once below when it is listed already, else when the partition check finds it again.
    loader.stop_reading(lost)
    rows = [row for row in loader.store.load_entries(name) if (row.topic, row.partition) in lost]
    stored = [row for row in rows if row.state not in _DONE]
    admitted = loader.store.load_admitted(name)
    closed: list[ev.Event] = []
    for topic, partition in sorted(lost):
        for row in stored:
            bookmark = Bookmark(topic, partition, row.offset)
            if (row.topic, row.partition) == (topic, partition) and engine.restoring(bookmark):
                # Not reached by the replay yet: the engine lets it go without an event.
                closed.append(ev.EntryExpired(name, bookmark, ExpiryReason.JOURNAL_DELETED,
                                              False, row.delivery_count, row.cancel_count,
                                              row.lease_consumer, None, now))
        engine.expire_before(topic, partition, _ALL, now, ExpiryReason.JOURNAL_DELETED)
        batch.forget_partition(name, topic, partition)
        batch.set_recovery_point(name, topic, partition, 0)
        batch.set_admitted(name, topic, partition, 0)
    closed.extend(engine.drain().events)
    seen = {(e.bookmark.topic, e.bookmark.partition, e.bookmark.offset) for e in closed
            if isinstance(e, ev.EntryExpired)}
    for topic, partition in sorted(lost):
        read = reached.get((topic, partition))
        point = points.get((topic, partition), 0)
        top = admitted.get(PartitionKey(name, topic, partition), point)
        start = max(point, read) if read is not None and read >= 0 else point
        if top > start:
            done = {r.offset for r in rows if (r.topic, r.partition) == (topic, partition)
                    and r.state in _DONE}
            closed.extend(lost_to_deletion(
                name, topic, partition, start, top, {}, done, now,
                {o for t, p, o in seen if (t, p) == (topic, partition)}))
    expired = 0
    for e in closed:
        if isinstance(e, ev.EntryExpired):
            expired += 1
            # The bytes held for the entry go now: a journal made again starts its offsets
            # over, and a new record at the same bookmark must not be delivered with them.
            core.payloads.release(e.bookmark)
    if closed:
        add_outbox(batch, name, ev.Outbox(closed, []))
        codec = core.codec
        encode = codec.event_encoder.encode_fields
        batch.put_events(codec.event_arrays([
            codec.event_item(encode(core.owner_id, core.epoch, *f))
            for f in event_fields(closed, session_of=core.session_id_of)]))
    core.counters["journal_deleted"] += expired
    if expired:
        batch.count(name, "journal_deleted", expired)
    core.counters["journals_deleted"] += len(lost)
    core.journal_deleted[name] = (", ".join(f"{t}[{p}]" for t, p in sorted(lost)), now)
    log.error("queue %s: journal partition(s) %s were deleted (or deleted and made again) "
              "while the queue read them: %d entries expired (reason journal_deleted); the "
              "queue reads on without them, from a new log's start", name,
              ", ".join(f"{t}[{p}]" for t, p in sorted(lost)), expired)
    record = core.catalog().on_shard(core.shard).get(name)
    core.drop_queue(name, keep_sessions=True)
    starts = loader.admin.log_start_offsets(remade) if remade else {}
    moved = {tp: (points[tp], starts.get(tp, 0)) for tp in remade}
    if record is not None and loader.add(record, core.catalog().session_rows, now,
                                         moved, frozenset(lost)):
        core.resubscribe(name, now)


class GroupOffsets:
    """Recovery points as consumer-group offsets: lag tools show each queue's backlog."""

    def __init__(self, core: ShardCore, admin: TopicAdmin, interval: float) -> None:
        self.core = core
        self.admin = admin
        self.interval = interval
        self.next_at = 0.0

    def run_once(self, now: float) -> None:
        if now < self.next_at:
            return
        self.next_at = now + self.interval
        by_queue: dict[str, dict[tuple[str, int], int]] = {}
        for key, offset in self.core.persisted_points.items():
            if offset >= 0:
                by_queue.setdefault(key.queue, {})[(key.topic, key.partition)] = offset
        for queue, offsets in by_queue.items():
            try:
                self.admin.commit_group_offsets(self.core.topics.queue_group(queue), offsets)
            except QlayerError as exc:
                # Only monitoring depends on it: log and go on.
                log.warning("committing lag offsets of queue %s failed: %s", queue, exc)


def purge(core: ShardCore, name: str, now: float, filter: str | None = None) -> int:
    """`qlayer queue purge`: every entry leaves the queue, acknowledged by the operator
    (AMPS: a sow_delete on the queue); `qlayer queue ack --filter`: the entries matching the
    filter (AMPS: "the sow_delete acknowledges all messages that match the filter"). Leases
    end; their holders' late acks are answered DUPLICATE. Each entry gets its ACKED event
    (source admin), so audits still balance. Returns how many entries were acknowledged."""
    engine = core.engines[name]
    purged = 0
    # Entries beyond target_queue_depth become active as the ones before them leave. A
    # filter applies to the deliverable entries only (AMPS: "A sow_delete that uses a filter
    # will only apply to the messages in the queue that are currently deliverable"), so it is
    # applied once: the entries that become active after it are not taken.
    for _ in range(1_000 if filter is None else 1):
        try:
            n = engine.ack_matching(filter, now)
        except ExpressionError as exc:
            # Checked when it was asked for; a stored filter that no longer compiles (a
            # newer CLI's syntax) is logged and dropped rather than stopping the shard.
            core.counters["invalid_ack_filters"] += 1
            log.error("queue %s: the ack filter %r is invalid and was dropped: %s", name,
                      filter, exc)
            return 0
        engine.tick(now)
        purged += n
        if n == 0:
            break
    if filter is None and engine.definition.target_queue_depth is not None:
        # Records deferred past the depth are not in memory: each is acknowledged (source
        # admin) as the loop reads it back, without waiting for room (docs/engine.md).
        deferred = engine.purge_deferred()
        if deferred:
            log.info("queue %s: up to %d deferred records are acknowledged as they are read "
                     "back", name, deferred)
    core.counters["purged"] += purged
    if filter is None:
        log.info("queue %s purged: %d entries acknowledged by the operator", name, purged)
    else:
        log.info("queue %s: %d entries matching %s acknowledged by the operator", name,
                 purged, filter)
    return purged


def reset(core: ShardCore, loader: QueueLoader, record: QueueRecord,
          rows: Iterable[ConsumerRow], now: float, batch: WriteBatch) -> None:
    """`qlayer queue reset` (or a changed ``recovery_point``): the queue's positions move to
    the target and it is rebuilt from there, under its current definition.

    AMPS begins a queue's recovery at a changed RecoveryPoint and rebuilds its state from the
    operations recorded after it. So, per partition moved forward, the entries before the new
    position leave the queue -- each with an ACKED event (source admin), as in a purge -- and
    those after it keep their state: acked stay acked, leases stay. Below a recovery point
    qlayer keeps no record of each entry's outcome (DESIGN §3), so a partition moved back is a
    replay, as a Kafka consumer-group reset is: the entries it holds are closed the same way
    and every record from the new position enters the queue anew (ENQUEUED again)."""
    name = record.name
    engine = core.engines[name]
    assert record.reset_to is not None
    try:
        target = parse_target(record.reset_to)
        definition = QueueDefinition.from_mapping(record.definition)
        positions = resolve_target(target, loader.journal_partitions(definition), loader.admin)
    except (ResetTargetError, QueueConfigError) as exc:
        core.counters["invalid_resets"] += 1
        log.error("queue %s: the reset to %r cannot be done and was dropped: %s", name,
                  record.reset_to, exc)
        return
    before = engine.recovery_points()
    moved = {tp: (before.get(tp, offset), offset) for tp, offset in positions.items()}
    moved = {tp: move for tp, move in moved.items() if move[0] != move[1]}
    if not moved:
        # Nothing to rebuild for the reset; a definition changed with it still is (below).
        log.info("queue %s: reset to %s moves no position", name, target.text)
        return
    stored = [row for row in loader.store.load_entries(name)
              if row.state not in _DONE and (row.topic, row.partition) in moved]
    closed: list[ev.Event] = []
    for (topic, partition), (old, new) in sorted(moved.items()):
        below = new if new > old else _ALL
        # Entries stored but not reached by the replay yet (after a restart): the engine lets
        # them go without an event, so theirs come from their rows.
        for row in stored:
            bookmark = Bookmark(topic, partition, row.offset)
            if ((row.topic, row.partition) == (topic, partition) and row.offset < below
                    and engine.restoring(bookmark)):
                closed.append(ev.EntryAcked(name, bookmark, None, AckSource.ADMIN, now,
                                            row.delivery_count or None))
        engine.expire_before(topic, partition, below, now)
        if new < old:
            batch.forget_partition(name, topic, partition)
    # The engine reports them as lost (retention); to the operator they were acknowledged.
    for e in engine.drain().events:
        if isinstance(e, ev.EntryExpired) and e.reason is ExpiryReason.RETENTION:
            closed.append(ev.EntryAcked(name, e.bookmark, None, AckSource.ADMIN, now,
                                        e.delivery_count or None))
        else:
            closed.append(e)  # nothing else is pending between steps; kept if it ever is
    if closed:
        add_outbox(batch, name, ev.Outbox(closed, []))
        codec = core.codec
        encode = codec.event_encoder.encode_fields
        batch.put_events(codec.event_arrays([
            codec.event_item(encode(core.owner_id, core.epoch, *f))
            for f in event_fields(closed, session_of=core.session_id_of)]))
    core.drop_queue(name, keep_sessions=True)
    if loader.add(record, rows, now, moved):
        core.resubscribe(name, now)
    core.counters["resets"] += 1
    core.counters["reset_acked"] += sum(isinstance(e, ev.EntryAcked) for e in closed)
    log.info("queue %s reset to %s: %s; %d entries acknowledged by the operator", name,
             target.text, ", ".join(f"{t}[{p}] {a} -> {b}" for (t, p), (a, b)
                                   in sorted(moved.items())), len(closed))


def evict(core: ShardCore, rows: Iterable[ConsumerRow], now: float, batch: WriteBatch,
          replies: list[OutgoingRecord]) -> None:
    """`qlayer consumers evict`: break the consumer's leases at once and tell it. Each shard
    evicts its own sessions; a consumer no shard serves is evicted by shard 0."""
    for row in rows:
        if row.evict_requested_at is None:
            continue
        session = core.sessions.get(row.consumer_id)
        if session is None and not _serves_orphan(core, row):
            continue
        if (session is not None and session.session_id == row.session_id
                and core.fence_first(session, SessionEndReason.EVICTED,
                                     "evicted by an operator (qlayer consumers evict)")):
            continue  # ends once fenced, its row with it
        if session is not None:
            for queue in session.queues:
                engine = core.engines.get(queue)
                if engine is not None:
                    engine.unsubscribe(row.consumer_id, now, LeaveReason.EVICTED)
            replies.append(core.control.session_ended(
                row.consumer_id, session.session_id, SessionEndReason.EVICTED, now,
                "evicted by an operator (qlayer consumers evict)"))
            del core.sessions[row.consumer_id]
            if session.is_span(core.shard):
                # The operator asked at the home row; this shard's part of it ends too.
                batch.delete_consumer(row.consumer_id, session.session_id, span=core.shard)
        batch.delete_consumer(row.consumer_id, row.session_id)
        core.counters["evictions"] += 1
        log.info("consumer %s evicted; its leases were broken", row.consumer_id)


def _serves_orphan(core: ShardCore, row: ConsumerRow) -> bool:
    """Whether this shard handles a stored consumer no shard has a session for: the shard its
    queues are on, or shard 0 when they are on none (deleted)."""
    shards = core.catalog().consumer_shards(row.consumer_id, row.session_id)
    return core.shard in shards or (not shards and core.shard == 0)
