"""The shard core: what one shard decides, without I/O (DESIGN §6).

`ShardCore.step` takes the records one poll brought (journal, control and ack records) and
returns a `Plan`: the PostgreSQL batch, the deliveries, the entries to dead-letter, replies,
events and records passed on to other shards. The loop (`layer/coordinator/shard.py`) does the
I/O around it: poll → step → dead letters → store → Kafka → offsets.

The core holds the queue engines and the shard's sessions. Its one door to the outside is the
`TopicAdmin` port, asked whether a subscriber's delivery topic exists or can be made (the
answer decides whether the subscribe is refused); tests give it `ports.FakeTopicAdmin`.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from layer.coordinator.acks import Acks
from layer.coordinator.authorize import Refusals
from layer.coordinator.catalog import Catalog
from layer.coordinator.control import Control
from layer.coordinator.deleted import DeletedPartition, deleted_partitions
from layer.coordinator.faults import FaultLedger
from layer.coordinator.fences import Fences, finish_fences, want_fences
from layer.coordinator.identity import Identity
from layer.coordinator.lane import NativeLane
from layer.coordinator.logformat import fields
from layer.coordinator.options import CoordinatorOptions, LoopStats
from layer.coordinator.payloads import RECORD_OVERHEAD, MemoryPool, PayloadCache, record_size
from layer.coordinator.ports import TopicAdmin
from layer.coordinator.refused import Refused
from layer.coordinator.sessions import Session
from layer.coordinator.translate import add_outbox, event_fields, lost_to_retention
from layer.domain import events as ev
from layer.domain.definitions import QueueDefinition, Semantics
from layer.domain.engine import EntryAck, RecordsWanted
from layer.domain.entries import DELETE, OfferedRecord
from layer.domain.errors import ExpressionError
from layer.domain.expressions import RawDocument, is_json_null, parse_document, project
from layer.domain.native import AnyEngine, new_engine
from layer.domain.states import Bookmark, ExpiryReason
from layer.kafka import JournalRecord, OutgoingRecord
from layer.protocol import (
    Codec,
    Event,
    ProtocolError,
    SessionEndReason,
    TopicNames,
    parse_deliver_at,
    parse_expiration,
)
from layer.store.batch import WriteBatch
from layer.store.rows import ConsumerRow, EntryRow, PartitionKey

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_RECORD_LIMIT", "DELIVERY_OVERHEAD", "Plan", "QueueState", "ShardCore",
           "record_limit"]

#: librdkafka's default ``message.max.bytes``: the largest record its producer writes.
DEFAULT_RECORD_LIMIT = 1_000_000
#: Bytes of ack records one step applies at most (at least one record): a 1 MiB record of many
#: items takes ~0.1 s to decode, and every shard of a process shares one thread.
ACK_BYTES_PER_STEP = 2 << 20
#: Malformed or oversized records of one kind are logged at most this often (s) per shard; all
#: are counted.
MALFORMED_LOG_INTERVAL = 60.0

#: Bytes a delivery or a dead letter adds to a journal record's key, value and headers at
#: most (lease fields or ``qlayer.*`` headers, the batch framing, ``qlayer.dlq.*`` headers and
#: Kafka's own record overhead), beside the names of the queue, consumer and session.
DELIVERY_OVERHEAD = 4096


def record_limit(kafka: dict[str, object]) -> int:
    """The largest key + value + headers a record may have for the coordinator to deliver
    it: the producer's ``message.max.bytes`` less what a delivery adds (`DELIVERY_OVERHEAD`).
    A record over it can never be written to a delivery topic, by any retry."""
    configured = kafka.get("message.max.bytes", DEFAULT_RECORD_LIMIT)
    try:
        limit = int(str(configured))
    except ValueError:
        limit = DEFAULT_RECORD_LIMIT
    return max(limit - DELIVERY_OVERHEAD, 1)


@dataclass
class Plan:
    """What one step decided, for the loop to carry out in order."""

    batch: WriteBatch
    replies: list[OutgoingRecord]
    deliveries: list[ev.Delivery] = field(default_factory=list)
    #: Entries that leave to their dead-letter topic (written before the batch is committed).
    expired: list[ev.EntryExpired] = field(default_factory=list)
    #: Entries done: their records' bytes can go once the plan is carried out.
    done: list[Bookmark] = field(default_factory=list)
    events: list[ev.Event] = field(default_factory=list)
    #: This poll's journal records by bookmark (their timestamps go into events).
    fresh: dict[Bookmark, JournalRecord] = field(default_factory=dict)
    #: Control and ack records for other shards (written before the batch is committed).
    forwards: list[OutgoingRecord] = field(default_factory=list)
    #: Next offsets of the control and ack partitions read, committed to Kafka at the end.
    input_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    #: Entries whose records a filter needs read again (their documents were projected past
    #: the memory window without the fields it reads), for `ShardCore.refresh_documents`.
    wanted_documents: list[Bookmark] = field(default_factory=list)
    stats: LoopStats = field(default_factory=LoopStats)


@dataclass
class QueueState:
    """A queue as PostgreSQL and Kafka have it, loaded by the loop for `ShardCore.add_queue`."""

    definition: QueueDefinition
    version: int
    entries: list[EntryRow]
    #: Where each journal partition's replay starts (recovery point or `recovery_point`).
    starts: dict[tuple[str, int], int]
    stored_points: dict[PartitionKey, int]
    admitted: dict[PartitionKey, int]
    #: Each partition's first offset still in Kafka (retention).
    log_starts: dict[tuple[str, int], int]
    #: Each journal partition the queue's underlying topic matches that Kafka lists, with
    #: its end offset: stored state of a partition not here, or past its end, describes a
    #: log that was deleted (`layer.coordinator.deleted`). None: not checked.
    ends: dict[tuple[str, int], int] | None = None
    #: The parts of a queue of several parts this shard serves (None: the whole queue).
    parts_served: frozenset[int] | None = None


def _newly_admitted(e: ev.EntriesEnqueued, counted_from: dict[tuple[str, int], int]
                    ) -> ev.EntriesEnqueued:
    """The event without the offsets below where the queue had been admitted to before."""
    start = counted_from.get((e.topic, e.partition))
    if start is None or not e.offsets or e.offsets[0] >= start:
        return e
    return e._replace(offsets=tuple(o for o in e.offsets if o >= start))


class ShardCore:
    """The engines and sessions of one shard, and every decision about them."""

    def __init__(self, shard: int, options: CoordinatorOptions, *, topics: TopicNames,
                 catalog: Callable[[], Catalog], admin: TopicAdmin,
                 tokens: Callable[[], str], owner_id: str,
                 memory: MemoryPool | None = None,
                 counters: Counter[str] | None = None,
                 refusals: Refusals | None = None) -> None:
        self.shard = shard
        self.options = options
        self.topics = topics
        self.catalog = catalog
        self.admin = admin
        self.tokens = tokens
        self.owner_id = owner_id
        self.memory = memory
        self.codec = Codec()
        self.counters: Counter[str] = counters if counters is not None else Counter()
        #: Ack items read per consumer id (one addition per ack record, for the metrics
        #: endpoint); kept through rebuilds like ``counters``, pruned to the live sessions
        #: when the metrics are read (`layer.coordinator.metrics`).
        self.consumer_acks: Counter[str] = Counter()
        self.epoch = 0
        #: Whether the queues' engines are the native port (`CoordinatorOptions.core`).
        self.native = options.native_core
        #: Records not acted on, by kind, reason and principal (`layer.coordinator.authorize`).
        self.refusals = refusals if refusals is not None else Refusals()
        self.identity = Identity(self.counters, options.require_identity, self.refusals)
        #: The shard's fault and refusal counters, stored by each iteration's transaction.
        self.faults = FaultLedger(self.counters, self.refusals)
        self.acks = Acks(self)
        self.control = Control(self)
        #: The native batch paths (native engines only): records in, rows, events and
        #: delivery batches out, without Python objects per message.
        self.lane: NativeLane | None = None
        self.payloads: PayloadCache | Any = PayloadCache(options.payload_budget, pool=memory)
        # Journal records of this step read with a fault that stays with the record, per
        # topic (`_count_input_faults`), and when each queue's unparseable values may be
        # logged again.
        self.input_faults: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._unparseable_logged: dict[str, float] = {}
        self._malformed_logged: dict[str, float] = {}
        #: The largest key + value + headers of a journal record the shard can deliver
        #: (`record_limit`, from the producer's ``message.max.bytes``). A larger one is never
        #: handed to the producer: its entries expire as ``too-large``. A delivery topic with
        #: a lower ``max.message.bytes`` refuses records after the fact (`too_large`).
        self.record_limit = DEFAULT_RECORD_LIMIT - DELIVERY_OVERHEAD
        #: Queues whose journal partitions were deleted while read: which, and when (for the
        #: shard's report and `qlayer stats`); kept across rebuilds of the shard.
        self.journal_deleted: dict[str, tuple[str, float]] = {}
        self.reset()

    def reset(self) -> None:
        """Forget everything (a rebuild): nothing here outlives a failure."""
        self.engines: dict[str, AnyEngine] = {}
        #: Queues of several parts this shard serves some of (docs/coordinator.md,
        #: "Partitioned queues"): their acks of the other parts' partitions are passed on.
        self.split: set[str] = set()
        self.versions: dict[str, int] = {}
        self.sessions: dict[str, Session] = {}
        #: Per queue: (consumer id, bookmark) of the leases restored from PostgreSQL when it was
        #: loaded (protocol 8 credit reports count those still waiting for the replay).
        self.restored_leases: dict[str, set[tuple[str, Bookmark]]] = {}
        self.payloads.clear()
        if self.native:
            self.lane = NativeLane(self)
            self.payloads = self.lane.payloads
        else:
            self.payloads = PayloadCache(self.options.payload_budget, pool=self.memory)
        self.known_topics: set[str] = set()
        #: The iteration (its `now`) that last listed the broker's topics (`Output.answerable`).
        self.topics_listed_at = float("-inf")
        self._queues_by_topic: dict[str, list[AnyEngine]] = {}
        # target_queue_depth: the queue whose deferred records are being offered again
        # (`readmit`; they go to it alone and are not counted as input again), and the
        # records it read back, kept for the next step like a poll's (`Plan.fresh`).
        self.rereading_for: AnyEngine | None = None
        self._readmitted: dict[Bookmark, JournalRecord] = {}
        self.persisted_points: dict[PartitionKey, int] = {}
        # Per partition of each queue: the next offset not admitted yet, and what is stored of
        # it. A restart re-admits [recovery point, stored admitted_to) without counting those
        # entries as enqueued again (`counted_from`).
        self._admitted_to: dict[PartitionKey, int] = {}
        self._persisted_admitted: dict[PartitionKey, int] = {}
        self._counted_from: dict[str, dict[tuple[str, int], int]] = {}
        # Entries lost to retention, found while (re)building a queue: reported (events,
        # counters) by the next step, with the queue's own decisions.
        self._lost: dict[str, list[ev.Event]] = {}
        # Journal partitions found deleted while (re)building a queue: the next step expires
        # their entries and resets their stored positions, in one transaction.
        self._deleted: dict[str, list[DeletedPartition]] = {}
        self._input_offsets: dict[tuple[str, int], int] = {}
        # Positions read past acks that wait for the replay, stored once they are applied.
        self._held_positions: dict[tuple[str, int], int] = {}
        # Deliveries found too large outside a step (a delivery topic refused their record):
        # dead-lettered from their queues by the next step, before it dispatches anything.
        self._too_large: list[Refused] = []
        # ACK_REFUSED / SUBSCRIBE_REFUSED events of this step (the engines never see what was
        # refused, so these do not come from their outboxes).
        self.pending_events: list[Event] = []
        self.forwards: list[OutgoingRecord] = []
        self._next_position_write = 0.0
        # Ack records read and not applied yet (`step`: over the budget, or waiting for a
        # fresher catalog), with when each was first read.
        self._carried: list[tuple[JournalRecord, float]] = []
        #: Transactional sessions to fence before their leases break (protocol 9,
        #: `layer.coordinator.fences`); a rebuild finds them again: the engines it restores
        #: hold their leases again, and a stored eviction is read again.
        self.fences = Fences()
        #: Whether any transactional session was seen: until then a step asks no engine for
        #: fences (nothing on the hot path for consumers without transactions).
        self.transactional_seen = False
        #: How far the shard's ack partition is read (`read_committed`), set by the shard
        #: before each step: a fenced session ends once it is past the fence's ack end.
        self.ack_read_to: int | None = None
        self.acks.reset()
        self.control.reset()

    @property
    def waiting(self) -> bool:
        """Whether input read by earlier steps waits to be applied (ack records over the
        step's budget, records held for a fresher catalog): the next step should come soon."""
        return bool(self._carried or self.control.held)

    def count_malformed(self, kind: str, r: JournalRecord, why: object, now: float,
                        oversized: bool = False) -> None:
        """A control or ack record that cannot be read (or is larger than its topic's limit):
        counted, and logged at most once a minute per kind, however many come (a flood of them
        must not become a flood of log lines)."""
        name = f"{'oversized' if oversized else 'malformed'}_{kind}_records"
        self.counters[name] += 1
        self.refusals.count(kind, "oversized" if oversized else "malformed", None)
        if now < self._malformed_logged.get(name, float("-inf")) + MALFORMED_LOG_INTERVAL:
            return
        self._malformed_logged[name] = now
        log.warning("%s record on %s[%d]@%d not read: %s (counted as %s, %d so far; logged at "
                    "most once a minute)", kind, r.topic, r.partition, r.offset, why, name,
                    self.counters[name],
                    extra=fields(shard=self.shard, reason=name))

    # ------------------------------------------------------------------ the step
    def step(self, records: list[JournalRecord], now: float, batch: WriteBatch | None = None,
             replies: list[OutgoingRecord] | None = None) -> Plan:
        """Decide what this poll's records, and the passing of time, mean for the shard.

        ``batch`` and ``replies`` may hold what maintenance decided before the step."""
        plan = Plan(batch if batch is not None else WriteBatch(),
                    replies if replies is not None else [])
        stats = plan.stats
        batch, replies = plan.batch, plan.replies
        self.control.accepted.clear()
        if self._deleted:
            # First: the rows of a deleted log go before new entries at its offsets come.
            self._expire_deleted(batch, now)
        offsets = self._input_offsets
        if self.acks.deferred:
            self.acks.retry_deferred(now, replies)
            if not self.acks.deferred:
                # Their records' positions were held back while they waited: store them now,
                # or a crash would read those records again and answer DUPLICATE.
                offsets.update(self._held_positions)
                self._held_positions = {}
        control_topic, ack_topic = self.topics.control, self.topics.ack
        journal: list[JournalRecord] = []
        controls: list[JournalRecord] = []
        acks: list[JournalRecord] = []
        for r in records:
            if r.topic == ack_topic:
                acks.append(r)
            elif r.topic == control_topic:
                controls.append(r)
            else:
                journal.append(r)
        # Ack records are applied up to a budget of bytes per step (`ACK_BYTES_PER_STEP`), so
        # that a flood of large ack records cannot hold the process's one thread (every
        # shard's) for long; the rest, and records naming a session the catalog does not know
        # yet, wait for the next step in order, their positions not stored past them.
        if acks or self._carried:
            spent = 0
            carried, self._carried = self._carried, []
            waiting: set[tuple[str, int]] = set()
            for r, came in carried + [(r, now) for r in acks]:
                tp = (r.topic, r.partition)
                if tp in waiting or (spent >= ACK_BYTES_PER_STEP and spent):
                    self._carried.append((r, came))
                    waiting.add(tp)
                    continue
                spent += len(r.value or b"")
                applied = self.acks.on_record(r, now, replies, came)
                if applied is None:
                    self._carried.append((r, came))
                    waiting.add(tp)
                    self.control.wants_catalog = True
                    continue
                stats.ack_items += applied
                offsets[tp] = r.offset + 1
            if self._carried:
                self.counters["ack_records_carried"] += len(self._carried)
        # Acks before control records: a consumer acks, then unsubscribes on another topic;
        # both may arrive in one poll, and the acks must not find their leases broken.
        # Records held for a fresher catalog go first, in their order (`Control.hold`).
        control = self.control
        stats.control_records = len(controls)
        for r, came in control.release() + [(r, now) for r in controls]:
            if control.holds(r) or not control.on_record(r, now, batch, replies, came):
                control.hold(r, came)
                continue
            offsets[(r.topic, r.partition)] = r.offset + 1
        stats.journal_records = len(journal)
        if self.fences.pending:
            # After this step's acks: what a fenced session committed is settled first.
            finish_fences(self, now, batch, replies)
        lane = self.lane
        if lane is not None:
            if journal:
                lane.enqueue(journal, now)
                self._expire_too_large(self._oversize(journal), now)
                self._count_input_faults(batch, now)
            self._expire_refused(now)
            lane.decide(plan, now)
        else:
            plan.fresh = self._enqueue(journal, now) if journal else {}
            if self._readmitted:
                plan.fresh.update(self._readmitted)
                self._readmitted = {}
            if journal:
                self._count_input_faults(batch, now)
            self._expire_refused(now)
            self._decide(plan, now)
        if self.transactional_seen:
            want_fences(self, now)
        if control.credit.credited:
            # After the deliveries: what credited sessions hold and what waits (protocol 8).
            control.credit.notices(plan.replies)
        # One guarded transaction for everything decided, with how far the inputs were
        # applied: a restart reads on from there and applies no ack twice. Records that
        # changed nothing stored (at-most-once acks, refused items) do not make a
        # transaction of their own more than once a second: read again after a crash, they
        # change nothing either.
        # Fault and refusal counts go with the positions of the records that made them.
        counted = self.faults.pending()
        if counted:
            batch.shard_counts.update(counted)
        deferred_from = self.acks.deferred_from
        if deferred_from:
            for tp, held in deferred_from.items():
                if offsets.get(tp, held) > held:
                    self._held_positions[tp] = offsets[tp]
                    offsets[tp] = held
        if offsets and (not batch.is_empty() or now >= self._next_position_write):
            for tp, offset in offsets.items():
                batch.set_input_position(tp[0], tp[1], offset)
            self._next_position_write = now + 1.0
        plan.input_offsets, self._input_offsets = offsets, {}
        plan.forwards, self.forwards = self.forwards, []
        return plan

    def acks_waiting(self) -> bool:
        """Whether an ack record of this shard's partition was read and not applied yet
        (deferred for the journal's replay, or carried to a later step)."""
        ack = (self.topics.ack, self.shard)
        return bool(self.acks.deferred) or any((r.topic, r.partition) == ack
                                               for r, _ in self._carried)

    def fence_first(self, session: Session, end: SessionEndReason, message: str) -> bool:
        """The one rule of every path that would break a session's leases at once (protocol
        9): True for a session that settles in Kafka transactions, whose producer is fenced
        first and which ends later (`layer.coordinator.fences.finish_fences`, told ``end``
        and ``message``); False for any other, which the caller ends now."""
        if session.transactional_id is None:
            return False
        if self.fences.want(session.consumer_id, session.session_id,
                            session.transactional_id, end, message):
            self.counters["fences_wanted"] += 1
            log.info("consumer %s: transactional session %s is fenced before its leases "
                     "break: %s", session.consumer_id, session.session_id, message,
                     extra=fields(consumer=session.consumer_id, shard=self.shard,
                                  reason="fence"))
        return True

    def _decide(self, plan: Plan, now: float) -> None:
        """Timers, matching and the engines' outboxes: deliveries, batch rows, events."""
        batch, deliveries = plan.batch, plan.deliveries
        outboxes: list[tuple[str, ev.Outbox]] = []
        for name, engine in self.engines.items():
            engine.tick(now)
            # After a restart: the deliveries of restored leases, which the crash may have
            # kept from being written (Postgres is committed before Kafka is written).
            resent = engine.resends(now)
            if resent:
                self.counters["deliveries_resent"] += len(resent)
                deliveries.extend(resent)
            deliveries.extend(engine.dispatch(now))
            wanted = engine.documents_wanted()
            if wanted:
                plan.wanted_documents.extend(wanted)
            outbox = engine.drain()
            lost = self._lost.pop(name, None)
            if lost:
                outbox = ev.Outbox(lost + outbox.events, outbox.entries)
            outboxes.append((name, outbox))
        done, expired, events, fresh = plan.done, plan.expired, plan.events, plan.fresh
        points = batch.recovery_points
        for name, outbox in outboxes:
            counted_from = self._counted_from.get(name)
            self._recovery_points(name, batch)
            # Done entries this batch's recovery points pass get no row: the store's prune
            # removes every row below a recovery point (on the happy path, every ack).
            passed = {(k.topic, k.partition): offset for k, offset in points.items()
                      if k.queue == name}
            add_outbox(batch, name, outbox, counted_from, passed)
            for e in outbox.events:
                kind = type(e)
                if kind is ev.EntriesEnqueued:
                    self._hold(e, fresh)  # type: ignore[arg-type]
                    if counted_from:
                        # Entries a restart re-admits were announced by the incarnation that
                        # first admitted them (their events went through its outbox): each
                        # state change has one event, so they are not announced again.
                        e = _newly_admitted(e, counted_from)  # type: ignore[arg-type]
                        if not e.offsets:
                            continue
                events.append(e)
                if kind is ev.EntriesEnqueued:
                    pass
                elif kind is ev.EntryAcked:
                    done.append(e.bookmark)  # type: ignore[union-attr]
                elif kind is ev.EntryExpired:
                    done.append(e.bookmark)  # type: ignore[union-attr]
                    if e.dead_letter:  # type: ignore[union-attr]
                        expired.append(e)  # type: ignore[arg-type]
                elif kind is ev.DeliveryRefused:
                    expired.append(e)  # type: ignore[arg-type]
                elif kind is ev.ConsumerLeft:
                    self.control.on_consumer_left(e, batch, plan.replies, now)  # type: ignore[arg-type]

    def settled(self, plan: Plan) -> None:
        """The plan was carried out: the bytes of the entries it finished can go."""
        for bookmark in plan.done:
            self.payloads.release(bookmark)
        if self.lane is not None:
            self.lane.settle()

    # ------------------------------------------------------------------ journal records
    def _engines_for(self, topic: str) -> list[AnyEngine]:
        if self.rereading_for is not None:
            return [self.rereading_for]
        engines = self._queues_by_topic.get(topic)
        if engines is None:
            engines = [e for e in self.engines.values() if e.definition.matches_topic(topic)]
            self._queues_by_topic[topic] = engines
        return engines

    def _enqueue(self, records: list[JournalRecord], now: float) -> dict[Bookmark, JournalRecord]:
        """Offer journal records to every queue whose underlying topic matches."""
        by_topic: dict[str, list[JournalRecord]] = {}
        for r in records:
            by_topic.setdefault(r.topic, []).append(r)
        fresh: dict[Bookmark, JournalRecord] = {}
        # What the payload budget still takes: records past it are projected below.
        room = self.payloads.budget - self.payloads.bytes
        too_large_at = self.record_limit + RECORD_OVERHEAD
        oversize: list[JournalRecord] = []
        for topic, rs in by_topic.items():
            engines = self._engines_for(topic)
            if not engines:
                continue
            # Every record keeps its document, even when no expression reads it now: a
            # consumer may subscribe later with a filter. Within the memory window it is the
            # record's bytes, parsed when an expression first reads them (`RawDocument`:
            # the bytes are held for delivery anyway). Past it only the fields the queues'
            # expressions read now are kept (DESIGN §2): a filter subscribed later sees null
            # in other fields there.
            fields: frozenset[str] | None = None
            offered = []
            for r in rs:
                doc: object
                if r.value is None:
                    # A tombstone is a delete, not a publish: no queue gets an entry for it.
                    if self.rereading_for is None:  # counted when it was first read
                        self.counters["deletes_passed_over"] += 1
                        self.input_faults[topic]["deletes"] += 1
                    offered.append(OfferedRecord(r.topic, r.partition, r.offset, r.key, DELETE))
                    continue
                deliver_at_ms, expiration_ms = self._timing(r) if r.headers else (None, None)
                size = record_size(r)
                room -= size
                if size > too_large_at:
                    oversize.append(r)
                if room >= 0:
                    doc = RawDocument(r.value)
                else:
                    if fields is None:
                        fields = frozenset().union(*(e.fields_needed() for e in engines))
                    # No expression reads a field: nothing to keep, and nothing to parse (an
                    # empty object per entry was 64 bytes, and the parse the costliest step).
                    doc = self.project_value(topic, r.value, fields) if fields else None
                    self.counters["documents_projected"] += 1
                offered.append(OfferedRecord(
                    r.topic, r.partition, r.offset, r.key,
                    doc,
                    r.timestamp_ms / 1000.0 if r.timestamp_ms > 0 else None,
                    deliver_at_ms / 1000.0 if deliver_at_ms is not None else None,
                    expiration_ms / 1000.0 if expiration_ms is not None else None,
                ))
                fresh[Bookmark(r.topic, r.partition, r.offset)] = r
            last: dict[int, int] = {}
            for r in rs:
                last[r.partition] = r.offset
            admitted = self._admitted_to
            for engine in engines:
                engine.enqueue(offered, now, fields)
                for partition, offset in last.items():
                    key = PartitionKey(engine.name, topic, partition)
                    if offset >= admitted.get(key, 0):
                        admitted[key] = offset + 1
        if oversize:
            self._expire_too_large(oversize, now)
        return fresh

    def _oversize(self, records: list[JournalRecord]) -> list[JournalRecord]:
        """The records larger than the shard can deliver (`record_limit`). The values are
        looked at first (a length each); key and headers only for a value over half the
        limit, the only ones that can tip it over in practice."""
        half = self.record_limit // 2
        limit = self.record_limit + RECORD_OVERHEAD
        return [r for r in records if r.value is not None and len(r.value) > half
                and record_size(r) > limit]

    def _expire_too_large(self, records: list[JournalRecord], now: float) -> None:
        """Entries of records no delivery topic takes leave their queues at once (reason
        ``too-large``, dead-lettered) in the step that admitted them, before any dispatch:
        the producer never sees them, so they cannot fail an iteration (issue 15, 2a)."""
        for r in records:
            bookmark = Bookmark(r.topic, r.partition, r.offset)
            size = record_size(r) - RECORD_OVERHEAD
            detail = (f"key, value and headers are {size} bytes; the coordinator delivers at "
                      f"most {self.record_limit}")
            expired = sum(engine.expire_entries([bookmark], ExpiryReason.TOO_LARGE, now, detail)
                          for engine in self._engines_for(r.topic))
            if expired:
                self.counters["too_large"] += expired
                log.error("%s[%d]@%d is too large to deliver (%s): dead-lettered from %d "
                          "queue(s), reason too_large", r.topic, r.partition, r.offset,
                          detail, expired)

    def too_large(self, deliveries: list[Refused]) -> None:
        """Deliveries a topic refused as too large (a topic's ``max.message.bytes`` under the
        producer's), each still refused alone: the next step dead-letters them."""
        self._too_large.extend(deliveries)

    def _expire_refused(self, now: float) -> None:
        """The refused deliveries leave the queue that made them (reason ``too-large``,
        dead-lettered); another queue over the same journal keeps its own entry. A leased
        entry (at-least-once) is expired by its engine. An at-most-once entry left the queue
        when it was delivered: `ev.DeliveryRefused` dead-letters its record and says so in
        the events, so the message is neither delivered nor lost. A barrier reached the
        other consumers, and is only logged."""
        if not self._too_large:
            return
        found, self._too_large = self._too_large, []
        detail = "a delivery topic refused the record as too large"
        expired: Counter[str] = Counter()
        consumers = {s.delivery_topic: s.consumer_id for s in self.sessions.values()}
        for queue, bookmark, lease, delivery_count, barrier, topic in found:
            engine = self.engines.get(queue)
            if engine is None:
                continue  # the queue was removed since: nothing of it is left to settle
            if barrier:
                self.counters["barrier_refused"] += 1
                log.error("queue %s: a delivery topic refused barrier %s as too large; the "
                          "other consumers have it", queue, bookmark,
                          extra=fields(queue=queue, reason="too_large"))
            elif engine.definition.semantics is Semantics.AT_MOST_ONCE:
                # The consumer never got it, so it cannot ack it: its backlog slot is freed
                # with the delivery's own token (else it stays taken for a lease period).
                engine.ack([EntryAck(bookmark, lease)], now)
                # The refusing topic names the consumer (its session may have ended since).
                self._lost.setdefault(queue, []).append(ev.DeliveryRefused(
                    queue, bookmark, ExpiryReason.TOO_LARGE, True, delivery_count, 0,
                    consumers.get(topic) if topic is not None else None, detail, now))
                expired[queue] += 1
            else:
                expired[queue] += engine.expire_entries([bookmark], ExpiryReason.TOO_LARGE,
                                                        now, detail)
        for queue, n in expired.items():
            if n:
                self.counters["too_large"] += n
                log.error("queue %s: %d entries dead-lettered, reason too_large (%s)",
                          queue, n, detail, extra=fields(queue=queue, reason="too_large"))

    def project_value(self, topic: str, value: bytes, fields: frozenset[str]) -> object:
        """A record's document past the memory window: the fields the queues read. A value
        that is not JSON is counted for the queues whose own expressions read it."""
        document = parse_document(value)
        if document is None and not is_json_null(value) and self.rereading_for is None:
            self.input_faults[topic]["unparseable"] += 1
        return project(document, fields)

    def _count_input_faults(self, batch: WriteBatch, now: float) -> None:
        """This step's journal records read with a fault that stays with the record, into
        each queue's stored counters (`qlayer stats`): deletes and unreadable qlayer headers
        for every queue over the journal; values that are not JSON for the queues whose
        filter, priority or barrier read them, logged at most once a minute per queue."""
        faults, self.input_faults = self.input_faults, defaultdict(Counter)
        for topic, counts in faults.items():
            for engine in self._engines_for(topic):
                reads = bool(engine.definition.expression_fields)
                for name, n in counts.items():
                    if n and (reads or name != "unparseable"):
                        batch.count(engine.name, name, n)
        for engine in self.engines.values():
            if not engine.definition.expression_fields:
                continue
            n, first = engine.take_unparseable()
            if not n:
                continue
            batch.count(engine.name, "unparseable", n)
            if now >= self._unparseable_logged.get(engine.name, 0.0):
                self._unparseable_logged[engine.name] = now + 60.0
                log.warning(
                    "queue %s: %d record(s) whose value is not JSON were read by its filter, "
                    "priority or barrier (e.g. %s): the filter is false, the priority lowest "
                    "(counted as unparseable in qlayer stats; logged at most once a minute)",
                    engine.name, n, "-" if first is None
                    else f"{first.topic}[{first.partition}]@{first.offset}",
                    extra=fields(queue=engine.name, shard=self.shard, reason="unparseable"))

    def refresh_documents(self, records: dict[Bookmark, JournalRecord]) -> int:
        """Records read again for `Plan.wanted_documents`: each queue over their journal gets
        their documents projected on every field its expressions read now. Returns how many
        entries got one."""
        by_topic: dict[str, dict[Bookmark, JournalRecord]] = {}
        for bookmark, record in records.items():
            by_topic.setdefault(bookmark.topic, {})[bookmark] = record
        refreshed = 0
        for topic, found in by_topic.items():
            engines = self._engines_for(topic)
            if not engines:
                continue
            fields = frozenset().union(*(e.fields_needed() for e in engines))
            docs: dict[Bookmark, object] = {
                b: project(parse_document(r.value), fields) for b, r in found.items()}
            for engine in engines:
                refreshed += engine.refresh_documents(docs, fields)
        self.counters["documents_reread"] += refreshed
        return refreshed

    # ------------------------------------------------------------------ deferred records
    def records_wanted(self) -> list[tuple[str, RecordsWanted]]:
        """Per queue, the ranges of records deferred past its ``target_queue_depth`` that it
        has room for now (`QueueEngine.records_wanted`), for the loop to read again."""
        wanted: list[tuple[str, RecordsWanted]] = []
        for name, engine in self.engines.items():
            if engine.definition.target_queue_depth is not None:
                wanted.extend((name, w) for w in engine.records_wanted())
        return wanted

    def readmit(self, name: str, records: list[JournalRecord],
                through: dict[tuple[str, int], int], now: float) -> None:
        """Records read again for the queue's `records_wanted`, per partition every record
        from its first deferred offset up to ``through``: offered to that queue alone, the
        way a poll's records are (payload budget, projections, deliver-at and expiration
        headers), in record-timestamp order across partitions (the order they arrived in the
        journals, as near as Kafka says). Their bytes stay for the next step."""
        engine = self.engines.get(name)
        if engine is None:
            return
        records = sorted(records, key=lambda r: (r.timestamp_ms, r.partition, r.offset))
        engine.expect_rereads(through)
        self.rereading_for = engine
        try:
            if self.lane is not None:
                self.lane.enqueue(records, now)
                self._expire_too_large(self._oversize(records), now)
            else:
                self._readmitted.update(self._enqueue(records, now))
        finally:
            self.rereading_for = None
            engine.finish_rereads()
        self.counters["deferred_reread"] += len(records)

    def _timing(self, r: JournalRecord) -> tuple[int | None, int | None]:
        """The record's deliver-at time and its own expiration (ms). A malformed header is
        the producer's mistake, so it is counted and ignored (docs/protocol.md §5.3): the
        message is available at once, or keeps the queue's expiration, rather than stopping
        every queue on a record that would fail the same way after each restart."""
        deliver_at: int | None = None
        expiration: int | None = None
        try:
            deliver_at = parse_deliver_at(r.headers)
        except ProtocolError as exc:
            if self.rereading_for is None:  # counted and logged when it was first read
                self.counters["malformed_deliver_at_headers"] += 1
                self.input_faults[r.topic]["malformed_headers"] += 1
            log.warning("ignoring the deliver-at header of %s[%d]@%d: %s", r.topic,
                        r.partition, r.offset, exc)
        try:
            expiration = parse_expiration(r.headers)
        except ProtocolError as exc:
            if self.rereading_for is None:
                self.counters["malformed_expiration_headers"] += 1
                self.input_faults[r.topic]["malformed_headers"] += 1
            log.warning("ignoring the expiration header of %s[%d]@%d: %s", r.topic,
                        r.partition, r.offset, exc)
        return deliver_at, expiration

    def _hold(self, e: ev.EntriesEnqueued, fresh: dict[Bookmark, JournalRecord]) -> None:
        for offset in e.offsets:
            bookmark = Bookmark(e.topic, e.partition, offset)
            record = fresh.get(bookmark) or self.payloads.get(bookmark)
            if record is not None:
                self.payloads.hold(bookmark, record)

    def _recovery_points(self, name: str, batch: WriteBatch) -> None:
        """Moved recovery points, each with how far its partition was admitted."""
        engine = self.engines[name]
        deferred = engine.deferred() if engine.definition.target_queue_depth else {}
        for (topic, partition), offset in engine.recovery_points().items():
            key = PartitionKey(name, topic, partition)
            admitted = self._admitted_to.get(key)
            held = deferred.get((topic, partition))
            if admitted is not None and held is not None and admitted > held:
                # Deferred records were not admitted: a restart counts them when they are.
                admitted = self._admitted_to[key] = held
            if (self.persisted_points.get(key) != offset
                    or self._persisted_admitted.get(key) != admitted):
                batch.set_recovery_point(name, topic, partition, offset)
                self.persisted_points[key] = offset
                if admitted is not None:
                    batch.set_admitted(name, topic, partition, admitted)
                    self._persisted_admitted[key] = admitted

    def admitted_to(self, name: str, partition: tuple[str, int]) -> int:
        """The next offset of a journal partition the queue has not admitted (0: none)."""
        return self._admitted_to.get(PartitionKey(name, *partition), 0)

    def _expire_deleted(self, batch: WriteBatch, now: float) -> None:
        """The entries of the journal partitions found deleted when their queues were built
        expire (reason ``journal_deleted``, each with its EXPIRED event), and the partitions'
        stored positions start over (at a log made again's start, else 0) with no row left:
        in the transaction of this step, so a crash before it finds them again, and one
        after it finds nothing. The same on both cores: no engine holds these entries."""
        codec = self.codec
        encode = codec.event_encoder.encode_fields
        for name, found in self._deleted.items():
            closed: list[ev.Event] = []
            for d in found:
                start = d.start if d.start is not None else 0
                batch.forget_partition(name, d.topic, d.partition)
                batch.set_recovery_point(name, d.topic, d.partition, start)
                batch.set_admitted(name, d.topic, d.partition, start)
                closed.extend(d.expired)
            if closed:
                add_outbox(batch, name, ev.Outbox(closed, []))
                batch.put_events(codec.event_arrays([
                    codec.event_item(encode(self.owner_id, self.epoch, *f))
                    for f in event_fields(closed, session_of=self.session_id_of)]))
                batch.count(name, "journal_deleted", len(closed))
            self.counters["journal_deleted"] += len(closed)
            self.counters["journals_deleted"] += len(found)
            lost = ", ".join(f"{d.topic}[{d.partition}]" for d in found)
            self.journal_deleted[name] = (lost, now)
            log.error("queue %s: journal partition(s) %s were deleted (or deleted and made "
                      "again) while no coordinator served the queue: %d entries expired (reason "
                      "journal_deleted); the queue reads on without them, from a new log's "
                      "start", name, lost, len(closed),
                      extra=fields(queue=name, shard=self.shard, reason="journal_deleted"))
        self._deleted = {}

    # ------------------------------------------------------------------ queues
    def add_queue(self, state: QueueState, rows: Iterable[ConsumerRow], now: float
                  ) -> dict[tuple[str, int], int]:
        """Serve a queue from its stored state; returns where its partitions' reads start.

        Retention may have deleted records the queue had not finished: those entries
        expire (reason retention), loudly, and the reads start at the log's start."""
        from layer.coordinator.translate import entry_record

        definition = state.definition
        name = definition.name
        session_of = {row.consumer_id: row.session_id for row in rows}
        session_of.update((s.consumer_id, s.session_id) for s in self.sessions.values())
        engine = new_engine(definition, tokens=self.tokens,
                            session_timeout=self.options.default_session_timeout,
                            native=self.native)
        if state.parts_served is not None:
            engine.serve_parts(definition.parts, state.parts_served)
        starts = dict(state.starts)
        kept, stored_points, admitted = state.entries, state.stored_points, state.admitted
        deleted = (deleted_partitions(definition, stored_points, admitted, kept, state.ends,
                                      state.log_starts, now)
                   if state.ends is not None else [])
        if deleted:
            # Nothing stored of a deleted log is used: a journal made again is read from its
            # new start, its records new entries (ENQUEUED); the old entries expire.
            gone = {(d.topic, d.partition) for d in deleted}
            kept = [r for r in kept if (r.topic, r.partition) not in gone]
            restarted = {PartitionKey(name, d.topic, d.partition): d.start for d in deleted
                         if d.start is not None}
            stored_points = {k: v for k, v in stored_points.items()
                             if (k.topic, k.partition) not in gone}
            stored_points.update(restarted)
            admitted = {k: v for k, v in admitted.items() if (k.topic, k.partition) not in gone}
            admitted.update(restarted)
            starts.update({(k.topic, k.partition): v for k, v in restarted.items()})
            self._deleted[name] = deleted
        entries = [entry_record(row, session_of) for row in kept]
        engine.restore(entries, starts)
        # Leases that wait for the replay to reach their record are not the engine's yet; a
        # credit report (protocol 8) counts them meanwhile (`Credit.report`).
        self.restored_leases[name] = {
            (row.lease_consumer, Bookmark(row.topic, row.partition, row.offset))
            for row in kept if row.lease_consumer is not None and row.state == "LEASED"}
        stored_entries = {e.bookmark: e for e in entries}
        for (topic, partition), start in list(starts.items()):
            first = state.log_starts.get((topic, partition), 0)
            if first > start:
                # The engine settles the entries it knows of (persisted rows); the events and
                # counters cover every lost offset, including those never delivered.
                engine.expire_before(topic, partition, first, now)
                lost = lost_to_retention(name, topic, partition, start, first,
                                         stored_entries, now)
                self._lost.setdefault(name, []).extend(lost)
                self.counters["retention_expired"] += len(lost)
                log.error("queue %s: %s[%d] offsets %d..%d were deleted by retention before "
                          "the queue was done with them; %d entries expired (reason retention)",
                          name, topic, partition, start, first - 1, len(lost))
                starts[(topic, partition)] = first
        self.engines[name] = engine
        if state.parts_served is not None:
            self.split.add(name)
        self.versions[name] = state.version
        for topic, partition in starts:
            key = PartitionKey(name, topic, partition)
            self.persisted_points[key] = stored_points.get(key, -1)
        self._admitted_to.update(admitted)
        self._persisted_admitted.update(admitted)
        self._counted_from[name] = {(k.topic, k.partition): v for k, v in admitted.items()}
        self._queues_by_topic.clear()
        if self.lane is not None:
            self.lane.forget_topics()
        return starts

    def add_partitions(self, name: str, starts: dict[tuple[str, int], int]) -> None:
        """Journal partitions (or topics) the queue's underlying topic matches since."""
        self.engines[name].restore([], starts)
        self._queues_by_topic.clear()
        if self.lane is not None:
            self.lane.forget_topics()

    def drop_queue(self, name: str, keep_sessions: bool = False) -> None:
        self.engines.pop(name)
        self.split.discard(name)
        self.restored_leases.pop(name, None)
        # Found again from what is stored (unchanged until a step writes it) if the queue
        # is added again.
        self._deleted.pop(name, None)
        self.versions.pop(name, None)
        for known in (self.persisted_points, self._admitted_to, self._persisted_admitted):
            for key in [k for k in known if k.queue == name]:
                del known[key]
        self._counted_from.pop(name, None)
        self._queues_by_topic.clear()
        if self.lane is not None:
            self.lane.forget_topics()
        if keep_sessions:
            return
        for session in self.sessions.values():
            if name in session.queues:
                session.queues.remove(name)
            if name in session.draining:
                session.draining.remove(name)

    def resubscribe(self, name: str, now: float) -> None:
        """A rebuilt queue gets the sessions it had."""
        engine = self.engines.get(name)
        if engine is None:
            return
        for s in self.sessions.values():
            if name in s.queues:
                engine.subscribe(s.consumer_id, s.session_id, now, delivery_topic=s.delivery_topic,
                                 max_backlog=s.max_backlog, filter=s.filter,
                                 session_timeout=s.session_timeout, share=s.share)
                self.mark_transactional(engine, s)

    def mark_transactional(self, engine: AnyEngine, session: Session) -> None:
        """A session that settles in Kafka transactions (protocol 9): the engine holds its
        leases for a fence (`layer.coordinator.fences`)."""
        if session.transactional_id is not None:
            engine.set_transactional(session.consumer_id)
            self.transactional_seen = True

    def subscribe_regex_sessions(self, name: str, now: float) -> None:
        """A regex subscription covers queues created after it (as AMPS regex topics do)."""
        engine = self.engines.get(name)
        if engine is None:
            return
        entitlements = self.catalog().entitlements
        for s in self.sessions.values():
            if (s.is_regex and s.matches(name) and name not in s.queues
                    and entitlements.may_consume(s.principal, name)):
                engine.subscribe(s.consumer_id, s.session_id, now, delivery_topic=s.delivery_topic,
                                 max_backlog=s.max_backlog, filter=s.filter,
                                 session_timeout=s.session_timeout, share=s.share)
                self.mark_transactional(engine, s)
                s.queues.append(name)

    def restore_sessions(self, rows: Iterable[ConsumerRow], now: float,
                         only: str | None = None) -> None:
        """Consumers subscribed before a restart (or to a queue that moved here) keep their
        sessions and leases for one more session timeout: they heartbeat on the same topics
        (passed on to this shard when they write to another) and never noticed the change.
        With ``only``, just the sessions of that queue this shard does not serve yet."""
        import re

        for row in rows:
            if row.consumer_id in self.sessions:
                continue
            elsewhere = row.shard is not None and row.shard != self.shard
            if elsewhere and (only is None or row.is_regex or row.credit_home is not None):
                # Another shard's session (one consumer id, one session: 0013); a queue that
                # moved here brings the sessions subscribed to it by name (``only``), whose
                # rows the move re-stamped. A regex session of another shard is not copied
                # here when a queue it matches appears here: that was a second backlog (issue
                # 31); its consumer adds a part here (protocol 8, `layer.sdk.spanning`).
                continue
            session = Session.from_row(row)
            try:
                if only is not None and not session.matches(only):
                    continue
                names = [n for n in self.engines if session.matches(n)]
            except re.error:
                continue
            for name in names:
                try:
                    self.engines[name].subscribe(row.consumer_id, row.session_id, now,
                                                 delivery_topic=row.delivery_topic,
                                                 max_backlog=row.max_backlog, filter=row.filter,
                                                 session_timeout=session.session_timeout,
                                                 share=session.share)
                except ExpressionError:
                    continue
                self.mark_transactional(self.engines[name], session)
                session.queues.append(name)
            if session.queues:
                self.sessions[row.consumer_id] = session
                if session.home is not None:
                    self.control.credit.credited.add(row.consumer_id)

    def forget_empty_sessions(self) -> None:
        """Sessions left with no queue here (their queue moved): the shard the queue went to
        serves them from the stored consumer row, and this shard passes their records on."""
        for consumer_id, session in list(self.sessions.items()):
            if not session.queues:
                del self.sessions[consumer_id]

    def session_id_of(self, consumer_id: str) -> str | None:
        session = self.sessions.get(consumer_id)
        return session.session_id if session is not None else None
