"""Loading a queue into a shard: its stored state, its journal partitions and where each is
read from (`QueueLoader`), shared by a shard's start, catalog refreshes, resets and a journal
deleted while read. Split from `maintenance` (which keeps what runs periodically)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

from layer.coordinator.core import QueueState, ShardCore
from layer.coordinator.logformat import fields
from layer.coordinator.ports import JournalSource, StateStore, TopicAdmin
from layer.domain.definitions import QueueDefinition
from layer.domain.errors import QueueConfigError
from layer.domain.shards import part_of
from layer.kafka import TopicSpec
from layer.protocol import TopicNames
from layer.store.rows import ConsumerRow, EntryRow, PartitionKey, QueueRecord

log = logging.getLogger(__name__)

__all__ = ["QueueLoader", "dead_letter_topic", "read_from"]



def read_from(reader: JournalSource, starts: dict[tuple[str, int], int]) -> None:
    """Make the reader cover these partitions from at least these offsets."""
    assigned = set(reader.assignment)
    reader.add({tp: o for tp, o in starts.items() if tp not in assigned})
    for tp, offset in starts.items():
        if tp in assigned and _ahead(reader.position(*tp), offset):
            # Another queue reads this partition further on: go back; queues skip what they
            # have seen (the engine ignores offsets below its position). Never forward: a
            # queue added after another over the same journal (an at-most-once queue whose
            # recovery point is past an at-least-once queue's restored leases, found by the
            # soak) would skip the other's replay, and its restored leases would never come
            # back.
            reader.seek(tp[0], tp[1], offset)


#: Kafka's logical offset "the end" (librdkafka's OFFSET_END).
_OFFSET_END = -1


def _ahead(position: int | None, offset: int) -> bool:
    """True when a partition read from ``position`` would miss ``offset``."""
    if position is None or position == _OFFSET_END:
        return True
    if position < 0:  # OFFSET_BEGINNING or another logical start: reads everything there
        return False
    return offset < position


class QueueLoader:
    """Loads a queue's state for `ShardCore.add_queue` and starts reading its journals."""

    def __init__(self, core: ShardCore, store: StateStore, admin: TopicAdmin,
                 reader: JournalSource) -> None:
        self.core = core
        self.store = store
        self.admin = admin
        self.reader = reader
        # The version of each queue whose stored definition was found invalid: it is logged
        # and counted once per version, not at every catalog refresh (every few seconds).
        self.invalid: dict[str, int] = {}
        #: Journals the reader stopped reading because they were deleted (`stop_reading`): a
        #: partition of one read again, the journal made again, takes a new Kafka consumer
        #: (`read_from`).
        self.deleted: set[str] = set()
        #: Inside `together`: the topic listing every queue added uses, and the dead-letter
        #: topics to make at its end.
        self._listed: dict[str, int] | None = None
        self._dead_letters: list[TopicSpec] | None = None

    @contextmanager
    def together(self) -> Iterator[None]:
        """Queues added together (a shard's start, a catalog load that brings several): one
        topic listing for them all, and their dead-letter topics made in one request at the
        end, instead of two metadata requests per queue (a thousand queues took a shard
        40 s to start, the process's other shards waiting; issue 33)."""
        self._listed = self.admin.topics()
        self._dead_letters = []
        try:
            yield
            missing = [spec for spec in self._dead_letters if spec.name not in self._listed]
            if missing:
                self.admin.ensure_topics(missing)
        finally:
            self._listed = None
            self._dead_letters = None

    def stop_reading(self, pairs: list[tuple[str, int]]) -> None:
        """The reader no longer reads these partitions: their journal was deleted."""
        if not pairs:
            return
        self.reader.remove(pairs)
        self.deleted.update(topic for topic, _ in pairs)

    def read_from(self, starts: dict[tuple[str, int], int]) -> None:
        """Make the reader cover these partitions from at least these offsets; a deleted
        journal read again (made again) is read by a new Kafka consumer.

        librdkafka (2.16) keeps the leader epoch it last saw for a partition across its
        topic's deletion, and across an unassign and assign of it. A topic made again starts
        at epoch 0, below any epoch a broker restart or a leader change gave the old one: the
        client takes the new topic's metadata for stale and every fetch is answered
        UNKNOWN_LEADER_EPOCH, retried within the client for ever, without an error to us. The
        fault soak saw a shard read nothing of a journal made again until the shard changed
        owner (which gives it a new consumer); confluent-kafka-python #1787 and
        confluent-kafka-javascript #274 report the same silence. A new consumer knows no old
        epoch: `JournalReader.renew` goes on from every assigned partition's position."""
        back = {topic for topic, _ in starts} & self.deleted
        if back:
            self.deleted -= back
            self.reader.renew()
            self.core.counters["journal_readers_renewed"] += 1
            log.info("journal %s is read again (made again after it was deleted): the shard "
                     "reads on with a new Kafka consumer", ", ".join(sorted(back)),
                     extra=fields(shard=self.core.shard, reason="journal_made_again"))
        read_from(self.reader, starts)

    def add(self, record: QueueRecord, rows: Iterable[ConsumerRow], now: float,
            moved: Mapping[tuple[str, int], tuple[int, int]] | None = None,
            forget: frozenset[tuple[str, int]] = frozenset()) -> bool:
        """Serve the queue; False (counted, logged) when its stored definition is invalid.

        ``moved`` (a reset): partition -> (its position before, the new one). The queue starts
        there; what is stored below a new position is left out, and a partition moved back
        starts over (nothing stored of it is used, every entry is admitted anew)."""
        core = self.core
        try:
            definition = QueueDefinition.from_mapping(record.definition)
        except QueueConfigError as exc:
            if self.invalid.get(record.name) != record.version:
                self.invalid[record.name] = record.version
                core.counters["invalid_queue_definitions"] += 1
                log.error("queue %s (version %d) has an invalid stored definition and is not "
                          "served until it is fixed (`qlayer queue describe %s` says why; "
                          "`qlayer queue apply` a valid one): %s", record.name, record.version,
                          record.name, exc)
            return False
        self.invalid.pop(record.name, None)
        topics = core.topics
        if not definition.is_regex_topic and topics.is_internal(definition.underlying_topic):
            # Internal topics (deliveries, acks, ...) are never journals; say so rather than
            # leave the queue silently empty.
            core.counters["queues_on_internal_topics"] += 1
            log.error("queue %s: underlying topic %s is under the internal topic prefix %r "
                      "and will never be read; rename the journal", record.name,
                      definition.underlying_topic, topics.prefix)
        name = definition.name
        stored = self.store.load_recovery_points(name)
        entries = self.store.load_entries(name)
        admitted = self.store.load_admitted(name)
        served = self.parts_served(definition)
        if served is not None:
            # A part of the queue: the other parts' state is their shards' (the store keeps
            # one queue; its partitions are split between the parts).
            parts = definition.parts
            stored = {k: v for k, v in stored.items() if part_of(k.partition, parts) in served}
            entries = [r for r in entries if part_of(r.partition, parts) in served]
            admitted = {k: v for k, v in admitted.items()
                        if part_of(k.partition, parts) in served}
        if forget:
            # Partitions of a deleted journal: what is stored of them is being forgotten by
            # the batch not committed yet (`journal_deleted`).
            stored = {k: v for k, v in stored.items() if (k.topic, k.partition) not in forget}
            entries = [r for r in entries if (r.topic, r.partition) not in forget]
            admitted = {k: v for k, v in admitted.items()
                        if (k.topic, k.partition) not in forget}
        partitions = self.journal_partitions(definition, self._listed)
        starts = self.start_positions(definition, partitions, stored)
        reads = dict(starts)
        if moved:
            entries, admitted = _moved_state(name, entries, admitted, moved)
            for tp, (before, after) in moved.items():
                starts[tp] = after
                # Reading goes back, never forward: other queues over the journal may need the
                # records in between (and this one ignores those below its position).
                reads[tp] = min(before, after)
        # Each partition's end: stored state past it (or of a partition not listed) is of a
        # journal deleted, and perhaps made again, while no coordinator served the queue.
        state = QueueState(definition, record.version, entries, starts, stored, admitted,
                           self.admin.log_start_offsets(list(starts)),
                           self.admin.end_offsets(partitions), served)
        starts = core.add_queue(state, rows, now)
        dead_letters = TopicSpec(dead_letter_topic(topics, definition), 1)
        if self._dead_letters is not None:
            self._dead_letters.append(dead_letters)
        else:
            self.admin.ensure_topics([dead_letters])
        self.read_from({tp: min(offset, reads.get(tp, offset)) for tp, offset in starts.items()})
        return True

    def journal_partitions(self, definition: QueueDefinition,
                           listed: dict[str, int] | None = None) -> list[tuple[str, int]]:
        if listed is None:
            listed = self.admin.topics()
        topics = self.core.topics
        # Looked up by name, not tried on every listed topic: a thousand queues over a
        # thousand topics were a million `matches_topic` calls at each shard start and
        # partition check (`QueueDefinition.journal_topics`).
        served = self.parts_served(definition)
        return [(topic, p) for topic in definition.journal_topics(listed)
                if not topics.is_internal(topic) for p in range(listed[topic])
                if served is None or part_of(p, definition.parts) in served]

    def parts_served(self, definition: QueueDefinition) -> frozenset[int] | None:
        """The parts of a queue of several parts this shard serves (None: a queue of one
        part, served whole)."""
        if definition.parts == 1:
            return None
        catalog = self.core.catalog()
        record = catalog.queues.get(definition.name)
        if record is None:
            return frozenset()
        served = catalog.parts_on(record, self.core.shard)
        return frozenset() if served is None else served

    def start_positions(self, definition: QueueDefinition, partitions: list[tuple[str, int]],
                        stored: dict[PartitionKey, int]) -> dict[tuple[str, int], int]:
        """Where each partition's replay starts: the recovery point, else the queue's
        `recovery_point` setting (beginning, end or a timestamp)."""
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
                starts.update(self.admin.end_offsets(fresh))
            elif setting == "beginning":
                starts.update(self.admin.log_start_offsets(fresh))
            else:
                moment = definition.recovery_timestamp
                assert moment is not None
                starts.update(self.admin.offsets_for_time(fresh, int(moment.timestamp() * 1000)))
        return starts


def _moved_state(name: str, entries: list[EntryRow], admitted: dict[PartitionKey, int],
                 moved: Mapping[tuple[str, int], tuple[int, int]]
                 ) -> tuple[list[EntryRow], dict[PartitionKey, int]]:
    """The stored state a reset keeps: rows at or past a position moved forward (acked stay
    acked, leases stay); nothing of a partition moved back, which is admitted anew from its
    new position (each entry announced again)."""
    kept = []
    for row in entries:
        move = moved.get((row.topic, row.partition))
        if move is None or (move[1] >= move[0] and row.offset >= move[1]):
            kept.append(row)
    admitted = dict(admitted)
    for (topic, partition), (before, after) in moved.items():
        key = PartitionKey(name, topic, partition)
        if after < before:
            admitted[key] = after
        else:
            admitted[key] = max(admitted.get(key, after), after)
    return kept, admitted


def dead_letter_topic(topics: TopicNames, definition: QueueDefinition) -> str:
    return definition.dead_letter_topic or topics.dead_letter(definition.name)
