"""The narrow edges of a shard loop: what it needs of Kafka and PostgreSQL, and fakes of them.

`ShardLoop` is written against these protocols; `layer.kafka` (`JournalReader`,
`RecordWriter`, `KafkaAdmin`) and `layer.store.Store` are the real ones. The in-memory fakes
let the core and its helpers be tested without a broker: `FakeTopicAdmin` answers the one
question the core asks (may this delivery topic be used?), `FakeJournal` holds records per
partition and serves them like a reader, `FakeRecordSink` keeps what was written and can be
told to refuse.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from layer.kafka import JournalRecord, KafkaAdapterError, OutgoingRecord, TopicSpec
from layer.store.batch import WriteBatch
from layer.store.rows import EntryRow, PartitionKey
from layer.store.store import CommitResult

__all__ = [
    "FakeJournal",
    "FakeRecordSink",
    "FakeTopicAdmin",
    "JournalSource",
    "RecordSink",
    "StateStore",
    "TopicAdmin",
]


class TopicAdmin(Protocol):
    def topics(self, timeout: float = 10.0) -> dict[str, int]: ...

    def matching_topics(self, pattern: re.Pattern[str],
                        timeout: float = 10.0) -> dict[str, int]: ...

    def delete_topics(self, names: Iterable[str], timeout: float = 30.0) -> None: ...

    def ensure_topics(self, specs: Iterable[TopicSpec], timeout: float = 30.0) -> list[str]: ...

    def log_start_offsets(self, pairs: Iterable[tuple[str, int]], timeout: float = 10.0, *,
                          known_only: bool = False) -> dict[tuple[str, int], int]: ...

    def end_offsets(self, pairs: Iterable[tuple[str, int]], timeout: float = 10.0, *,
                    known_only: bool = False) -> dict[tuple[str, int], int]: ...

    def offsets_for_time(self, pairs: Iterable[tuple[str, int]], timestamp_ms: int,
                         timeout: float = 10.0) -> dict[tuple[str, int], int]: ...

    def commit_group_offsets(self, group: str, offsets: Mapping[tuple[str, int], int],
                             timeout: float = 10.0) -> None: ...


class JournalSource(Protocol):
    @property
    def assignment(self) -> list[tuple[str, int]]: ...

    def add(self, positions: Mapping[tuple[str, int], int]) -> None: ...

    def remove(self, pairs: list[tuple[str, int]]) -> None: ...

    def renew(self) -> None: ...

    def seek(self, topic: str, partition: int, offset: int) -> None: ...

    def position(self, topic: str, partition: int) -> int | None: ...

    def poll(self, max_records: int, timeout: float) -> list[JournalRecord]: ...

    def committed(self, pairs: list[tuple[str, int]],
                  timeout: float = 10.0) -> dict[tuple[str, int], int | None]: ...

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None: ...

    def lag(self) -> int | None: ...

    def close(self) -> None: ...


class RecordSink(Protocol):
    def send(self, records: Iterable[OutgoingRecord]) -> int: ...

    def flush(self, timeout: float = 30.0) -> None: ...

    def close(self, timeout: float = 10.0) -> None: ...


class StateStore(Protocol):
    """What a shard loop reads and writes in PostgreSQL (`layer.store.Store`)."""

    def take_shard(self, shard: str, owner_id: str, now: float) -> int: ...

    def shard_counters(self, shard: str) -> dict[str, int]: ...

    def release(self, shard: str, owner_id: str, epoch: int, now: float) -> bool: ...

    def commit(self, batch: WriteBatch, shard: str, owner_id: str, epoch: int,
               now: float) -> CommitResult: ...

    def load_entries(self, queue: str) -> list[EntryRow]: ...

    def load_recovery_points(self, queue: str | None = None) -> dict[PartitionKey, int]: ...

    def load_admitted(self, queue: str) -> dict[PartitionKey, int]: ...

    def load_input_positions(self, shard: str) -> dict[tuple[str, int], int]: ...

    def load_outbox(self, shard: str) -> list[tuple[int, bytes]]: ...

    def forget_published(self, shard: str, published: int) -> None: ...

    def delivery_topics_in_use(self) -> set[str]: ...


# --- fakes ------------------------------------------------------------------------------------


@dataclass
class FakeTopicAdmin:
    """Topics by name with their partition counts; ``refuse`` names topics it cannot make."""

    partitions: dict[str, int] = field(default_factory=dict)
    refuse: set[str] = field(default_factory=set)
    journal: FakeJournal | None = None
    group_offsets: dict[str, dict[tuple[str, int], int]] = field(default_factory=dict)
    #: How many times the topics were listed (each a metadata request on a real broker).
    listings: int = 0
    #: Topics still listed whose partitions answer UNKNOWN_TOPIC_OR_PART (being deleted).
    vanishing: set[str] = field(default_factory=set)

    def topics(self, timeout: float = 10.0) -> dict[str, int]:
        self.listings += 1
        return dict(self.partitions)

    def matching_topics(self, pattern: re.Pattern[str],
                        timeout: float = 10.0) -> dict[str, int]:
        return {n: p for n, p in self.topics(timeout).items() if pattern.fullmatch(n)}

    def delete_topics(self, names: Iterable[str], timeout: float = 30.0) -> None:
        for name in names:
            self.partitions.pop(name, None)
            if self.journal is not None:
                self.journal.topic_deleted(name)

    def ensure_topics(self, specs: Iterable[TopicSpec], timeout: float = 30.0) -> list[str]:
        made = []
        for spec in specs:
            if spec.name in self.refuse:
                raise KafkaAdapterError(f"cannot create topic {spec.name}: refused")
            if spec.name not in self.partitions:
                self.partitions[spec.name] = spec.partitions
                made.append(spec.name)
        return made

    def log_start_offsets(self, pairs: Iterable[tuple[str, int]], timeout: float = 10.0, *,
                          known_only: bool = False) -> dict[tuple[str, int], int]:
        return {tp: 0 for tp in self._asked(pairs, known_only)}

    def end_offsets(self, pairs: Iterable[tuple[str, int]], timeout: float = 10.0, *,
                    known_only: bool = False) -> dict[tuple[str, int], int]:
        journal = self.journal
        return {tp: len(journal.records.get(tp, [])) if journal else 0
                for tp in self._asked(pairs, known_only)}

    def _asked(self, pairs: Iterable[tuple[str, int]], known_only: bool) -> list[tuple[str, int]]:
        """The partitions answered; one of a vanishing topic fails the question (as a real
        broker's UNKNOWN_TOPIC_OR_PART does) unless ``known_only`` leaves it out."""
        pairs = list(pairs)
        unknown = [tp for tp in pairs if tp[0] in self.vanishing]
        if unknown and not known_only:
            raise KafkaAdapterError(f"cannot list offsets of {unknown}: unknown topic or "
                                    "partition", code="UNKNOWN_TOPIC_OR_PART", retriable=True)
        return [tp for tp in pairs if tp[0] not in self.vanishing]


    def offsets_for_time(self, pairs: Iterable[tuple[str, int]], timestamp_ms: int,
                         timeout: float = 10.0) -> dict[tuple[str, int], int]:
        return {tp: 0 for tp in pairs}

    def commit_group_offsets(self, group: str, offsets: Mapping[tuple[str, int], int],
                             timeout: float = 10.0) -> None:
        self.group_offsets.setdefault(group, {}).update(offsets)


@dataclass
class FakeJournal:
    """Records per partition, read from assigned positions like `JournalReader`."""

    records: dict[tuple[str, int], list[JournalRecord]] = field(default_factory=dict)
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    commits: dict[tuple[str, int], int] = field(default_factory=dict)
    #: Every partition this consumer was given, and those of them it reads nothing from any
    #: more: their topic was deleted (`topic_deleted`), and librdkafka keeps the old topic's
    #: leader epoch for them, above a topic made again's (`JournalReader.renew`).
    known: set[tuple[str, int]] = field(default_factory=set)
    stale: set[tuple[str, int]] = field(default_factory=set)
    #: How many times the consumer was replaced by a new one (`renew`).
    renewals: int = 0

    def append(self, topic: str, partition: int, value: bytes | None, key: bytes | None = None,
               timestamp_ms: int = 0,
               headers: list[tuple[str, bytes | None]] | None = None) -> JournalRecord:
        log = self.records.setdefault((topic, partition), [])
        record = JournalRecord(topic, partition, len(log), key, value, timestamp_ms, headers)
        log.append(record)
        return record

    @property
    def assignment(self) -> list[tuple[str, int]]:
        return list(self.positions)

    def topic_deleted(self, topic: str) -> None:
        """The topic and its records are gone (`FakeTopicAdmin.delete_topics`)."""
        for tp in [tp for tp in self.records if tp[0] == topic]:
            del self.records[tp]
        self.stale.update(tp for tp in self.known if tp[0] == topic)

    def add(self, positions: Mapping[tuple[str, int], int]) -> None:
        for tp, offset in positions.items():
            self.positions.setdefault(tp, max(offset, 0))
            self.known.add(tp)

    def remove(self, pairs: list[tuple[str, int]]) -> None:
        for tp in pairs:
            self.positions.pop(tp, None)

    def renew(self) -> None:
        self.known = set(self.positions)
        self.stale.clear()
        self.renewals += 1

    def seek(self, topic: str, partition: int, offset: int) -> None:
        self.positions[(topic, partition)] = offset

    def position(self, topic: str, partition: int) -> int | None:
        return self.positions.get((topic, partition))

    def poll(self, max_records: int, timeout: float) -> list[JournalRecord]:
        out: list[JournalRecord] = []
        for tp, position in self.positions.items():
            if tp in self.stale:
                continue  # silently: no error comes (`JournalReader.renew`)
            found = self.records.get(tp, [])[position:position + max_records - len(out)]
            out.extend(found)
            self.positions[tp] = position + len(found)
        return out

    def committed(self, pairs: list[tuple[str, int]],
                  timeout: float = 10.0) -> dict[tuple[str, int], int | None]:
        return {tp: self.commits.get(tp) for tp in pairs}

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        self.commits.update(offsets)

    def lag(self) -> int | None:
        return sum(max(len(self.records.get(tp, [])) - p, 0) for tp, p in self.positions.items())

    def close(self) -> None:
        self.positions.clear()


@dataclass
class FakeRecordSink:
    """Keeps what was flushed; ``fail_next`` makes the next flush raise (nothing written)."""

    written: list[OutgoingRecord] = field(default_factory=list)
    fail_next: bool = False
    _pending: list[OutgoingRecord] = field(default_factory=list)

    def send(self, records: Iterable[OutgoingRecord]) -> int:
        records = list(records)
        self._pending.extend(records)
        return len(records)

    def flush(self, timeout: float = 30.0) -> None:
        pending, self._pending = self._pending, []
        if self.fail_next:
            self.fail_next = False
            raise KafkaAdapterError("the fake sink refused the write")
        self.written.extend(pending)

    def close(self, timeout: float = 10.0) -> None:
        self._pending.clear()
