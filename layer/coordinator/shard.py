"""The shard loop: the I/O around one shard's core (DESIGN §2, §6).

A coordinator process (`layer.coordinator.process`) runs one loop per shard the coordinators'
group assigned it, on one thread. Each iteration (:meth:`ShardLoop.run_once`) goes down once
and up once:

1. maintenance that is due (`layer.coordinator.maintenance`): queue changes, new partitions;
2. poll the shard's journals and its partitions of the control and ack topics;
3. `ShardCore.step` decides (pure): the PostgreSQL batch, deliveries, dead letters, replies,
   events, records for other shards;
4. write dead letters, and records passed on to other shards, to Kafka and wait for them (an
   entry leaves only once its dead letter is safe; a passed-on ack is safe before its position
   is stored);
5. one PostgreSQL transaction for everything decided, guarded by the shard's epoch;
6. only then produce deliveries, replies and events, without waiting for them: their
   delivery reports are served early in the next iteration (a failure there rebuilds the
   shard, exactly as a failure here would), so the loop never idles on a broker round trip;
7. commit the input topics' offsets.

Postgres before Kafka is the safety argument: a crash between 5 and 6 leaves leases without
deliveries. The restart sends the deliveries of every restored lease again, unchanged (same
token), once the replay brings their records back; a consumer drops a delivery whose token it
already has. Leases whose consumers are gone expire and are redelivered (at-least-once). The
input positions of 7 are also written in 5, so a restart applies no ack twice.

A loop reads only its shard's partitions of the control and ack topics (partition p belongs to
shard p mod N). A record there for a queue or session of another shard (a consumer that has
not heard from its shard yet, a queue moved away) is passed on to that shard's partition with
a ``qlayer.forwarded`` hop count.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from layer.coordinator.authorize import Refusals
from layer.coordinator.catalog import Catalog
from layer.coordinator.core import Plan, ShardCore, record_limit
from layer.coordinator.deferred import DeferredReader
from layer.coordinator.faults import FAULT_COUNTERS, is_fault_counter
from layer.coordinator.fences import Fence
from layer.coordinator.logformat import fields
from layer.coordinator.maintenance import GroupOffsets, PartitionCheck, QueueLoader, Refresh
from layer.coordinator.options import CoordinatorOptions, LeaseTokens, LoopStats
from layer.coordinator.output import Output
from layer.coordinator.payloads import MemoryPool, RangeReader
from layer.coordinator.phases import PhaseTimes
from layer.coordinator.ports import StateStore
from layer.coordinator.refused import Refused, alone, refused_among
from layer.coordinator.topicsweep import DeliveryTopicSweep
from layer.coordinator.translate import ms
from layer.domain.errors import QlayerError
from layer.domain.shards import shard_key
from layer.domain.states import Bookmark
from layer.kafka import (
    BEGINNING,
    DeliveryFailed,
    JournalReader,
    JournalRecord,
    KafkaAdmin,
    OutgoingRecord,
    RecordWriter,
)
from layer.kafka.fence import Fencer
from layer.kafka.logs import ClientLog
from layer.protocol import Event, EventType, TopicNames
from layer.settings import Settings
from layer.store.batch import WriteBatch
from layer.store.errors import FencedError

log = logging.getLogger(__name__)

__all__ = ["FAULT_COUNTERS", "CoordinatorOptions", "LeaseTokens", "LoopStats", "ShardLoop",
           "is_fault_counter"]

#: Iterations whose records may be kept unconfirmed (`ShardLoop._unconfirmed`) before the
#: loop waits for them.
_UNCONFIRMED_ITERATIONS = 1000

#: A gap (s) between two iterations of a loop past which its consumers' sessions are given a
#: fresh timeout (`ShardLoop._forgive`); iterations normally follow each other within ms.
STALL = 5.0


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
        store: StateStore,
        admin: KafkaAdmin,
        memory: MemoryPool | None = None,
        tokens: Callable[[], str] | None = None,
        client_log: ClientLog | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self.shard = shard
        # librdkafka's log lines of the shard's clients, repeats said once a minute (the
        # process shares one among its loops).
        self._client_log = client_log or ClientLog()
        self.key = shard_key(shard)
        self.store = store
        self.admin = admin
        self.topics = TopicNames(settings.topic_prefix)
        self.counters: Counter[str] = Counter()
        #: Records not acted on by kind, reason and principal (kept, like ``counters``,
        #: across rebuilds of the shard).
        self.refusals = Refusals()
        #: Each phase's time per iteration, as a histogram (the metrics endpoint).
        self.phases = PhaseTimes()
        self.epoch: int | None = None
        self.core = ShardCore(shard, options, topics=self.topics, catalog=catalog, admin=admin,
                              tokens=tokens or LeaseTokens(), owner_id=options.owner_id,
                              memory=memory, counters=self.counters, refusals=self.refusals)
        self.output = Output(self.core)
        # Records larger than the producer writes never reach it (issue 15, 2a).
        self.core.record_limit = record_limit(self.settings.kafka_config())
        # Events go to the shard's key's partition of the events topic: in commit order.
        self._event_key = self.key.encode()
        # The newest outbox batch known to be on the events topic (deleted from the outbox by
        # the next transaction).
        self._published: int | None = None
        # The newest outbox batch sent but not yet known to be written, and when it was sent.
        self._sent: int | None = None
        self._sent_at = 0.0
        # Ack and control positions applied but not yet committed to the coordinator's Kafka
        # group, and when they may be next (`offset_commit_interval`).
        self._uncommitted: dict[tuple[str, int], int] = {}
        self._commit_offsets_at = 0.0
        self._reader: JournalReader | None = None
        self._writer: RecordWriter | None = None
        # The writer's transactional id (``--transactions``), None without.
        self._tid: str | None = None
        # The records sent without a transaction whose delivery reports may still come (each
        # iteration's list, kept by reference): a record the broker refuses as too large is
        # found here again, headers and all (`_resend_refused`).
        self._unconfirmed: list[list[OutgoingRecord]] = []
        self._range_reader: RangeReader | None = None
        self._deferred_reader: DeferredReader | None = None
        self._maintenance: tuple[Refresh, PartitionCheck, GroupOffsets] | None = None
        # Shard 0's owner deletes the delivery topics no session uses any more, for every shard.
        self._sweep: DeliveryTopicSweep | None = None
        # Protocol 9: fences transactional consumers' producers off the loop (made on the
        # first fence).
        self._fencer: Fencer[Fence] | None = None
        # The last iteration's phases (µs: polling, deciding, committing, encoding, writing),
        # and why the loop last did not run (set by the process after another shard's slow
        # iteration; said, then cleared, by `_forgive`).
        self._last_phases_us: tuple[int, ...] = (0, 0, 0, 0, 0)
        self.stall_hint: str | None = None
        # Consumer rows the last commit did not write (`Control.lost_claims`).
        self._consumers_refused: frozenset[str] = frozenset()
        # When the last iteration began (None before the first since the shard was taken).
        self._last_iteration: float | None = None

    @property
    def engines(self) -> dict[str, object]:
        """The shard's queues by name (empty while the shard is not running)."""
        return dict(self.core.engines)

    @property
    def is_owner(self) -> bool:
        return self.epoch is not None

    def fault_counters(self) -> dict[str, int]:
        """The shard's running totals of input faults, isolated poison input and refusals
        (malformed ack and control records, refusals by status and by kind, reason and
        principal, records too large to deliver, journals deleted while read), as stored in
        PostgreSQL: what its earlier owners stored plus what this process committed since it
        took the shard (`layer.coordinator.faults`). A snapshot (a new dict)."""
        return self.core.faults.totals()

    # ------------------------------------------------------------------ ownership
    def take(self, now: float) -> int:
        """Take the shard (a new epoch, which fences any earlier holder) and start serving it:
        restore its queues from PostgreSQL and read on. The group assigned it to us.
        Returns the epoch taken.

        The core starts empty: a shard this process ran before (revoked, then assigned
        again) is restored from what is stored, never from what this process remembers."""
        self.core.reset()
        self._last_iteration = None
        self._uncommitted, self._commit_offsets_at = {}, 0.0  # a former epoch's positions
        self.epoch = self.store.take_shard(self.key, self.options.owner_id, now)
        self.core.epoch = self.epoch
        self.core.faults.take(self.store.shard_counters(self.key))
        # The process says which shards it took and why, in one line per round.
        log.debug("coordinator %s runs shard %d at epoch %d", self.options.owner_id, self.shard,
                  self.epoch, extra=fields(shard=self.shard, epoch=self.epoch))
        try:
            self._start(now)
        except BaseException:
            self._lose_ownership("start-up failed")
            raise
        return self.epoch

    def release(self, now: float, *, kafka: bool = True) -> None:
        """Hand the shard over at once (revocation, clean stop): its OWNERSHIP_LOST events
        written, best effort, and its row released. Without ``kafka`` (Kafka has just failed)
        nothing more is written to Kafka: each write would only wait for its timeout."""
        if not kafka:
            self._release_row(now)
            self._close_clients(timeout=0.0)
            self.epoch = None
            self.core.reset()
            return
        if self._writer is not None and self._sent is not None:
            # Batches sent without waiting: known to be written once the producer is empty.
            try:
                self._writer.flush(5.0)
                self._published, self._sent = self._sent, None
            except QlayerError as exc:
                log.warning("event batches sent last may not be written: %s", exc)
        if self._reader is not None and self._uncommitted:
            try:
                self._commit_offsets(self._reader, now)
            except QlayerError as exc:
                log.warning("could not commit the inputs' Kafka offsets: %s", exc)
        if self.epoch is not None and self._writer is not None and self.core.engines:
            # A clean stop says so on the events topic; a crash cannot. These change nothing
            # stored, so they go as plain Event records, not through the outbox.
            self._ownership_events(EventType.OWNERSHIP_LOST, now)
            records = [OutgoingRecord(self.topics.events, self.core.codec.encode_event(e),
                                      self._event_key) for e in self.core.pending_events]
            try:
                self._writer.send(records)
                self._writer.flush(5.0)
            except QlayerError as exc:
                log.warning("could not write OWNERSHIP_LOST events: %s", exc)
            self.core.pending_events = []
        if self._published is not None:
            # The next owner would publish these batches again; readers would drop the
            # copies, but there is no need for them.
            try:
                self.store.forget_published(self.key, self._published)
            except QlayerError as exc:
                log.warning("could not trim the events outbox: %s", exc)
            self._published = None
        self._release_row(now)
        self._close_clients()
        self.epoch = None
        self.core.reset()

    def _release_row(self, now: float) -> None:
        if self.epoch is not None:
            try:
                self.store.release(self.key, self.options.owner_id, self.epoch, now)
            except QlayerError as exc:
                log.warning("releasing ownership failed: %s", exc)

    def abandon(self, why: str) -> None:
        """Stop at once without writing anything (the shard was lost: another process may
        already run it, and the epoch fences whatever this one would still write)."""
        if self.epoch is not None:
            self._lose_ownership(why)

    def rebuild(self, now: float, *, kafka: bool = True) -> None:
        """Drop all in-memory state after a failure; keep nothing that was not persisted.
        The process takes the shard again (a new epoch) before the next iteration. Without
        ``kafka`` (the failure was Kafka's) nothing is written to Kafka on the way out."""
        self.release(now, kafka=kafka)
        self.core.reset()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the shard's next input (kept for the next iteration);
        True as soon as there is some, False at once when the shard is not running."""
        return self._reader.wait(timeout) if self._reader is not None else False

    def lag(self) -> int | None:
        """Records of this shard's inputs not read yet (from the last fetches)."""
        return self._reader.lag() if self._reader is not None else None

    def end_offsets(self) -> dict[tuple[str, int], int]:
        """Each input partition's end offset as the last fetches saw it (no round trip)."""
        return self._reader.high_watermarks() if self._reader is not None else {}

    def _lose_ownership(self, why: str) -> None:
        log.warning("coordinator %s gives up shard %d: %s", self.options.owner_id,
                    self.shard, why, extra=fields(owner=self.options.owner_id, shard=self.shard,
                                                  epoch=self.epoch, reason=why))
        # Nothing more is written: what is still queued would come from a former owner.
        self._close_clients(timeout=0.0)
        self.epoch = None
        self.core.reset()

    def _ownership_events(self, kind: EventType, now: float) -> None:
        """OWNERSHIP_ACQUIRED / OWNERSHIP_LOST for every queue of the shard (events topic)."""
        assert self.epoch is not None
        self.core.pending_events.extend(
            Event(type=kind, timestamp_ms=ms(now), coordinator_id=self.options.owner_id,
                  coordinator_epoch=self.epoch, queue=name) for name in self.core.engines)

    def _close_clients(self, timeout: float = 10.0) -> None:
        """Close the shard's Kafka clients; the writer writes what it has queued within
        ``timeout`` (0: drops it)."""
        if self._writer is not None:
            self._writer.close(timeout)  # never raises
        for closer in (self._reader, self._range_reader, self._deferred_reader):
            if closer is not None:
                try:
                    closer.close()
                except Exception as exc:  # closing must not hide the reason we stop
                    log.warning("closing a Kafka client failed: %s", exc)
        self._reader = None
        self._writer = None
        self._unconfirmed = []
        self._range_reader = None
        self._deferred_reader = None
        self._maintenance = None
        self._sweep = None
        if self._fencer is not None:
            # A fence under way finishes on its own; its outcome is for a state that is gone,
            # and a rebuilt shard asks for its fences again.
            self._fencer.close()
            self._fencer = None
        # What this owner sent but could not confirm stays in the outbox: the next owner
        # publishes it again (readers keep the first copy of a batch).
        self._sent = None

    # ------------------------------------------------------------------ start-up
    def _start(self, now: float) -> None:
        kafka = self._kafka_config()
        # One transactional id per shard: a process that takes the shard fences the producer
        # of the one that had it.
        self._tid = (f"{self.topics.prefix}coordinator-{self.shard}"
                     if self.options.transactional else None)
        # Records a topic refuses as too large are handed back: without a transaction to be
        # sent alone (`_resend_refused`); in one, whose whole commit a refusal fails, to be
        # written again split (`_transact`).
        self._writer = RecordWriter(kafka, transactional_id=self._tid, keep_too_large=True)
        self._publish_outbox(self._writer)
        self._reader = reader = JournalReader(kafka, group_id=f"{self.topics.prefix}coordinator")
        # Acks and control records are assigned before the journals, so the first fetches
        # carry them: after a restart, consumers' acks and heartbeats are read at once rather
        # than behind the replay of the journals.
        core = self.core
        catalog = core.catalog()
        listed = self.admin.topics()
        inputs = [(topic, p) for topic in (self.topics.control, self.topics.ack)
                  for p in range(listed.get(topic, 0)) if p % catalog.shard_count == self.shard]
        # Read on where the last owner's applied acks and control records end: the positions
        # it committed to PostgreSQL with their effects. The group offsets in Kafka are only
        # for partitions it never wrote a position for (a database from before 0003).
        stored = self.store.load_input_positions(self.key)
        committed = reader.committed([tp for tp in inputs if tp not in stored])
        committed.update(stored)
        # Control and ack records older than the topics' retention are gone for good; they
        # mattered only within a session timeout, so reading on from the log start is right.
        firsts = self.admin.log_start_offsets(inputs)
        reader.add({tp: (max(o, firsts.get(tp, 0)) if o is not None else BEGINNING)
                    for tp in inputs for o in [committed.get(tp)]})
        loader = QueueLoader(core, self.store, self.admin, reader)
        rows = catalog.session_rows
        with loader.together():
            for record in catalog.on_shard(self.shard).values():
                loader.add(record, rows, now)
        core.restore_sessions(rows, now)
        self._ownership_events(EventType.OWNERSHIP_ACQUIRED, now)
        refresh = Refresh(core, loader, self.options.refresh_interval)
        refresh.seen, refresh.next_at = catalog.loaded_at, now + self.options.refresh_interval
        self._maintenance = (refresh, PartitionCheck(core, loader,
                                                     self.options.topic_check_interval),
                             GroupOffsets(core, self.admin, self.options.group_commit_interval))
        retention = self.options.delivery_topic_retention
        if self.shard == 0 and retention > 0:
            self._sweep = DeliveryTopicSweep(core, self.admin, self.store.delivery_topics_in_use,
                                             retention)

    def _kafka_config(self) -> dict[str, Any]:
        return {**self.settings.kafka_config(), "logger": self._client_log}

    def _publish_outbox(self, writer: RecordWriter) -> None:
        """Publish the event batches the shard's outbox still holds: the previous owner
        committed them and stopped before it knew they were published (DESIGN §2). One that
        was published after all appears twice; readers keep the first copy of a batch_id."""
        batches = self.store.load_outbox(self.key)
        if not batches:
            return
        codec = self.core.codec
        writer.send([OutgoingRecord(self.topics.events,
                                    codec.encode_event_batch(batch_id, self.shard, events),
                                    self._event_key) for batch_id, events in batches])
        writer.flush()
        self._published = batches[-1][0]
        self.counters["outbox_republished"] += len(batches)
        log.info("shard %d: published %d event batches its outbox held", self.shard,
                 len(batches), extra=fields(shard=self.shard, epoch=self.epoch))

    # ------------------------------------------------------------------ the loop
    def run_once(self, now: float, poll_timeout: float | None = None) -> LoopStats:
        """One iteration: maintenance, poll, decide, persist, produce. Requires the shard."""
        reader, writer, maintenance = self._reader, self._writer, self._maintenance
        if reader is None or writer is None or maintenance is None or self.epoch is None:
            raise QlayerError("run_once needs the shard: call take first")
        refresh, partitions, group_offsets = maintenance
        batch, replies = WriteBatch(), list[OutgoingRecord]()
        if refresh.due(now):
            refresh.run_once(now, batch, replies)
        # New partitions, and journals deleted or made again (found by the listing, or by
        # the reader meeting a position outside a partition's log in the last poll).
        out_of_range, reader.out_of_range = reader.out_of_range, set()
        partitions.run_once(now, batch, out_of_range)
        clock = time.perf_counter
        started = clock()
        records = reader.poll(self.options.max_batch, self.options.poll_timeout
                              if poll_timeout is None else poll_timeout)
        # Delivery reports of what earlier iterations sent, served without waiting.
        self._confirm(writer, now)
        polled = clock()
        last, self._last_iteration = self._last_iteration, now
        if last is not None and now - last > STALL:
            self._forgive(now, now - last)
        if self.core.fences.pending:
            # Protocol 9: a fenced session ends once its ack partition is read this far.
            self.core.ack_read_to = reader.read_to(self.topics.ack, self.shard)
        plan = self.core.step(records, now, batch, replies)
        stats = plan.stats
        # Records whose bytes were dropped past the memory budget are read again, in
        # sequential ranges, before anything is written.
        reread = self._reread([e.bookmark for e in plan.expired]
                              + [d.bookmark for d in plan.deliveries]
                              + (self.core.lane.missing() if self.core.lane is not None else []))
        dead_letters: list[OutgoingRecord] = []
        for e in plan.expired:
            dead_letters.extend(self.output.dead_letter(e, now, reread))
        # Dead letters are safe in Kafka before their entries leave the queue, and records
        # passed on to other shards before their input positions are stored.
        if dead_letters or plan.forwards:
            safe = dead_letters + plan.forwards
            if writer.transactional:
                self._transact(safe)
                writer = self._transacting()  # a refusal replaces the writer
            else:
                self._unconfirmed.append(safe)
                writer.send(safe)
                writer.flush()
                # A dead letter or a forward refused as too large is written alone, or fails
                # the iteration as any other failure does.
                self._resend_refused(writer)
                self._unconfirmed = []  # all written: the flush waited for every record
            stats.dead_letters = len(dead_letters)
            self.counters["forwarded"] += len(plan.forwards)
        # The events, into the outbox of the transaction that commits what they describe.
        events = self.output.event_records(plan.events, plan.fresh)
        if events:
            plan.batch.put_events(self.core.codec.event_arrays(events))
        stats.events = len(events)
        published = self._published
        if published is not None and not plan.batch.is_empty():
            plan.batch.published(published)
        decided = clock()
        batch_ids = self._commit(plan, now)
        if plan.batch.shard_counts:
            self.core.faults.committed(plan.batch.shard_counts)
        unsent: frozenset[str] = frozenset()
        if self._consumers_refused:
            # Sessions whose row another shard holds for a live session of the same id.
            unsent = self.core.control.lost_claims(self._consumers_refused, now, plan.replies)
            self._consumers_refused = frozenset()
        if plan.batch.outbox_published is not None:
            self._published = None  # deleted from the outbox by that transaction
        committed = clock()
        out = self._write(plan, reread, writer, batch_ids, now, unsent)
        written = clock()
        self.core.settled(plan)
        if plan.wanted_documents:
            # Filters that need fields the projections past the memory window did not keep:
            # their records are read again, and the next iteration decides on them.
            self.core.refresh_documents(self._read_back(plan.wanted_documents))
        # Queues past their target_queue_depth with room again: their deferred records are
        # read back now, and the next iteration delivers them.
        if self.core.records_wanted():
            if self._deferred_reader is None:
                self._deferred_reader = DeferredReader(
                    self.settings.kafka_config(), f"{self.topics.prefix}coordinator-reread")
            self.counters["deferred_records_read"] += self._deferred_reader.serve(self.core, now)
        # Inputs are consumed. The positions that count are in PostgreSQL, committed with
        # their effects; the group's offsets in Kafka are only for a database from before
        # 0003 and for lag tools, so they go at most once per offset_commit_interval: each
        # commit costs the broker ~0.5 ms of CPU (benchmarks/offset_commits.py).
        if plan.input_offsets:
            self._uncommitted.update(plan.input_offsets)
        if self._uncommitted and now >= self._commit_offsets_at:
            self._commit_offsets(reader, now)
        self.counters["iterations"] += 1
        self.counters["journal_records"] += stats.journal_records
        self.counters["deliveries"] += stats.deliveries
        self.counters["ack_items"] += stats.ack_items
        # Where the loop's wall time goes (µs), for diagnosis and the benchmarks: waiting for
        # input, deciding, PostgreSQL, encoding and writing to Kafka.
        polling = int((polled - started) * 1e6)
        deciding = int((decided - polled) * 1e6)
        committing = int((committed - decided) * 1e6)
        writing = int((written - committed) * 1e6) - out
        self.counters["us_polling"] += polling
        self.counters["us_deciding"] += deciding
        self.counters["us_committing"] += committing
        self.counters["us_writing"] += writing
        self.counters["us_encoding"] += out
        self.phases.observe(polling, deciding, committing, out, writing)
        self._last_phases_us = (polling, deciding, committing, out, writing)
        if self.core.fences.pending:
            self._fence(now)
        group_offsets.run_once(now)
        if self._sweep is not None:
            self._sweep.run_once(now)
        return stats

    def _fence(self, now: float) -> None:
        """Fence the producers of the transactional sessions due for it (protocol 9,
        `layer.coordinator.fences`) and take where the ack partition ended afterwards, on a
        thread of the shard's: a slow transaction coordinator holds up those sessions, never
        the shard's other queues. One that fails (a broker away) is tried again later; its
        session's leases stay held."""
        fences = self.core.fences
        for fence, outcome in self._fencer.finished() if self._fencer is not None else []:
            if isinstance(outcome, int):
                fences.fenced(fence, outcome)
                self.counters["producers_fenced"] += 1
                continue
            pause = fences.failed(fence, now)
            self.counters["fence_failures"] += 1
            log.warning("consumer %s: cannot fence transactional id %s yet (tried again in "
                        "%.1fs; its leases stay held): %s", fence.consumer_id,
                        fence.transactional_id, pause, outcome,
                        extra=fields(consumer=fence.consumer_id, shard=self.shard,
                                     reason="fence failed"))
        due = fences.to_fence(now)
        if not due:
            return
        fencer = self._fencer
        if fencer is None:
            fencer = self._fencer = Fencer(
                self._kafka_config(), self.core.admin.end_offsets, (self.topics.ack, self.shard),
                self.options.fence_timeout, f"fence-{self.shard}")
        for fence in due:
            fence.in_flight = True
            fencer.submit(fence, fence.transactional_id)

    def _commit_offsets(self, reader: JournalReader, now: float) -> None:
        """Commit the applied ack and control positions to the Kafka group (asynchronously;
        a lost commit costs nothing: the positions in PostgreSQL are the ones read on from)."""
        offsets, self._uncommitted = self._uncommitted, {}
        self._commit_offsets_at = now + self.options.offset_commit_interval
        reader.commit(offsets)
        self.counters["offset_commits"] += 1

    def _forgive(self, now: float, gap: float) -> None:
        """The loop did not run for ``gap`` seconds (Kafka or PostgreSQL did not answer, a
        Kafka transaction waited for a broker, another shard held the thread). The consumers'
        heartbeats written meanwhile may not be read yet: no session is timed out for the
        coordinator's own silence. Each gets a fresh session timeout from now, as a restart
        gives them (`ShardCore.restore_sessions`); one that is really gone times out then."""
        sessions = self.core.sessions
        for session in sessions.values():
            for name in session.every_queue:
                engine = self.core.engines.get(name)
                if engine is not None:
                    engine.heartbeat(session.consumer_id, now, session.session_id)
        self.counters["stalls"] += 1
        cause, self.stall_hint = self.stall_hint, None
        if sessions:
            log.warning("shard %d did not run for %.1fs%s: its %d consumer sessions get a "
                        "fresh session timeout", self.shard, gap,
                        f" ({cause})" if cause else "", len(sessions),
                        extra=fields(shard=self.shard, epoch=self.epoch))

    def phase_breakdown(self) -> str:
        """The last iteration's time by phase, largest first, for a log line."""
        names = ("polling", "deciding", "committing", "encoding", "writing")
        parts = sorted(zip(self._last_phases_us, names, strict=True), reverse=True)
        return ", ".join(f"{name} {us / 1e6:.2f}s" for us, name in parts if us >= 10_000) \
            or "no phase over 10 ms: time between the phases"

    def _commit(self, plan: Plan, now: float) -> tuple[int, ...]:
        """One guarded transaction for everything decided; returns its outbox batches' ids."""
        if plan.batch.is_empty():
            return ()
        assert self.epoch is not None
        try:
            result = self.store.commit(plan.batch, self.key, self.options.owner_id,
                                       self.epoch, now)
        except FencedError:
            self._lose_ownership("fenced: another coordinator took the shard over")
            raise
        plan.stats.statements = result.statements
        self.counters["statements"] += result.statements
        self.counters["transactions"] += 1
        self._consumers_refused = result.consumers_refused
        return result.outbox_batch_ids

    def _write(self, plan: Plan, reread: dict[Bookmark, JournalRecord],
               writer: RecordWriter, batch_ids: tuple[int, ...], now: float,
               unsent: frozenset[str]) -> int:
        """Send deliveries, replies and the iteration's event batch; returns the µs spent
        encoding them. They are waited for only in a Kafka transaction; otherwise `_confirm`
        checks them next iteration. A failure raises: the rebuild that follows publishes the
        event batch from the outbox and sends the deliveries of the restored leases again."""
        started = time.perf_counter()
        stats, output = plan.stats, self.output
        out = output.deliveries(plan.deliveries, reread, unsent)
        stats.deliveries = output.delivered
        self.counters["delivery_records"] += len(out)
        stats.replies = len(plan.replies)
        out.extend(output.answerable(plan.replies, now))
        encode = self.core.codec.encode_event_batch
        out.extend(OutgoingRecord(self.topics.events, encode(batch_id, self.shard, events),
                                  self._event_key)
                   for batch_id, events in zip(batch_ids, plan.batch.outbox, strict=True))
        encoding = int((time.perf_counter() - started) * 1e6)
        if writer.transactional:
            # A transaction's records are readable only once it commits.
            if out:
                self._transact(out)
            if batch_ids:
                self._published = batch_ids[-1]
            return encoding
        if out:
            self._unconfirmed.append(out)
            writer.send(out)
        if batch_ids:
            if self._sent is None:
                self._sent_at = now
            self._sent = batch_ids[-1]
        return encoding

    def _confirm(self, writer: RecordWriter, now: float) -> None:
        """Serve the delivery reports of earlier iterations' records (raising, so the shard is
        rebuilt, if any failed) and learn which event batches are written: all of them once
        nothing is in flight. Under a load that never lets the producer empty, a flush every
        ``confirm_interval`` bounds how long published batches stay in the outbox."""
        if writer.transactional:
            return
        in_flight = writer.drain()
        if self._resend_refused(writer):
            in_flight = writer.drain()
        if not in_flight:
            self._unconfirmed = []
        elif len(self._unconfirmed) > _UNCONFIRMED_ITERATIONS:
            # A load that never lets the producer empty: the records kept for refusals are
            # bounded by waiting for them (about once a second at most, with iterations of ms).
            writer.flush()
            self._resend_refused(writer)
            self._unconfirmed = []
            in_flight = 0
        if self._sent is None:
            return
        if in_flight and now - self._sent_at >= self.options.confirm_interval:
            writer.flush()
            self._resend_refused(writer)
            self._unconfirmed = []
            in_flight = 0
        if not in_flight:
            self._published, self._sent = self._sent, None

    def _resend_refused(self, writer: RecordWriter) -> bool:
        """Records the broker refused as too large for their topic (a delivery topic's
        ``max.message.bytes`` under the producer's), each message sent again alone
        (`layer.coordinator.refused`): a delivery still refused alone is dead-lettered by the
        next step (reason ``too_large``) rather than failing the iteration, which would
        rebuild the shard and send it again, forever. Anything else refused alone, or a
        refused record not found among those sent, fails the iteration as before. Returns
        whether any record was refused."""
        reported = writer.take_too_large()
        if not reported:
            return False
        refused = refused_among(reported, self._unconfirmed)
        too_large: list[Refused] = []
        sent = 0
        for record, delivery in alone(refused):
            if writer.send_alone(record):
                sent += 1
            elif delivery is None:
                raise DeliveryFailed(f"{record.topic}: the broker refused a record of "
                                     f"{len(record.value or b'')} bytes as larger than the "
                                     "topic's max.message.bytes")
            else:
                too_large.append(delivery)
        self.counters["refused_sent_alone"] += sent
        log.warning("shard %d: the broker refused %d records as too large for their topic; "
                    "%d messages sent again alone, %d still refused alone (dead-lettered, "
                    "reason too_large)", self.shard, len(refused), sent, len(too_large),
                    extra=fields(shard=self.shard, epoch=self.epoch, reason="too_large"))
        if too_large:
            self.core.too_large(too_large)
        return True

    def _transacting(self) -> RecordWriter:
        writer = self._writer
        if writer is None:
            raise QlayerError("the shard has no Kafka writer: call take first")
        return writer

    def _transact(self, records: list[OutgoingRecord]) -> None:
        """Write ``records`` in a Kafka transaction and commit it (``--transactions``).

        A record the broker refuses as too large for its topic (a delivery topic's
        ``max.message.bytes`` under the producer's) dooms the whole transaction: it is
        aborted, so none of its records was ever readable (consumers read committed records
        only), and written again by a new producer, the refused records taken apart
        (`layer.coordinator.refused`): each of their messages is sent alone, after the
        others, and waited for before the next, so a refusal then is that message's own. A
        delivery refused alone is left out of the next attempt and dead-lettered by the next
        step (reason ``too_large``); the others are delivered with their original lease.
        Each attempt takes at least one record out of the batch or one message out of those
        sent alone, so this ends. Nothing is sent twice: only committed transactions are
        read, and every record is in one committed transaction. A record that is not a
        delivery, still refused alone, fails the iteration as before; so does any other
        failure (the shard is rebuilt). Refusals are rare (a misconfigured topic): each costs
        an abort and a new producer, where a rebuild cost as much and came back for ever."""
        batch = records
        singles: list[tuple[OutgoingRecord, Refused | None]] = []
        too_large: list[Refused] = []
        started = time.perf_counter()
        attempts = 0
        while True:
            refused = self._transaction(batch, [r for r, _ in singles])
            if refused is None:
                break
            attempts += 1
            records_refused, at = refused
            if at is None:
                out = {id(r) for r in records_refused}
                batch = [r for r in batch if id(r) not in out]
                singles.extend(alone(records_refused))
                continue
            record, delivery = singles.pop(at)
            if delivery is None:
                raise DeliveryFailed(f"{record.topic}: the broker refused a record of "
                                     f"{len(record.value or b'')} bytes as larger than the "
                                     "topic's max.message.bytes")
            too_large.append(delivery)
        if not attempts:
            return
        self.counters["refused_sent_alone"] += len(singles)
        log.warning("shard %d: the broker refused records as too large for their topic in a "
                    "Kafka transaction; aborted and written again %d times: %d messages sent "
                    "alone, %d still refused alone (dead-lettered, reason too_large), in %.0f ms",
                    self.shard, attempts, len(singles), len(too_large),
                    (time.perf_counter() - started) * 1e3,
                    extra=fields(shard=self.shard, epoch=self.epoch, reason="too_large"))
        if too_large:
            self.core.too_large(too_large)

    def _transaction(self, batch: list[OutgoingRecord], singles: list[OutgoingRecord]
                     ) -> tuple[list[OutgoingRecord], int | None] | None:
        """One Kafka transaction: ``batch`` sent together, then each of ``singles`` alone and
        waited for. None once it is committed. If the broker refused records as too large,
        the transaction is aborted, the writer replaced, and the answer is the records of
        ``batch`` refused with None, or [] with the index of the single refused. Any other
        failure raises."""
        writer = self._transacting()
        at: int | None = None
        try:
            if batch:
                writer.send(batch)
            if singles:
                writer.wait()  # the batch's refusals are known before any single is sent
                for i, record in enumerate(singles):
                    at = i
                    writer.send([record])
                    writer.wait()
                at = None
            writer.flush()  # commits
            return None
        except DeliveryFailed:
            reported = writer.take_too_large()
            if not reported:
                raise
        # The transaction is doomed: aborted here (or, by a writer that gave up on it, by the
        # new producer's init_transactions). After an abort for a refused record librdkafka
        # failed the producer's next transaction too (RecordWriter), so a new producer with
        # the same transactional id writes the next attempt.
        writer.close(10.0)
        self._writer = None
        self._writer = RecordWriter(self._kafka_config(), transactional_id=self._tid,
                                    keep_too_large=True)
        self.counters["producers_replaced"] += 1
        if at is None:
            return refused_among(reported, [batch]), None
        refused_among(reported, [[singles[at]]])  # it alone was in flight
        return [], at

    def _read_back(self, bookmarks: list[Bookmark]) -> dict[Bookmark, JournalRecord]:
        """Journal records read again, one sequential range per partition."""
        reader = self._range_reader
        if reader is None:
            reader = self._range_reader = RangeReader(
                self._kafka_config(), group_id=f"{self.topics.prefix}coordinator-reread")
        read, moves = reader.records_read, reader.moves
        try:
            return reader.read(bookmarks)
        finally:
            # How well the re-reads stream: records read (those wanted, and those passed over
            # or read ahead) and partitions moved (each a new fetch).
            self.counters["reread_records_read"] += reader.records_read - read
            self.counters["reread_moves"] += reader.moves - moves

    def _reread(self, bookmarks: list[Bookmark]) -> dict[Bookmark, JournalRecord]:
        """Read back the records these entries need whose bytes are not in memory."""
        payloads = self.core.payloads
        missing = payloads.missing(bookmarks)
        if not missing:
            return {}
        found = self._read_back(missing)
        self.counters["payload_rereads"] += len(found)
        for bookmark, record in found.items():
            payloads.fill(bookmark, record)
        return found
