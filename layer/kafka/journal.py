"""Reading journals (and the ack / control topics): one consumer, positions given by the caller.

The coordinator takes journal positions from PostgreSQL (recovery points), never from Kafka
group offsets, so this reader uses manual assignment and never commits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from layer.kafka.errors import translated
from layer.kafka.logs import logged
from layer.kafka.records import JournalRecord

log = logging.getLogger(__name__)

#: Position sentinels a caller may pass instead of an offset.
BEGINNING = OFFSET_BEGINNING
END = OFFSET_END


class JournalReader:
    """Batched reads from explicitly assigned partitions, starting at given offsets."""

    def __init__(self, config: Mapping[str, Any], group_id: str, *,
                 prefetch_kbytes: int = 32768, prefetch_records: int = 20000) -> None:
        with translated("cannot create a Kafka consumer"):
            self._consumer = self._new_consumer(config, group_id, prefetch_kbytes,
                                                prefetch_records)
        # Kept for `renew`.
        self._settings = (dict(config), group_id, prefetch_kbytes, prefetch_records)
        self._assigned: dict[tuple[str, int], int] = {}
        # Per partition, the offset its next record will have (`position`).
        self._next: dict[tuple[str, int], int] = {}
        self._topic_names: dict[str, str] = {}
        # A record `wait` took, handed out first by the next `poll`.
        self._held: Message | None = None
        self.errors = 0
        #: Partitions whose position is outside their log (below its start: retention took
        #: unread records; past its end: the topic was deleted and made again), found by
        #: `poll`, which reads the other partitions on. The owner decides and clears it.
        self.out_of_range: set[tuple[str, int]] = set()
        # The code of the last read error logged: an error repeated (a broker away) is logged
        # once, and again only after a record was read or another error came.
        self._last_error: int | None = None

    @staticmethod
    def _new_consumer(config: Mapping[str, Any], group_id: str, prefetch_kbytes: int,
                      prefetch_records: int) -> Consumer:
        # group.id is required by librdkafka even without subscribe(); nothing is committed.
        return Consumer(logged({
            **config,
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # An assigned offset below the log start means retention deleted records qlayer
            # had not finished with: never skip them silently (see poll()).
            "auto.offset.reset": "error",
            "enable.partition.eof": False,
            # The broker answers a fetch as soon as one of its partitions has a record, so
            # this only bounds how long a fetch with nothing to read is held. Each shard has
            # its own reader, most of them idle: at 50 ms, 16 shards' empty fetches cost the
            # broker 9 % of a core with the coordinator idle (3.6 % at 500, librdkafka's
            # default), and 25 % of its CPU in throughput cells; latency cells unchanged
            # (docs/coordinator.md, "Kafka requests of idle shards").
            "fetch.wait.max.ms": 500,
            # The coordinator reads its acks and control records with the same consumer as
            # the journals, behind what is already fetched: a 256 MiB prefetch put acks and
            # heartbeats 100,000s of journal records back during a replay after a restart.
            # 32 MiB still keeps tens of thousands of records ready for the next poll.
            "queued.max.messages.kbytes": prefetch_kbytes,
            "queued.min.messages": prefetch_records,
            # A partition whose prefetched records reach those bounds is not fetched again for
            # this long; librdkafka's 1 s default stalled a reader draining a backlog (the
            # re-reads past the payload budget waited ~1 s per call; docs/coordinator.md,
            # "Records past the payload budget"). The wait is a local timer, not a request.
            "fetch.queue.backoff.ms": 20,
        }))

    def assign(self, positions: Mapping[tuple[str, int], int]) -> None:
        """Read these partitions from these offsets (replacing any earlier assignment)."""
        self._assigned = dict(positions)
        self._next = dict(positions)
        with translated("assigning journal partitions failed"):
            self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in positions.items()])

    def add(self, positions: Mapping[tuple[str, int], int]) -> None:
        """Start reading more partitions without disturbing those already assigned."""
        new = {tp: o for tp, o in positions.items() if tp not in self._assigned}
        if not new:
            return
        self._assigned.update(new)
        self._next.update(new)
        with translated("assigning journal partitions failed"):
            self._consumer.incremental_assign(
                [TopicPartition(t, p, o) for (t, p), o in new.items()])

    def remove(self, pairs: list[tuple[str, int]]) -> None:
        """Stop reading these partitions (a deleted journal's, or a re-read range's).

        librdkafka keeps what it knew of them (their leader epoch): a deleted journal's, read
        again once it is made again, needs a new consumer (`renew`)."""
        gone = [tp for tp in pairs if tp in self._assigned]
        if not gone:
            return
        for tp in gone:
            del self._assigned[tp]
            self._next.pop(tp, None)
            self.out_of_range.discard(tp)
        with translated("unassigning journal partitions failed"):
            self._consumer.incremental_unassign([TopicPartition(t, p) for t, p in gone])

    def renew(self) -> None:
        """Go on with a new Kafka consumer, reading every assigned partition from where this
        one got to (`position`): nothing is lost (records fetched and not handed out yet are
        fetched again) and nothing handed out comes again.

        After a journal is deleted and made again, the client keeps the leader epoch it last
        saw for each partition of the old topic, also across an unassign and assign of the
        same partition (librdkafka 2.16; the Java client fixed the same in KAFKA-12257). The
        new topic starts at epoch 0, below the old one's after any broker restart or leader
        change: its metadata is ignored as stale ("ignoring outdated metadata update") and
        every fetch is answered UNKNOWN_LEADER_EPOCH, retried within the client for ever
        without an error to the application. The fault soak saw a shard never read a journal
        made again until the shard changed owner, which gives it a new consumer. Renewing is
        what a takeover does, without the takeover (confluent-kafka-python #1787,
        confluent-kafka-javascript #274 report the same silence)."""
        config, group_id, prefetch_kbytes, prefetch_records = self._settings
        positions = {tp: self._next.get(tp, offset) for tp, offset in self._assigned.items()}
        with translated("cannot create a Kafka consumer"):
            fresh = self._new_consumer(config, group_id, prefetch_kbytes, prefetch_records)
        with translated("assigning journal partitions failed"):
            fresh.assign([TopicPartition(t, p, o) for (t, p), o in positions.items()])
        old, self._consumer = self._consumer, fresh
        # A record `wait` took from the old consumer is at `position`: fetched again.
        self._held = None
        self._assigned = dict(positions)
        try:
            old.close()
        except KafkaException as exc:  # nothing of it is used any more
            log.debug("closing the replaced journal consumer: %s", exc)

    def seek(self, topic: str, partition: int, offset: int) -> None:
        held = self._held
        if held is not None and held.topic() == topic and held.partition() == partition:
            self._held = None  # read again from the new offset, in order
        with translated(f"seeking {topic}[{partition}] to {offset} failed"):
            self._consumer.seek(TopicPartition(topic, partition, offset))
        self._next[(topic, partition)] = offset

    def position(self, topic: str, partition: int) -> int | None:
        """The offset the next record of this partition will have (None when it is not
        read; a negative logical offset, such as OFFSET_BEGINNING, until a record came)."""
        return self._next.get((topic, partition))

    def read_to(self, topic: str, partition: int) -> int | None:
        """How far the partition is read: every record below this offset was returned by a
        poll. Past the last record's offset, this counts what `read_committed` skips (a
        transaction's markers and aborted records), which no poll returns. None when it is
        not read, or nothing was fetched yet."""
        tp = TopicPartition(topic, partition)
        with translated("reading a position failed"):
            (found,) = self._consumer.position([tp])
            known = [o for o in (found.offset, self._next.get((topic, partition), -1)) if o >= 0]
            if known:
                return max(known)
            # Assigned at a logical offset (the beginning) and nothing returned since: read
            # to its end only if the last fetch found nothing below the last stable offset.
            low, high = self._consumer.get_watermark_offsets(tp, cached=True)
        return high if 0 <= low == high else None

    @property
    def assignment(self) -> list[tuple[str, int]]:
        return list(self._assigned)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for input without taking it: True as soon as a record is
        there (the next `poll` returns it first). Lets an idle process sleep on the input of
        a busy shard and wake the moment it comes, rather than after a fixed nap."""
        if self._held is not None:
            return True
        with translated("reading journals failed"):
            self._held = self._consumer.poll(timeout)
        return self._held is not None

    def poll(self, max_records: int, timeout: float) -> list[JournalRecord]:
        """Up to max_records records: those already fetched, waiting up to ``timeout`` only
        when there are none. An empty list when none came within timeout."""
        with translated("reading journals failed"):
            # consume(n, timeout) returns early only when n records are there, so every loop
            # iteration would wait the whole timeout: wait for one record, then take what
            # else is there without waiting.
            first, self._held = self._held, None
            if first is None:
                first = self._consumer.poll(timeout)
            if first is None:
                return []
            messages = [first]
            if max_records > 1:
                messages.extend(self._consumer.consume(max_records - 1, 0))
        out: list[JournalRecord] = []
        append = out.append
        # The client returns a new str for each record's topic; one per topic is kept instead
        # (every queued entry holds its record's topic name: 60 bytes each, otherwise).
        names = self._topic_names
        for m in messages:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._AUTO_OFFSET_RESET:
                    # Not raised: one partition must not stop the shard's other inputs (a
                    # journal deleted and made again looped every rebuild on it, issue 15).
                    self.out_of_range.add((str(m.topic()), int(m.partition() or 0)))
                    continue
                if err.code() != KafkaError._PARTITION_EOF:
                    self.errors += 1
                    if err.code() != self._last_error:
                        self._last_error = err.code()
                        log.warning("journal read error on %s[%s]: %s (logged again when "
                                    "another comes after a record)", m.topic(), m.partition(),
                                    err)
                continue
            self._last_error = None
            # Records without an error always carry topic, partition and offset, and
            # confluent-kafka returns headers as a list of (str, bytes); a cast per record
            # would cost time in the hot path, so the checker is told instead.
            topic = m.topic()
            topic = names.setdefault(topic, topic)  # type: ignore[arg-type]
            append(JournalRecord(topic, m.partition(), m.offset(),  # type: ignore[arg-type]
                                 m.key(), m.value(), m.timestamp()[1],
                                 m.headers()))  # type: ignore[arg-type]
        # Where each partition goes on (`position`): its last record's offset + 1 (records
        # come in offset order per partition, so the last write wins).
        nxt = self._next
        for r in out:
            nxt[(r.topic, r.partition)] = r.offset + 1
        return out

    def committed(self, pairs: list[tuple[str, int]],
                  timeout: float = 10.0) -> dict[tuple[str, int], int | None]:
        """The group's committed offsets for these partitions (None where nothing was)."""
        if not pairs:
            return {}
        with translated("reading committed offsets failed"):
            found = self._consumer.committed([TopicPartition(t, p) for t, p in pairs], timeout)
        return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None)
                for tp in found}

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Commit next-offsets to read (asynchronously; a lost commit means a harmless re-read)."""
        if not offsets:
            return
        with translated("committing offsets failed"):
            self._consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                asynchronous=True)

    def lag(self) -> int | None:
        """Records in the assigned partitions not read yet, from the high watermarks of the
        last fetches (no broker round trip); None before anything was fetched."""
        with translated("reading the lag failed"):
            positions = self._consumer.position(
                [TopicPartition(t, p) for t, p in self._assigned])
            total, known = 0, False
            for tp in positions:
                _low, high = self._consumer.get_watermark_offsets(tp, cached=True)
                if high < 0 or tp.offset < 0:
                    continue
                known = True
                total += max(high - tp.offset, 0)
        return total if known else None

    def high_watermarks(self) -> dict[tuple[str, int], int]:
        """The end offset of each assigned partition as the last fetches saw it (no broker
        round trip); partitions not fetched from yet are left out."""
        found: dict[tuple[str, int], int] = {}
        with translated("reading the high watermarks failed"):
            for topic, partition in self._assigned:
                _low, high = self._consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), cached=True)
                if high >= 0:
                    found[(topic, partition)] = high
        return found

    def close(self) -> None:
        with translated("closing a journal reader failed"):
            self._consumer.close()
