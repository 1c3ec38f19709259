"""The shard loop: turns the journals of one shard's queues into queues (DESIGN §2, §6).

A coordinator process (`layer.coordinator.process`) runs one loop per shard the coordinators'
group assigned it, on one thread. Each iteration (:meth:`ShardLoop.run_once`):

1. poll journals, the control topic and the ack topic in one batch;
2. hand control records, acks and journal records to the pure queue engines, then run their
   timers (``tick``) and matching (``dispatch``), and take what they decided (``drain``);
3. write dead letters, and records that belong to another shard, to Kafka and wait for them
   (an entry leaves only once its dead letter is safe; a passed-on ack is safe before its
   position is stored);
4. one PostgreSQL transaction for everything decided, guarded by the owner's epoch;
5. only then produce deliveries, replies and events, and wait for them;
6. commit the input topics' offsets.

Postgres before Kafka is the safety argument: a crash between 4 and 5 leaves leases without
deliveries. The restart sends the deliveries of every restored lease again, unchanged (same
token), once the replay brings their records back; a consumer drops a delivery whose token it
already has. Leases whose consumers are gone expire and are redelivered (at-least-once).
The input positions of step 6 are also written in 4, so a restart applies no ack twice.
The process wraps this in the lifecycle: group membership, signals, shutdown.

A loop reads only its shard's partitions of the control and ack topics (partition p belongs to
shard p mod N). A record there for a queue or session of another shard (a consumer that has
not heard from its shard yet, a queue moved away) is passed on to that shard's partition with
a ``qlayer.forwarded`` hop count.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby

from layer.coordinator.catalog import Catalog
from layer.coordinator.payloads import (
    DEFAULT_PAYLOAD_BUDGET,
    MemoryPool,
    PayloadCache,
    RangeReader,
    record_size,
)
from layer.coordinator.translate import (
    add_outbox,
    entry_record,
    event_fields,
    lost_to_retention,
    ms,
    wire_bookmark,
    wire_reason,
)
from layer.domain import events as ev
from layer.domain.consumers import BacklogShare
from layer.domain.definitions import QueueDefinition, Semantics
from layer.domain.engine import AckItem as EngineAckItem
from layer.domain.engine import QueueEngine
from layer.domain.entries import JournalRecord as EngineRecord
from layer.domain.errors import ExpressionError, QlayerError, QueueConfigError
from layer.domain.expressions import (
    RawDocument,
    compile_expression,
    parse_document,
    project,
)
from layer.domain.shards import shard_key
from layer.domain.states import AckResult as EngineAckResult
from layer.domain.states import AckType as EngineAckType
from layer.domain.states import Bookmark, LeaveReason
from layer.kafka import (
    BEGINNING,
    JournalReader,
    JournalRecord,
    KafkaAdapterError,
    KafkaAdmin,
    OutgoingRecord,
    RecordWriter,
    TopicSpec,
)
from layer.protocol import (
    AckItem,
    AckItemResult,
    AckRecord,
    AckResult,
    AckStatus,
    Codec,
    DeadLetterInfo,
    DeliveryInfo,
    Event,
    EventType,
    Heartbeat,
    ProtocolError,
    QueueGrant,
    Replace,
    RequestKind,
    SessionEnded,
    SessionEndReason,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    TopicNames,
    Unsubscribe,
    ack_item_shape_problem,
    dead_letter_headers,
    encoded_delivery_headers,
    forwarded_headers,
    forwarded_hops,
    parse_deliver_at,
    reply_headers,
    topic_name_problem,
    with_delivery_headers,
    without_delivery_headers,
)
from layer.protocol import AckType as WireAckType
from layer.protocol import Bookmark as WireBookmark
from layer.protocol import Semantics as WireSemantics
from layer.settings import Settings
from layer.store.batch import WriteBatch
from layer.store.errors import FencedError
from layer.store.rows import ConsumerRow, PartitionKey
from layer.store.store import Store

log = logging.getLogger(__name__)

_ACK_STATUS = {
    EngineAckResult.APPLIED: AckStatus.OK,
    EngineAckResult.REMEMBERED: AckStatus.OK,
    EngineAckResult.WRONG_TOKEN: AckStatus.WRONG_TOKEN,
    EngineAckResult.NOT_LEASED: AckStatus.LEASE_LOST,
    EngineAckResult.ALREADY_DONE: AckStatus.DUPLICATE,
    EngineAckResult.UNKNOWN_BOOKMARK: AckStatus.UNKNOWN_ENTRY,
}


def _timestamp_ms(record: JournalRecord | None) -> int | None:
    """The journal record's own timestamp (Kafka gives 0 or -1 when it has none)."""
    if record is None or record.timestamp_ms <= 0:
        return None
    return record.timestamp_ms


def _bookmark_or_none(text: str) -> WireBookmark | None:
    try:
        return WireBookmark.parse(text)
    except ProtocolError:
        return None


def default_owner_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class CoordinatorOptions:
    """How one coordinator process behaves; every field has a sane default."""

    owner_id: str = field(default_factory=default_owner_id)
    #: Kafka's session timeout for the coordinators' group: a process silent this long loses
    #: its shards to the others (the broker allows 6 s to 30 min by default).
    group_session_timeout: float = 10.0
    #: Session timeout for consumers that give none.
    default_session_timeout: float = 30.0
    poll_timeout: float = 0.02
    max_batch: int = 20_000
    #: How often queue definitions, purge and evict requests are looked up again.
    refresh_interval: float = 2.0
    #: How often the cluster's topics are listed for new journal partitions and topics (a
    #: metadata request over every topic, which stalls the loop on a large cluster).
    topic_check_interval: float = 10.0
    #: How often recovery points are committed as each queue's consumer-group offsets.
    group_commit_interval: float = 5.0
    #: Kafka transactions fence a zombie coordinator's producer (DESIGN §6).
    transactional: bool = True
    #: How often each shard's lag and the process's shards are written for `qlayer coordinators`.
    report_interval: float = 2.0
    #: Bytes of journal records kept in memory; past it, records are re-read when needed.
    payload_budget: int = DEFAULT_PAYLOAD_BUDGET
    #: Allocations between cyclic garbage collections, set for the process by `run()`
    #: (Python's default is 700); 0 leaves the process's setting alone.
    gc_threshold: int = 100_000
    #: Events of committed decisions kept while Kafka refuses writes (about 200 bytes each);
    #: past it the oldest are dropped, counted in `events_dropped`.
    max_unwritten_events: int = 200_000


@dataclass
class LoopStats:
    """What one iteration did (for logs, tests and benchmarks)."""

    journal_records: int = 0
    control_records: int = 0
    ack_items: int = 0
    deliveries: int = 0
    dead_letters: int = 0
    replies: int = 0
    events: int = 0
    statements: int = 0


@dataclass
class _Session:
    """A consumer's subscription as the coordinator knows it (it may span several queues)."""

    consumer_id: str
    session_id: str
    queue: str
    is_regex: bool
    max_backlog: int | None
    filter: str | None
    delivery_topic: str
    session_timeout: float
    subscribed_at: float
    queues: list[str]
    #: One backlog across the queues of a regex subscription (AMPS; `BacklogShare`).
    share: BacklogShare | None = None

    def matches(self, queue: str) -> bool:
        if self.is_regex:
            return re.fullmatch(self.queue, queue) is not None
        return self.queue == queue


#: What applying one ack item came to: its status, the lease's new expiry (RENEW) and why it
#: was refused.
AckOutcome = tuple[AckStatus, int | None, str | None]

#: A control or ack record passes through at most this many coordinators: catalogs that
#: disagree for a moment (a queue just moved) must not bounce a record for ever; past it, the
#: shard that has it answers as best it can (UNKNOWN_ENTRY, UNKNOWN_SESSION).
MAX_FORWARD_HOPS = 4


class _Encoded(dict[str, bytes]):
    """UTF-8 forms of names that recur in every delivery (queues, consumer and session ids)."""

    def __call__(self, text: str) -> bytes:
        found = self.get(text)
        if found is None:
            if len(self) >= 50_000:
                self.clear()
            found = self[text] = text.encode()
        return found


class LeaseTokens:
    """Unguessable lease tokens (128 random bits from the OS, as hex), drawn a block at a time.

    The same source as ``secrets.token_hex(16)``, without a system call per lease: drawing
    each token alone was a fortieth of the coordinator's time.
    """

    def __init__(self, block: int = 4096) -> None:
        self._block = block
        self._pool = ""
        self._next = 0

    def __call__(self) -> str:
        if self._next >= len(self._pool):
            self._pool = os.urandom(16 * self._block).hex()
            self._next = 0
        token = self._pool[self._next:self._next + 32]
        self._next += 32
        return token


class ShardLoop:
    """Serves the queues of one shard while its process holds the shard's epoch in PostgreSQL.

    ``catalog`` gives the process's latest view of every queue and consumer (all shards);
    ``admin`` is the process's Kafka admin client, shared by its loops."""

    def __init__(
        self,
        settings: Settings,
        options: CoordinatorOptions,
        shard: int,
        *,
        catalog: Callable[[], Catalog],
        store: Store,
        admin: KafkaAdmin,
        memory: MemoryPool | None = None,
        tokens: Callable[[], str] | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self.shard = shard
        self.key = shard_key(shard)
        self._catalog = catalog
        self.store = store
        self._shared_admin = admin
        self._memory = memory
        self.topics = TopicNames(settings.topic_prefix)
        self.codec = Codec()
        self._tokens = tokens or LeaseTokens()
        self.counters: Counter[str] = Counter()
        self.epoch: int | None = None
        # Events of decisions PostgreSQL holds whose Kafka write failed: kept across the
        # rebuild that follows (unlike everything in _reset_state) and written first by the
        # next write that succeeds. The failed write's transaction was aborted, so its
        # read_committed readers never saw them: written again, they count once.
        self._unwritten_events: list[OutgoingRecord] = []
        self._reset_state()

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        self.engines: dict[str, QueueEngine] = {}
        self._versions: dict[str, int] = {}
        self._sessions: dict[str, _Session] = {}
        old = getattr(self, "_payloads", None)
        if old is not None:
            old.clear()
        self._payloads = PayloadCache(self.options.payload_budget, pool=self._memory)
        self._range_reader: RangeReader | None = None
        self._known_topics: set[str] = set()
        self._queues_by_topic: dict[str, list[QueueEngine]] = {}
        self._queue_keys: dict[str | None, bytes] = {}
        self._encoded = _Encoded()
        self._reply_headers = reply_headers(self.shard)
        self._catalog_seen = -1.0
        self._persisted_points: dict[PartitionKey, int] = {}
        # Per partition of each queue: the next offset not admitted yet, and what is stored of
        # it. A restart re-admits [recovery point, stored admitted_to) without counting those
        # entries as enqueued again (`_counted_from`).
        self._admitted_to: dict[PartitionKey, int] = {}
        self._persisted_admitted: dict[PartitionKey, int] = {}
        self._counted_from: dict[str, dict[tuple[str, int], int]] = {}
        # Entries lost to retention, found while (re)building a queue: reported (events,
        # counters) by the next iteration, with the queue's own decisions.
        self._lost: dict[str, list[ev.Event]] = {}
        self._input_offsets: dict[tuple[str, int], int] = {}
        # Ack items (consumer id, session id, item) for restored leases the replay has not
        # reached yet, retried each iteration in order.
        self._deferred_acks: list[tuple[str, str, AckItem]] = []
        # Per ack partition, the offset of the first record with deferred items: its input
        # position is not stored past it until they are applied (a restart reads them again).
        self._deferred_from: dict[tuple[str, int], int] = {}
        # ACK_REFUSED / SUBSCRIBE_REFUSED events of this iteration (the engines never see
        # what was refused, so these do not come from their outboxes).
        self._pending_events: list[Event] = []
        self._reader: JournalReader | None = None
        self._writer: RecordWriter | None = None
        self._admin: KafkaAdmin | None = None
        # Control and ack records for other shards, written before this iteration's commit.
        self._forwards: list[OutgoingRecord] = []
        self._next_refresh = 0.0
        self._next_group_commit = 0.0
        self._next_topic_check = 0.0
        self._next_position_write = 0.0

    @property
    def is_owner(self) -> bool:
        return self.epoch is not None

    # ------------------------------------------------------------------ ownership
    def take(self, now: float) -> None:
        """Take the shard (a new epoch, which fences any earlier holder) and start serving it:
        restore its queues from PostgreSQL and read on. The group assigned it to us."""
        self.epoch = self.store.take_shard(self.key, self.options.owner_id, now)
        log.info("coordinator %s runs shard %d at epoch %d", self.options.owner_id, self.shard,
                 self.epoch)
        try:
            self._start(now)
        except BaseException:
            self._lose_ownership("start-up failed")
            raise

    def _lose_ownership(self, why: str) -> None:
        log.warning("coordinator %s gives up shard %d: %s", self.options.owner_id,
                    self.shard, why)
        self._close_clients()
        self.epoch = None
        self._reset_state()

    def _ownership_events(self, kind: EventType, now: float) -> None:
        """OWNERSHIP_ACQUIRED / OWNERSHIP_LOST for every queue of the shard (events topic)."""
        assert self.epoch is not None
        self._pending_events.extend(
            Event(type=kind, timestamp_ms=ms(now), coordinator_id=self.options.owner_id,
                  coordinator_epoch=self.epoch, queue=name) for name in self.engines)

    def release(self, now: float) -> None:
        """Hand the shard over at once (clean shutdown), so a standby need not wait."""
        if self.epoch is not None and self._writer is not None and self.engines:
            # Best effort: a clean stop says so on the events topic; a crash cannot. Events
            # a failed write left go first, or they are lost with this process.
            self._ownership_events(EventType.OWNERSHIP_LOST, now)
            encode = self.codec.encode_event
            records = self._unwritten_events + [
                OutgoingRecord(self.topics.events, encode(e), (e.queue or "").encode())
                for e in self._pending_events]
            try:
                self._writer.send(records)
                self._writer.flush(5.0)
                if self._unwritten_events:
                    self.counters["events_written_late"] += len(self._unwritten_events)
                    self._unwritten_events = []
            except QlayerError as exc:
                log.warning("could not write OWNERSHIP_LOST events: %s", exc)
            self._pending_events = []
        if self.epoch is not None:
            try:
                self.store.release(self.key, self.options.owner_id, self.epoch, now)
            except QlayerError as exc:
                log.warning("releasing ownership failed: %s", exc)
        self._close_clients()
        self.epoch = None

    def abandon(self, why: str) -> None:
        """Stop at once without writing anything (the shard was lost: another process may
        already run it, and the epoch fences whatever this one would still write)."""
        if self.epoch is not None:
            self._lose_ownership(why)

    def rebuild(self, now: float) -> None:
        """Drop all in-memory state after a failure; keep nothing that was not persisted.
        The process takes the shard again (a new epoch) before the next iteration."""
        self.release(now)
        self._reset_state()

    def lag(self) -> int | None:
        """Records of this shard's inputs not read yet (from the last fetches)."""
        return self._reader.lag() if self._reader is not None else None

    def _close_clients(self) -> None:
        for closer in (self._reader, self._writer, self._range_reader):
            if closer is not None:
                try:
                    closer.close()
                except Exception as exc:  # closing must not hide the reason we stop
                    log.warning("closing a Kafka client failed: %s", exc)
        self._reader = None
        self._writer = None
        self._range_reader = None

    # ------------------------------------------------------------------ start-up
    def _start(self, now: float) -> None:
        kafka = self.settings.kafka_config()
        self._admin = self._shared_admin
        # One transactional id per shard: a process that takes the shard fences the producer
        # of the one that had it.
        tid = (f"{self.topics.prefix}coordinator-{self.shard}"
               if self.options.transactional else None)
        self._writer = RecordWriter(kafka, transactional_id=tid)
        self._reader = JournalReader(kafka, group_id=f"{self.topics.prefix}coordinator")
        # Acks and control records are assigned before the journals, so the first fetches
        # carry them: after a restart, consumers' acks and heartbeats are read at once rather
        # than behind the replay of the journals.
        catalog = self._catalog()
        count = catalog.shard_count
        inputs = [(topic, p) for topic in (self.topics.control, self.topics.ack)
                  for p in range(self._partitions(topic)) if p % count == self.shard]
        # Read on where the last owner's applied acks and control records end: the positions
        # it committed to PostgreSQL with their effects. The group offsets in Kafka are only
        # for partitions it never wrote a position for (a database from before 0003).
        stored = self.store.load_input_positions(self.key)
        committed = self._reader.committed([tp for tp in inputs if tp not in stored])
        committed.update(stored)
        # Control and ack records older than the topics' retention are gone for good; they
        # mattered only within a session timeout, so reading on from the log start is right.
        firsts = self._admin.log_start_offsets(inputs)
        self._reader.add({tp: (max(o, firsts.get(tp, 0)) if o is not None else BEGINNING)
                          for tp in inputs for o in [committed.get(tp)]})
        session_of = {row.consumer_id: row.session_id for row in catalog.consumers.values()}
        for record in catalog.on_shard(self.shard).values():
            self._add_queue(record.name, record.definition, record.version, now, session_of)
        self._restore_sessions(catalog.consumers.values(), now)
        self._ownership_events(EventType.OWNERSHIP_ACQUIRED, now)
        self._catalog_seen = catalog.loaded_at

    def _partitions(self, topic: str) -> int:
        assert self._admin is not None
        return self._admin.topics().get(topic, 0)

    def _add_queue(self, name: str, raw: object, version: int, now: float,
                   session_of: dict[str, str]) -> None:
        """Build a queue's engine from its stored definition and state; start reading it."""
        assert self._admin is not None and self._reader is not None
        try:
            definition = QueueDefinition.from_mapping(raw)  # type: ignore[arg-type]
        except QueueConfigError as exc:
            self.counters["invalid_queue_definitions"] += 1
            log.error("queue %s has an invalid stored definition, skipped: %s", name, exc)
            return
        if not definition.is_regex_topic and self.topics.is_internal(
                definition.underlying_topic):
            # Internal topics (deliveries, acks, ...) are never journals; say so rather than
            # leave the queue silently empty.
            self.counters["queues_on_internal_topics"] += 1
            log.error("queue %s: underlying topic %s is under the internal topic prefix %r "
                      "and will never be read; rename the journal", name,
                      definition.underlying_topic, self.topics.prefix)
        engine = QueueEngine(definition, tokens=self._tokens,
                             session_timeout=self.options.default_session_timeout)
        stored = self.store.load_recovery_points(name)
        partitions = self._journal_partitions(definition)
        starts = self._start_positions(definition, partitions, stored)
        entries = [entry_record(row, session_of) for row in self.store.load_entries(name)]
        engine.restore(entries, starts)
        log_starts = self._admin.log_start_offsets(list(starts))
        stored_entries = {e.bookmark: e for e in entries}
        for (topic, partition), start in starts.items():
            first = log_starts.get((topic, partition), 0)
            if first > start:
                # Retention deleted records this queue had not finished: say so, loudly. The
                # engine settles the entries it knows of (persisted rows); the events and
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
        self._versions[name] = version
        for topic, partition in starts:
            self._persisted_points[PartitionKey(name, topic, partition)] = stored.get(
                PartitionKey(name, topic, partition), -1)
        admitted = self.store.load_admitted(name)
        self._admitted_to.update(admitted)
        self._persisted_admitted.update(admitted)
        self._counted_from[name] = {(k.topic, k.partition): v for k, v in admitted.items()}
        self._admin.ensure_topics([TopicSpec(self._dead_letter_topic(definition), 1)])
        self._read_from(starts)
        self._queues_by_topic.clear()

    def _dead_letter_topic(self, definition: QueueDefinition) -> str:
        return definition.dead_letter_topic or self.topics.dead_letter(definition.name)

    def _journal_partitions(self, definition: QueueDefinition,
                            listed: dict[str, int] | None = None) -> list[tuple[str, int]]:
        assert self._admin is not None
        if listed is None:
            listed = self._admin.topics()
        return [(topic, p) for topic, count in sorted(listed.items())
                if not self.topics.is_internal(topic) and definition.matches_topic(topic)
                for p in range(count)]

    def _start_positions(self, definition: QueueDefinition, partitions: list[tuple[str, int]],
                         stored: dict[PartitionKey, int]) -> dict[tuple[str, int], int]:
        """Where each partition's replay starts: the recovery point, else the queue's
        `recovery_point` setting (beginning, end or a timestamp)."""
        assert self._admin is not None
        starts: dict[tuple[str, int], int] = {}
        fresh = []
        for topic, partition in partitions:
            point = stored.get(PartitionKey(definition.name, topic, partition))
            if point is None:
                fresh.append((topic, partition))
            else:
                starts[(topic, partition)] = point
        if fresh:
            setting = definition.recovery_point
            if setting == "end":
                starts.update(self._admin.end_offsets(fresh))
            elif setting == "beginning":
                starts.update(self._admin.log_start_offsets(fresh))
            else:
                moment = definition.recovery_timestamp
                assert moment is not None
                starts.update(self._admin.offsets_for_time(fresh, int(moment.timestamp() * 1000)))
        return starts

    def _read_from(self, starts: dict[tuple[str, int], int]) -> None:
        """Make the reader cover these partitions from at least these offsets."""
        assert self._reader is not None
        assigned = set(self._reader.assignment)
        new = {tp: o for tp, o in starts.items() if tp not in assigned}
        self._reader.add(new)
        for tp, offset in starts.items():
            if tp in assigned:
                # Another queue reads this partition further on: go back; queues skip what
                # they have seen (the engine ignores offsets below its position).
                self._reader.seek(tp[0], tp[1], offset)

    def _restore_sessions(self, rows: Iterable[ConsumerRow], now: float,
                          only: str | None = None) -> None:
        """Consumers subscribed before a restart (or to a queue that moved here) keep their
        sessions and leases for one more session timeout: they heartbeat on the same topics
        (passed on to this shard when they write to another) and never noticed the change.
        With ``only``, just the sessions of that queue this loop does not serve yet."""
        for row in rows:
            if row.consumer_id in self._sessions:
                continue
            session = _Session(row.consumer_id, row.session_id, row.queue, row.is_regex,
                               row.max_backlog, row.filter, row.delivery_topic,
                               row.session_timeout_ms / 1000.0, row.subscribed_at, [])
            if row.is_regex:
                session.share = BacklogShare()
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
                session.queues.append(name)
            if session.queues:
                self._sessions[row.consumer_id] = session

    # ------------------------------------------------------------------ the loop
    def run_once(self, now: float, poll_timeout: float | None = None) -> LoopStats:
        """One iteration: poll, decide, persist, produce. Requires ownership."""
        if self._reader is None or self._writer is None or self.epoch is None:
            raise QlayerError("run_once needs the shard: call take first")
        stats = LoopStats()
        batch = WriteBatch()
        replies: list[OutgoingRecord] = []
        if now >= self._next_refresh or self._catalog().loaded_at != self._catalog_seen:
            self._refresh(now, batch, replies)
            self._next_refresh = now + self.options.refresh_interval

        clock = time.perf_counter
        started = clock()
        records = self._reader.poll(self.options.max_batch,
                                    self.options.poll_timeout if poll_timeout is None
                                    else poll_timeout)
        polled = clock()
        if self._deferred_acks:
            self._retry_deferred_acks(now, replies)
        control_topic, ack_topic = self.topics.control, self.topics.ack
        journal: list[JournalRecord] = []
        controls: list[JournalRecord] = []
        for r in records:
            if r.topic == ack_topic:
                stats.ack_items += self._on_ack(r, now, replies)
                self._input_offsets[(r.topic, r.partition)] = r.offset + 1
            elif r.topic == control_topic:
                controls.append(r)
            else:
                journal.append(r)
        # Acks before control records: a consumer acks, then unsubscribes on another topic;
        # both may arrive in one batch, and the acks must not find their leases broken.
        for r in controls:
            stats.control_records += 1
            self._on_control(r, now, batch, replies)
            self._input_offsets[(r.topic, r.partition)] = r.offset + 1
        stats.journal_records = len(journal)
        fresh = self._enqueue(journal, now) if journal else {}

        deliveries: list[ev.Delivery] = []
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
            outbox = engine.drain()
            lost = self._lost.pop(name, None)
            if lost:
                outbox = ev.Outbox(lost + outbox.events, outbox.entries)
            outboxes.append((name, outbox))

        done: list[Bookmark] = []
        dead_letters: list[OutgoingRecord] = []
        expired: list[ev.EntryExpired] = []
        events: list[ev.Event] = []
        for name, outbox in outboxes:
            add_outbox(batch, name, outbox, self._counted_from.get(name))
            events.extend(outbox.events)
            for e in outbox.events:
                kind = type(e)
                if kind is ev.EntriesEnqueued:
                    self._hold(e, fresh)  # type: ignore[arg-type]
                elif kind is ev.EntryAcked:
                    done.append(e.bookmark)  # type: ignore[union-attr]
                elif kind is ev.EntryExpired:
                    done.append(e.bookmark)  # type: ignore[union-attr]
                    if e.dead_letter:  # type: ignore[union-attr]
                        expired.append(e)  # type: ignore[arg-type]
                elif kind is ev.ConsumerLeft:
                    self._on_consumer_left(e, batch, replies, now)  # type: ignore[arg-type]
            self._recovery_points(name, batch)
        # Records whose bytes were dropped past the memory budget are read again, in
        # sequential ranges, before anything is written.
        reread = self._reread([e.bookmark for e in expired] + [d.bookmark for d in deliveries])
        for e in expired:
            dead_letters.extend(self._dead_letter(e, now, reread))

        # 3. Dead letters are safe in Kafka before their entries leave the queue, and records
        # passed on to other shards before their input positions are stored.
        if dead_letters or self._forwards:
            self._writer.send(dead_letters + self._forwards)
            self._writer.flush()
            stats.dead_letters = len(dead_letters)
            self.counters["forwarded"] += len(self._forwards)
            self._forwards = []

        # 4. One guarded transaction for everything decided, with how far the inputs were
        # applied: a restart reads on from there and applies no ack twice. Records that
        # changed nothing stored (at-most-once acks, refused items) do not make a transaction
        # of their own more than once a second: read again after a crash, they change
        # nothing either.
        if self._input_offsets and (not batch.is_empty() or now >= self._next_position_write):
            deferred_from = self._deferred_from
            for tp, offset in self._input_offsets.items():
                batch.set_input_position(tp[0], tp[1], min(offset, deferred_from.get(tp, offset)))
            self._next_position_write = now + 1.0
        decided = clock()
        if not batch.is_empty():
            try:
                result = self.store.commit(batch, self.key, self.options.owner_id,
                                           self.epoch, now)
            except FencedError:
                self._lose_ownership("fenced: another coordinator took the shard over")
                raise
            stats.statements = result.statements
            self.counters["statements"] += result.statements
            self.counters["transactions"] += 1

        # 5. Then deliveries, replies and events.
        committed = clock()
        out = self._deliveries(deliveries, reread)
        stats.deliveries = len(out)
        stats.replies = len(replies)
        out.extend(self._answerable(replies))
        stats.events = self._events(events, fresh, out)
        encoded = clock()
        earlier = len(self._unwritten_events)
        if earlier:
            out[:0] = self._unwritten_events
        if out:
            try:
                self._writer.send(out)
                self._writer.flush()
            except QlayerError:
                self._keep_unwritten_events(out, earlier, committed=not batch.is_empty())
                raise
            if self._unwritten_events:
                self.counters["events_written_late"] += len(self._unwritten_events)
                self._unwritten_events = []
        written = clock()
        for bookmark in done:
            self._payloads.release(bookmark)

        # 6. Inputs are consumed; a crash before this re-reads them (acks are idempotent).
        if self._input_offsets:
            self._reader.commit(self._input_offsets)
            self._input_offsets = {}
        self.counters["iterations"] += 1
        self.counters["journal_records"] += stats.journal_records
        self.counters["deliveries"] += stats.deliveries
        self.counters["ack_items"] += stats.ack_items
        # Where the loop's wall time goes (µs), for `qlayer stats`-style diagnosis and the
        # benchmarks: waiting for input, deciding, PostgreSQL, encoding, writing to Kafka.
        self.counters["us_polling"] += int((polled - started) * 1e6)
        self.counters["us_deciding"] += int((decided - polled) * 1e6)
        self.counters["us_committing"] += int((committed - decided) * 1e6)
        self.counters["us_encoding"] += int((encoded - committed) * 1e6)
        self.counters["us_writing"] += int((written - encoded) * 1e6)
        if now >= self._next_group_commit:
            self._commit_group_offsets()
            self._next_group_commit = now + self.options.group_commit_interval
        return stats

    def _events(self, events: list[ev.Event], fresh: dict[Bookmark, JournalRecord],
                out: list[OutgoingRecord]) -> int:
        """This iteration's events-topic records, keyed by queue name, appended to ``out``."""
        assert self.epoch is not None
        topic, owner, epoch = self.topics.events, self.options.owner_id, self.epoch
        encode = self.codec.event_encoder.encode_fields
        keys = self._queue_keys
        before = len(out)
        for f in event_fields(events, session_of=self._session_id_of,
                              record_time_of=lambda b: _timestamp_ms(fresh.get(b))):
            key = keys.get(f.queue)
            if key is None:
                key = keys[f.queue] = (f.queue or "").encode()
            out.append(OutgoingRecord(topic, encode(owner, epoch, *f), key))
        encode_event = self.codec.encode_event
        out.extend(OutgoingRecord(topic, encode_event(w), (w.queue or "").encode())
                   for w in self._pending_events)
        self._pending_events = []
        return len(out) - before

    def _keep_unwritten_events(self, out: list[OutgoingRecord], earlier: int,
                               committed: bool) -> None:
        """After a failed write: keep the events of decisions PostgreSQL holds.

        ``out`` starts with the ``earlier`` events kept before. The write's deliveries need no
        keeping (the rebuild sends the restored leases' deliveries again) and its replies are
        answers a consumer asks again for; its events are the pipeline's only record of those
        decisions. An iteration that committed nothing adds none: the rebuild decides those
        things again, with their events."""
        topic = self.topics.events
        kept = out[:earlier]
        if committed:
            kept += [r for r in out[earlier:] if r.topic == topic]
        over = len(kept) - self.options.max_unwritten_events
        if over > 0:
            # Kafka has refused writes for long: memory is bounded, the oldest are dropped.
            log.error("dropping %d events never written to %s (Kafka refuses writes)",
                      over, topic)
            self.counters["events_dropped"] += over
            kept = kept[over:]
        self._unwritten_events = kept

    def _session_id_of(self, consumer_id: str) -> str | None:
        session = self._sessions.get(consumer_id)
        return session.session_id if session is not None else None

    # ------------------------------------------------------------------ journals
    def _engines_for(self, topic: str) -> list[QueueEngine]:
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
        room = self._payloads.budget - self._payloads.bytes
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
                deliver_at_ms = self._deliver_at(r) if r.headers else None
                room -= record_size(r)
                doc: object
                if room >= 0:
                    doc = RawDocument(r.value)
                else:
                    if fields is None:
                        fields = frozenset().union(*(e.fields_needed() for e in engines))
                    doc = project(parse_document(r.value), fields)
                    self.counters["documents_projected"] += 1
                offered.append(EngineRecord(
                    r.topic, r.partition, r.offset, r.key,
                    doc,
                    r.timestamp_ms / 1000.0 if r.timestamp_ms > 0 else None,
                    deliver_at_ms / 1000.0 if deliver_at_ms is not None else None,
                ))
                fresh[Bookmark(r.topic, r.partition, r.offset)] = r
            last: dict[int, int] = {}
            for r in rs:
                last[r.partition] = r.offset
            admitted = self._admitted_to
            for engine in engines:
                engine.enqueue(offered, now)
                for partition, offset in last.items():
                    key = PartitionKey(engine.name, topic, partition)
                    if offset >= admitted.get(key, 0):
                        admitted[key] = offset + 1
        return fresh

    def _deliver_at(self, r: JournalRecord) -> int | None:
        """The record's deliver-at time; a malformed header is the producer's mistake, so it
        is counted and the message is available at once (docs/protocol.md §5.3) rather than
        stopping every queue on a record that would fail the same way after each restart."""
        try:
            return parse_deliver_at(r.headers)
        except ProtocolError as exc:
            self.counters["malformed_deliver_at_headers"] += 1
            log.warning("ignoring the deliver-at header of %s[%d]@%d: %s", r.topic,
                        r.partition, r.offset, exc)
            return None

    def _hold(self, e: ev.EntriesEnqueued, fresh: dict[Bookmark, JournalRecord]) -> None:
        for offset in e.offsets:
            bookmark = Bookmark(e.topic, e.partition, offset)
            record = fresh.get(bookmark) or self._payloads.get(bookmark)
            if record is not None:
                self._payloads.hold(bookmark, record)

    def _recovery_points(self, name: str, batch: WriteBatch) -> None:
        """Moved recovery points, each with how far its partition was admitted."""
        for (topic, partition), offset in self.engines[name].recovery_points().items():
            key = PartitionKey(name, topic, partition)
            admitted = self._admitted_to.get(key)
            if (self._persisted_points.get(key) != offset
                    or self._persisted_admitted.get(key) != admitted):
                batch.set_recovery_point(name, topic, partition, offset)
                self._persisted_points[key] = offset
                if admitted is not None:
                    batch.set_admitted(name, topic, partition, admitted)
                    self._persisted_admitted[key] = admitted

    def _commit_group_offsets(self) -> None:
        """Recovery points as consumer-group offsets: lag tools show each queue's backlog."""
        assert self._admin is not None
        by_queue: dict[str, dict[tuple[str, int], int]] = {}
        for key, offset in self._persisted_points.items():
            if offset >= 0:
                by_queue.setdefault(key.queue, {})[(key.topic, key.partition)] = offset
        for queue, offsets in by_queue.items():
            try:
                self._admin.commit_group_offsets(self.topics.queue_group(queue), offsets)
            except QlayerError as exc:
                # Only monitoring depends on it: log and go on.
                log.warning("committing lag offsets of queue %s failed: %s", queue, exc)

    # ------------------------------------------------------------------ produce
    def _reread(self, bookmarks: list[Bookmark]) -> dict[Bookmark, JournalRecord]:
        """Read back the records these entries need whose bytes are not in memory."""
        missing = self._payloads.missing(bookmarks)
        if not missing:
            return {}
        if self._range_reader is None:
            self._range_reader = RangeReader(self.settings.kafka_config(),
                                             group_id=f"{self.topics.prefix}coordinator-reread")
        found = self._range_reader.read(missing)
        self.counters["payload_rereads"] += len(found)
        for bookmark, record in found.items():
            self._payloads.fill(bookmark, record)
        return found

    def _deliveries(self, deliveries: list[ev.Delivery],
                    reread: dict[Bookmark, JournalRecord]) -> list[OutgoingRecord]:
        out: list[OutgoingRecord] = []
        encoded = self._encoded
        for d in deliveries:
            record = self._payloads.get(d.bookmark) or reread.get(d.bookmark)
            if record is None:
                # The journal no longer has the record (retention) or could not be read in
                # time; the lease expires and the entry is offered again. Count it, go on.
                self.counters["delivery_without_payload"] += 1
                log.error("no payload for %s in queue %s", d.bookmark, d.queue)
                continue
            if type(d) is ev.EntryLeased:
                session = self._sessions.get(d.consumer_id)
                b = d.bookmark
                headers = without_delivery_headers(record.headers) if record.headers else []
                headers.extend(encoded_delivery_headers(
                    encoded(d.queue), f"{b.topic}/{b.partition}/{b.offset}".encode(),
                    d.token.encode(), int(d.deadline * 1000), d.delivery_count, False,
                    encoded(d.consumer_id),
                    encoded(session.session_id) if session is not None else None))
                out.append(OutgoingRecord(d.delivery_topic, record.value, record.key, headers,
                                          record.timestamp_ms))
            else:
                assert isinstance(d, ev.BarrierDelivered)
                for recipient in d.recipients:
                    session = self._sessions.get(recipient.consumer_id)
                    # A barrier needs no ack: no lease token, no deadline.
                    info = DeliveryInfo(queue=d.queue, bookmark=wire_bookmark(d.bookmark),
                                        lease="", lease_expires_ms=0, delivery_count=1,
                                        barrier=True, consumer_id=recipient.consumer_id,
                                        session_id=session.session_id if session else None)
                    out.append(OutgoingRecord(recipient.delivery_topic, record.value,
                                              record.key,
                                              with_delivery_headers(record.headers or [], info),
                                              record.timestamp_ms))
        return out

    def _dead_letter(self, e: ev.EntryExpired, now: float,
                     reread: dict[Bookmark, JournalRecord]) -> list[OutgoingRecord]:
        record = self._payloads.get(e.bookmark) or reread.get(e.bookmark)
        if record is None:
            self.counters["dead_letter_without_payload"] += 1
            log.error("no payload to dead-letter %s of queue %s", e.bookmark, e.queue)
            return []
        engine = self.engines[e.queue]
        info = DeadLetterInfo(reason=wire_reason(str(e.reason)), queue=e.queue,
                              bookmark=wire_bookmark(e.bookmark),
                              delivery_count=e.delivery_count, dead_lettered_at_ms=ms(now),
                              last_consumer=e.consumer_id, detail=e.detail)
        return [OutgoingRecord(self._dead_letter_topic(engine.definition), record.value,
                               record.key, dead_letter_headers(record.headers or [], info),
                               record.timestamp_ms)]

    def _reply(self, topic: str, message: SubscribeResult | AckResult | SessionEnded,
               key: str) -> OutgoingRecord:
        return OutgoingRecord(topic, self.codec.encode_reply(message), key.encode(),
                              self._reply_headers, partition=0)

    # ------------------------------------------------------------------ acks
    def _on_ack(self, r: JournalRecord, now: float, replies: list[OutgoingRecord]) -> int:
        try:
            record = self.codec.decode_ack(r.value)
        except ProtocolError as exc:
            self.counters["malformed_ack_records"] += 1
            log.warning("malformed record on %s[%d]@%d: %s", r.topic, r.partition, r.offset, exc)
            return 0
        assert isinstance(record, AckRecord)
        items = record.items
        engines = self.engines
        if not all(item.queue in engines for item in items):
            items = self._forward_acks(r, record)
        waiting = len(self._deferred_acks)
        # A record passed on by a shard that was then fenced is passed on again after its
        # rebuild (it is written before the position past it is stored): its acks were
        # applied the first time, so their DUPLICATE is not news to the consumer.
        self._settle(record.consumer_id, record.session_id, items, now, replies,
                     quiet_duplicates=r.headers is not None and forwarded_hops(r.headers) > 0)
        if len(self._deferred_acks) > waiting:
            self.counters["acks_deferred_for_replay"] += len(self._deferred_acks) - waiting
            self._deferred_from.setdefault((r.topic, r.partition), r.offset)
        return len(record.items)

    def _forward_acks(self, r: JournalRecord, record: AckRecord) -> tuple[AckItem, ...]:
        """Pass the items of queues another shard serves on to that shard's ack partition;
        return the items this shard answers (its own, and those of unknown queues)."""
        hops = forwarded_hops(r.headers)
        if hops >= MAX_FORWARD_HOPS:
            self.counters["forward_hops_exceeded"] += 1
            return record.items
        catalog = self._catalog()
        mine: list[AckItem] = []
        theirs: dict[int, list[AckItem]] = {}
        for item in record.items:
            shard = None if item.queue in self.engines else catalog.shard_of(item.queue)
            if shard is None or shard == self.shard:
                mine.append(item)
            else:
                theirs.setdefault(shard, []).append(item)
        for shard, items in theirs.items():
            value = r.value if len(items) == len(record.items) else self.codec.encode_ack(
                AckRecord(consumer_id=record.consumer_id, session_id=record.session_id,
                          sent_at_ms=record.sent_at_ms, items=tuple(items)))
            self._forward(r, value, shard, hops)
        return tuple(mine)

    def _forward(self, r: JournalRecord, value: bytes | None, shard: int, hops: int) -> None:
        self._forwards.append(OutgoingRecord(r.topic, value, r.key, forwarded_headers(hops + 1),
                                             partition=shard))

    def _settle(self, consumer_id: str, session_id: str, items: Sequence[AckItem], now: float,
                replies: list[OutgoingRecord], quiet_duplicates: bool = False) -> None:
        """Apply one consumer's ack items and answer the refused ones (and every RENEW).

        Items for entries a restart has not re-read yet wait for the replay
        (`_retry_deferred_acks`): refused now, the consumer would lose its ack and the
        message come back when its restored lease ran out.
        """
        outcomes = self._apply_acks(items, now)
        answers: list[AckItemResult] = []
        statuses: Counter[AckStatus] = Counter()
        for item, outcome in zip(items, outcomes, strict=True):
            if outcome is None:
                self._deferred_acks.append((consumer_id, session_id, item))
                continue
            status, expires, message = outcome
            if quiet_duplicates and status is AckStatus.DUPLICATE:
                self.counters["ack_duplicate_forwarded"] += 1
                continue
            statuses[status] += 1
            if status is not AckStatus.OK:
                self._refused(EventType.ACK_REFUSED, now, status.value, consumer_id,
                              session_id, item.queue, _bookmark_or_none(item.bookmark))
            if status is not AckStatus.OK or item.type is WireAckType.RENEW:
                answers.append(AckItemResult(queue=item.queue, bookmark=item.bookmark,
                                             type=item.type, status=status,
                                             lease_expires_ms=expires, message=message))
        for status, n in statuses.items():
            self.counters[f"ack_{status.value.lower()}"] += n
        if answers:
            topic = self._delivery_topic_of(consumer_id)
            replies.append(self._reply(topic, AckResult(
                consumer_id=consumer_id, session_id=session_id,
                items=tuple(answers), sent_at_ms=ms(now)), consumer_id))

    def _retry_deferred_acks(self, now: float, replies: list[OutgoingRecord]) -> None:
        """Acks that waited for the replay, in the order they came, before any newer one."""
        deferred, self._deferred_acks = self._deferred_acks, []
        for (consumer_id, session_id), group in groupby(deferred, key=lambda d: d[:2]):
            self._settle(consumer_id, session_id, [item for _, _, item in group], now, replies)
        if not self._deferred_acks:
            self._deferred_from.clear()

    def _refused(self, kind: EventType, now: float, reason: str, consumer_id: str,
                 session_id: str, queue: str | None, bookmark: WireBookmark | None = None
                 ) -> None:
        assert self.epoch is not None
        self._pending_events.append(Event(type=kind, timestamp_ms=ms(now),
                                    coordinator_id=self.options.owner_id,
                                    coordinator_epoch=self.epoch, queue=queue,
                                    bookmark=bookmark, consumer_id=consumer_id,
                                    session_id=session_id, reason=reason))

    def _apply_acks(self, items: Sequence[AckItem], now: float) -> list[AckOutcome | None]:
        """Each item's status, lease expiry (RENEW) and refusal message, applied in order;
        None for an item whose entry waits for the replay after a restart (not applied).

        Items go to their queue's engine a run at a time (one call per queue, not per item);
        a RENEW ends the run, because its answer reads the lease right after it.
        """
        outcomes: list[AckOutcome | None] = [None] * len(items)
        run: dict[str, list[tuple[int, EngineAckItem]]] = {}
        for i, item in enumerate(items):
            checked = self._checked_ack(item)
            if not isinstance(checked, EngineAckItem):
                outcomes[i] = checked
            elif item.type is WireAckType.RENEW:
                self._apply_run(run, outcomes, now)
                self._apply_run({item.queue: [(i, checked)]}, outcomes, now)
            else:
                run.setdefault(item.queue, []).append((i, checked))
        self._apply_run(run, outcomes, now)
        return outcomes

    def _checked_ack(self, item: AckItem) -> EngineAckItem | AckOutcome:
        """The engine's form of a well-formed item for a known queue, else its refusal."""
        try:
            wire = WireBookmark.parse(item.bookmark)
        except ProtocolError as exc:
            return AckStatus.INVALID, None, exc.message
        problem = ack_item_shape_problem(item)
        if problem is not None:
            return AckStatus.INVALID, None, problem
        if item.queue not in self.engines:
            return AckStatus.UNKNOWN_ENTRY, None, f"unknown queue {item.queue!r}"
        delay = item.delay_ms / 1000.0 if item.delay_ms is not None else None
        return EngineAckItem(Bookmark(wire.topic, wire.partition, wire.offset), item.lease,
                             EngineAckType(int(item.type)), delay, item.reason)

    def _apply_run(self, run: dict[str, list[tuple[int, EngineAckItem]]],
                   outcomes: list[AckOutcome | None], now: float) -> None:
        for queue, pairs in run.items():
            engine = self.engines[queue]
            at_most_once = engine.definition.semantics is Semantics.AT_MOST_ONCE
            results = engine.ack([item for _, item in pairs], now)
            for (i, item), result in zip(pairs, results, strict=True):
                if result is EngineAckResult.UNKNOWN_BOOKMARK and engine.restoring(
                        item.bookmark):
                    # A lease restored from PostgreSQL whose record the replay has not
                    # reached yet: nothing was applied; the item waits (see `_settle`).
                    outcomes[i] = None
                    continue
                status = _ACK_STATUS[result]
                if (at_most_once and result is EngineAckResult.ALREADY_DONE
                        and item.type is not EngineAckType.RENEW):
                    # An at-most-once entry is done when it is delivered; the ack only frees
                    # a backlog slot, and after a restart (which frees them all) there is none
                    # left to free. Nothing failed that the consumer could act on.
                    status = AckStatus.OK
                expires = None
                if status is AckStatus.OK and item.type is EngineAckType.RENEW:
                    entry = engine.entry(item.bookmark)
                    if entry is not None and entry.deadline is not None:
                        expires = ms(entry.deadline)
                outcomes[i] = (status, expires, None if status is AckStatus.OK
                               else result.value)
        run.clear()

    # ------------------------------------------------------------------ control
    def _on_control(self, r: JournalRecord, now: float, batch: WriteBatch,
                    replies: list[OutgoingRecord]) -> None:
        try:
            message = self.codec.decode_control(r.value)
        except ProtocolError as exc:
            self.counters["malformed_control_records"] += 1
            log.warning("malformed record on %s[%d]@%d: %s", r.topic, r.partition, r.offset, exc)
            return
        hops = forwarded_hops(r.headers)
        target = self._control_shard(message) if hops < MAX_FORWARD_HOPS else None
        if target is not None and target != self.shard:
            self._forward(r, r.value, target, hops)
            return
        if isinstance(message, Subscribe | Replace):
            self._on_subscribe(message, now, batch, replies)
        elif isinstance(message, Heartbeat):
            session = self._sessions.get(message.consumer_id)
            if session is None or session.session_id != message.session_id:
                self.counters["unknown_session_heartbeats"] += 1
                replies.append(self._session_ended(message.consumer_id, message.session_id,
                                                   SessionEndReason.UNKNOWN_SESSION, now,
                                                   "no such session: subscribe again"))
                return
            for name in session.queues:
                self.engines[name].heartbeat(message.consumer_id, now, message.session_id)
            batch.heartbeat(message.consumer_id, now)
        elif isinstance(message, Unsubscribe):
            session = self._sessions.get(message.consumer_id)
            if session is None or session.session_id != message.session_id:
                self.counters["unknown_session_unsubscribes"] += 1
                return
            for name in session.queues:
                self.engines[name].unsubscribe(message.consumer_id, now)
            del self._sessions[message.consumer_id]
            batch.delete_consumer(message.consumer_id, message.session_id)

    def _control_shard(self, message: Subscribe | Replace | Heartbeat | Unsubscribe
                       ) -> int | None:
        """The one shard that serves a control record, None when this shard answers it (its
        own session, or a request no shard or several shards would serve)."""
        session = self._sessions.get(message.consumer_id)
        if session is not None and session.session_id == message.session_id:
            return None
        catalog = self._catalog()
        if isinstance(message, Subscribe | Replace):
            try:
                shards = catalog.shards_matching(message.queue, message.queue_is_regex)
            except re.error:
                return None
        else:
            shards = catalog.consumer_shards(message.consumer_id, message.session_id)
        return next(iter(shards)) if len(shards) == 1 else None

    def _delivery_topic_of(self, consumer_id: str) -> str:
        """Where to answer a consumer: its session's delivery topic, else the conventional
        one (docs/protocol.md §7). Not validated here: a consumer id that makes no legal topic
        name is dropped, counted, by :meth:`_answerable`."""
        session = self._sessions.get(consumer_id)
        if session is not None:
            return session.delivery_topic
        return f"{self.topics.prefix}delivery.{consumer_id}"

    def _answerable(self, replies: list[OutgoingRecord]) -> list[OutgoingRecord]:
        """Replies whose topic Kafka accepts. A request naming an impossible topic cannot be
        answered; producing to it would fail the iteration, and every retry after it."""
        good = [r for r in replies
                if topic_name_problem(r.topic) is None and self._topic_exists(r.topic)]
        if len(good) < len(replies):
            self.counters["unanswerable_replies"] += len(replies) - len(good)
            log.warning("%d replies dropped: no legal topic to answer on",
                        len(replies) - len(good))
        return good

    def _topic_exists(self, topic: str) -> bool:
        """Whether Kafka has the topic (replies never create one: a broker without topic
        auto-creation would fail the whole iteration's flush, again on every retry)."""
        if topic in self._known_topics:
            return True
        assert self._admin is not None
        self._known_topics = set(self._admin.topics())
        if topic in self._known_topics:
            return True
        # A reply topic is a consumer's delivery topic (one partition), which it reads already:
        # create it as a subscribe would; a broker that refuses means no answer is possible.
        try:
            self._admin.ensure_topics([TopicSpec(topic, 1)])
        except KafkaAdapterError as exc:
            log.warning("cannot create reply topic %s: %s", topic, exc)
            return False
        self._known_topics.add(topic)
        return True

    def _session_ended(self, consumer_id: str, session_id: str, reason: SessionEndReason,
                       now: float, message: str | None = None) -> OutgoingRecord:
        topic = self._delivery_topic_of(consumer_id)
        return self._reply(topic, SessionEnded(consumer_id=consumer_id, session_id=session_id,
                                               reason=reason, message=message,
                                               sent_at_ms=ms(now)), consumer_id)

    def _on_subscribe(self, m: Subscribe | Replace, now: float, batch: WriteBatch,
                      replies: list[OutgoingRecord]) -> None:
        kind = RequestKind.SUBSCRIBE if isinstance(m, Subscribe) else RequestKind.REPLACE
        existing = self._sessions.get(m.consumer_id)
        timeout = (m.session_timeout_ms / 1000.0 if isinstance(m, Subscribe)
                   and m.session_timeout_ms > 0 else
                   existing.session_timeout if existing is not None
                   else self.options.default_session_timeout)

        def refuse(status: SubscribeStatus, why: str) -> None:
            self.counters[f"subscribe_{status.value.lower()}"] += 1
            self._refused(EventType.SUBSCRIBE_REFUSED, now, status.value, m.consumer_id,
                          m.session_id, m.queue if not m.queue_is_regex else None)
            log.info("refused %s of %s to %r: %s", kind.value.lower(), m.consumer_id, m.queue, why)
            topic = (m.delivery_topic if topic_name_problem(m.delivery_topic) is None
                     else self._delivery_topic_of(m.consumer_id))
            replies.append(self._reply(topic, SubscribeResult(
                consumer_id=m.consumer_id, session_id=m.session_id, request_id=m.request_id,
                request=kind, status=status, message=why, queues=(),
                session_timeout_ms=int(timeout * 1000),
                heartbeat_interval_ms=int(timeout * 1000 / 3),
                coordinator_id=self.options.owner_id, sent_at_ms=ms(now)), m.consumer_id))

        if kind is RequestKind.REPLACE and (existing is None
                                            or existing.session_id != m.session_id):
            refuse(SubscribeStatus.INVALID_REQUEST, "replace of an unknown session: subscribe")
            return
        problem = topic_name_problem(m.delivery_topic)
        if problem is None and m.delivery_topic in (self.topics.control, self.topics.ack,
                                                    self.topics.events):
            problem = "it is one of the coordinator's own topics"
        if problem is not None:
            refuse(SubscribeStatus.INVALID_REQUEST,
                   f"delivery_topic {m.delivery_topic!r}: {problem}")
            return
        if m.max_backlog is not None and m.max_backlog < 0:
            refuse(SubscribeStatus.INVALID_REQUEST,
                   f"max_backlog must be 0 or more, got {m.max_backlog}")
            return
        if m.filter:
            try:
                compile_expression(m.filter)
            except ExpressionError as exc:
                refuse(SubscribeStatus.INVALID_FILTER, str(exc))
                return
        session = _Session(m.consumer_id, m.session_id, m.queue, m.queue_is_regex,
                           m.max_backlog, m.filter or None, m.delivery_topic, timeout,
                           existing.subscribed_at if existing and kind is RequestKind.REPLACE
                           else now, [])
        try:
            names = [n for n in self.engines if session.matches(n)]
            shards = self._catalog().shards_matching(m.queue, m.queue_is_regex)
        except re.error as exc:
            refuse(SubscribeStatus.INVALID_REQUEST, f"invalid queue regex: {exc}")
            return
        if len(shards) > 1:
            # One backlog across the matched queues (AMPS) needs them in one loop.
            refuse(SubscribeStatus.INVALID_REQUEST,
                   f"the queues {m.queue!r} matches are on shards {sorted(shards)}; a regex "
                   "subscription reads queues of one shard only: give them one shard_group "
                   "in their queue files (docs/coordinator.md, 'One backlog')")
            return
        if m.queue_is_regex:
            session.share = (existing.share if existing is not None
                             and kind is RequestKind.REPLACE and existing.share is not None
                             else BacklogShare())
        if not names:
            refuse(SubscribeStatus.UNKNOWN_QUEUE,
                   f"no queue {'matches' if m.queue_is_regex else 'named'} {m.queue!r}")
            return
        assert self._admin is not None
        try:
            self._admin.ensure_topics([TopicSpec(m.delivery_topic, 1)])
            self._known_topics.add(m.delivery_topic)
        except KafkaAdapterError as exc:
            # Refused rather than retried: a topic the broker will not create would otherwise
            # fail this record's iteration forever. The consumer may subscribe again.
            refuse(SubscribeStatus.INVALID_REQUEST, f"cannot use delivery_topic: {exc}")
            return
        old = existing.queues if existing is not None else []
        for name in old:
            if name not in names:
                self.engines[name].unsubscribe(m.consumer_id, now)
        grants = []
        for name in names:
            engine = self.engines[name]
            event: ev.ConsumerSubscribed | ev.ConsumerReplaced
            if kind is RequestKind.REPLACE and name in old:
                event = engine.replace(m.consumer_id, now, max_backlog=m.max_backlog,
                                       filter=m.filter or None, delivery_topic=m.delivery_topic,
                                       share=session.share)
            else:
                event = engine.subscribe(m.consumer_id, m.session_id, now,
                                         delivery_topic=m.delivery_topic,
                                         max_backlog=m.max_backlog, filter=m.filter or None,
                                         session_timeout=timeout, share=session.share)
            definition = engine.definition
            grants.append(QueueGrant(
                queue=name, max_backlog=event.max_backlog,
                lease_period_ms=int(definition.lease_period * 1000),
                semantics=(WireSemantics.AT_MOST_ONCE
                           if definition.semantics is Semantics.AT_MOST_ONCE
                           else WireSemantics.AT_LEAST_ONCE)))
        session.queues = names
        self._sessions[m.consumer_id] = session
        batch.put_consumer(ConsumerRow(
            consumer_id=m.consumer_id, session_id=m.session_id, queue=m.queue,
            is_regex=m.queue_is_regex, delivery_topic=m.delivery_topic,
            session_timeout_ms=int(timeout * 1000), subscribed_at=session.subscribed_at,
            last_heartbeat_at=now, max_backlog=m.max_backlog, filter=m.filter or None))
        self.counters["subscribes" if kind is RequestKind.SUBSCRIBE else "replaces"] += 1
        replies.append(self._reply(m.delivery_topic, SubscribeResult(
            consumer_id=m.consumer_id, session_id=m.session_id, request_id=m.request_id,
            request=kind, status=SubscribeStatus.OK, message=None, queues=tuple(grants),
            session_timeout_ms=int(timeout * 1000),
            heartbeat_interval_ms=max(int(timeout * 1000 / 3), 100),
            coordinator_id=self.options.owner_id, sent_at_ms=ms(now)), m.consumer_id))

    def _on_consumer_left(self, e: ev.ConsumerLeft, batch: WriteBatch,
                          replies: list[OutgoingRecord], now: float) -> None:
        """An engine dropped a consumer (session timeout): drop it everywhere, tell it."""
        if e.reason is not LeaveReason.SESSION_TIMEOUT:
            return
        session = self._sessions.get(e.consumer_id)
        if session is None or session.session_id != e.session_id:
            return
        for name in session.queues:
            if name != e.queue:
                self.engines[name].unsubscribe(e.consumer_id, now, LeaveReason.SESSION_TIMEOUT)
        replies.append(self._session_ended(e.consumer_id, e.session_id,
                                           SessionEndReason.TIMED_OUT, now,
                                           "no heartbeat within the session timeout"))
        del self._sessions[e.consumer_id]
        batch.delete_consumer(e.consumer_id, e.session_id)
        self.counters["session_timeouts"] += 1
        log.info("consumer %s timed out; its leases were broken", e.consumer_id)

    # ------------------------------------------------------------------ refresh
    def _refresh(self, now: float, batch: WriteBatch, replies: list[OutgoingRecord]) -> None:
        """Pick up queues created, changed, purged, deleted or moved to or from this shard,
        journal partitions added and consumers an operator evicted."""
        catalog = self._catalog()
        self._catalog_seen = catalog.loaded_at
        known = catalog.on_shard(self.shard)
        session_of = {row.consumer_id: row.session_id for row in catalog.consumers.values()}
        session_of.update((s.consumer_id, s.session_id) for s in self._sessions.values())
        for name, record in known.items():
            if record.purge_pending and name in self.engines:
                self._purge(name, now, batch)
                assert record.purge_requested_at is not None
                batch.purge_done(name, record.purge_requested_at)
                # A purge bumps the version; it is not a definition change to rebuild for.
                self._versions[name] = record.version
        self._evict(catalog.consumers.values(), now, batch, replies)
        for name in list(self.engines):
            if name not in known:
                elsewhere = catalog.shard_of(name)
                if elsewhere is None:
                    log.info("queue %s was deleted", name)
                    self._drop_queue(name, now)
                    continue
                log.info("queue %s moved to shard %d", name, elsewhere)
                self._drop_queue(name, now)
                # Sessions left with no queue here belong to the shard the queue went to: it
                # serves them from the stored consumer row, and this shard passes their
                # records on to it.
                for consumer_id, session in list(self._sessions.items()):
                    if not session.queues:
                        del self._sessions[consumer_id]
        for name, record in known.items():
            if name not in self.engines:
                log.info("queue %s is served by shard %d from now on", name, self.shard)
                self._add_queue(name, record.definition, record.version, now, session_of)
                self._subscribe_regex_sessions(name, now)
                # The sessions of a queue that moved here: their consumers still write to the
                # old shard, which passes their records on.
                self._restore_sessions(catalog.consumers.values(), now, only=name)
            elif record.version != self._versions.get(name):
                # Rebuild the queue from its persisted state under the new definition: leases
                # are persisted, so they survive; what is in flight this iteration is not lost
                # because the journal is re-read from the recovery points.
                log.info("queue %s changed (version %d); rebuilding it", name, record.version)
                self._drop_queue(name, now, keep_sessions=True)
                self._add_queue(name, record.definition, record.version, now, session_of)
                self._resubscribe(name, now)
        # New partitions or topics for queues that already exist: one listing for them all.
        if now < self._next_topic_check:
            return
        self._next_topic_check = now + self.options.topic_check_interval
        assert self._admin is not None
        listed = self._admin.topics()
        for engine in self.engines.values():
            points = engine.recovery_points()
            missing = [tp for tp in self._journal_partitions(engine.definition, listed)
                       if tp not in points]
            if missing:
                assert self._admin is not None
                starts = self._admin.log_start_offsets(missing)
                engine.restore([], starts)
                self._read_from(starts)
                self._queues_by_topic.clear()

    def _purge(self, name: str, now: float, batch: WriteBatch) -> None:
        """`qlayer queue purge`: every entry leaves the queue, acknowledged by the operator
        (AMPS: a sow_delete on the queue). Leases end; their holders' late acks are answered
        DUPLICATE. Each entry gets its ACKED event (source admin), so audits still balance."""
        engine = self.engines[name]
        purged = 0
        # Entries beyond target_queue_depth become active as the ones before them leave.
        for _ in range(1_000):
            n = engine.ack_matching(None, now)
            engine.tick(now)
            purged += n
            if n == 0:
                break
        self.counters["purged"] += purged
        log.info("queue %s purged: %d entries acknowledged by the operator", name, purged)

    def _evict(self, rows: Iterable[ConsumerRow], now: float, batch: WriteBatch,
               replies: list[OutgoingRecord]) -> None:
        """`qlayer consumers evict`: break the consumer's leases at once and tell it. Each
        shard evicts its own sessions; a consumer no shard serves is evicted by shard 0."""
        for row in rows:
            if row.evict_requested_at is None:
                continue
            session = self._sessions.get(row.consumer_id)
            if session is None and not self._serves_orphan(row):
                continue
            if session is not None:
                for queue in session.queues:
                    engine = self.engines.get(queue)
                    if engine is not None:
                        engine.unsubscribe(row.consumer_id, now, LeaveReason.EVICTED)
                replies.append(self._session_ended(
                    row.consumer_id, session.session_id, SessionEndReason.EVICTED, now,
                    "evicted by an operator (qlayer consumers evict)"))
                del self._sessions[row.consumer_id]
            batch.delete_consumer(row.consumer_id, row.session_id)
            self.counters["evictions"] += 1
            log.info("consumer %s evicted; its leases were broken", row.consumer_id)

    def _serves_orphan(self, row: ConsumerRow) -> bool:
        """Whether this shard handles a stored consumer no loop has a session for: the shard
        its queues are on, or shard 0 when they are on none (deleted)."""
        shards = self._catalog().consumer_shards(row.consumer_id, row.session_id)
        return self.shard in shards or (not shards and self.shard == 0)

    def _drop_queue(self, name: str, now: float, keep_sessions: bool = False) -> None:
        engine = self.engines.pop(name)
        self._versions.pop(name, None)
        for key in [k for k in self._persisted_points if k.queue == name]:
            del self._persisted_points[key]
        for known in (self._admitted_to, self._persisted_admitted):
            for key in [k for k in known if k.queue == name]:
                del known[key]
        self._counted_from.pop(name, None)
        self._queues_by_topic.clear()
        if keep_sessions:
            return
        for session in self._sessions.values():
            if name in session.queues:
                session.queues.remove(name)
        del engine

    def _resubscribe(self, name: str, now: float) -> None:
        engine = self.engines.get(name)
        if engine is None:
            return
        for s in self._sessions.values():
            if name in s.queues:
                engine.subscribe(s.consumer_id, s.session_id, now, delivery_topic=s.delivery_topic,
                                 max_backlog=s.max_backlog, filter=s.filter,
                                 session_timeout=s.session_timeout, share=s.share)

    def _subscribe_regex_sessions(self, name: str, now: float) -> None:
        """A regex subscription covers queues created after it (as AMPS regex topics do)."""
        engine = self.engines.get(name)
        if engine is None:
            return
        for s in self._sessions.values():
            if s.is_regex and s.matches(name) and name not in s.queues:
                engine.subscribe(s.consumer_id, s.session_id, now, delivery_topic=s.delivery_topic,
                                 max_backlog=s.max_backlog, filter=s.filter,
                                 session_timeout=s.session_timeout, share=s.share)
                s.queues.append(name)
