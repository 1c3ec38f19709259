"""The queue directory: queue definitions on a compacted Kafka topic, for clients without Postgres.

Publishers route a publish to a queue's name to its ``default_publish_target`` (AMPS: a
publish to ``ORDERS_ANALYTICS`` goes to ``ORDERS_ANALYTICS_DIRECT``), so they need the queue
definitions. Postgres is their source of truth, but SDK clients know only Kafka: the
coordinator (and ``qlayer queue ...``) mirror every definition onto ``P`` + ``queues``:

- key: the queue name, UTF-8;
- value (format 2): ``{"format": 2, "shard": n, "shard_count": N, "definition": {...}}``, the
  definition being ``QueueDefinition.model_dump(mode="json")`` and ``shard`` the shard that
  serves the queue; format 1, the bare definition object, is still read (shard unknown);
- a tombstone (null value): the queue was deleted.

The topic is compacted, so it holds the latest definition of every queue however long it
has existed. :class:`QueueDirectory` reads it; :class:`QueueDirectoryWriter` (and the
``publish_queue_definitions`` / ``delete_queue_definition`` / ``sync_queue_definitions``
helpers) write it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Self

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from layer.domain.definitions import QueueDefinition
from layer.domain.definitions import publish_target as route
from layer.domain.errors import QueueConfigError
from layer.domain.shards import part_shards
from layer.kafka.directory import DIRECTORY_TOPIC_CONFIG
from layer.kafka.errors import KafkaAdapterError
from layer.kafka.logs import logged
from layer.kafka.offsets import end_offset
from layer.protocol.directory import decode_directory_record, encode_directory_record
from layer.sdk.config import ClientConfig
from layer.sdk.errors import NoPublishTargetError
from layer.sdk.transport import SdkProducer, ensure_topic

__all__ = [
    "DIRECTORY_TOPIC_CONFIG",
    "QueueDirectory",
    "QueueDirectoryWriter",
    "decode_definition",
    "decode_placed_definition",
    "delete_queue_definition",
    "encode_definition",
    "publish_queue_definitions",
    "sync_queue_definitions",
]

log = logging.getLogger(__name__)



def encode_definition(definition: QueueDefinition, shard: int | None = None,
                      shard_count: int | None = None) -> tuple[bytes, bytes]:
    """The directory record (key, value) of one queue definition: format 2 with its shard,
    format 1 (the bare definition) when the shard is not known."""
    key, value = encode_directory_record(definition.name, definition.model_dump(mode="json"),
                                         shard, shard_count)
    assert value is not None
    return key, value


def decode_placed_definition(key: bytes | None, value: bytes | None
                             ) -> tuple[str, QueueDefinition | None, int | None]:
    """``(queue name, definition, shard)`` of a directory record (see `decode_definition`);
    the shard is None in a format-1 record or a tombstone."""
    name, definition, shard, _ = decode_placement(key, value)
    return name, definition, shard


def decode_placement(key: bytes | None, value: bytes | None
                     ) -> tuple[str, QueueDefinition | None, int | None, int | None]:
    """``(queue name, definition, shard, shard count)`` of a directory record (see
    `decode_placed_definition`)."""
    record = decode_directory_record(key, value)
    if record.definition is None:
        return record.name, None, None, None
    definition = QueueDefinition.from_mapping(record.definition)
    if definition.name != record.name:
        raise ValueError(
            f"directory record keyed {record.name!r} defines queue {definition.name!r}"
        )
    return record.name, definition, record.shard, record.shard_count


def decode_definition(key: bytes | None, value: bytes | None) -> tuple[str, QueueDefinition | None]:
    """``(queue name, definition)`` of a directory record; the definition is None for a
    tombstone. Raises ``ValueError`` (``QueueConfigError`` for a definition this version
    cannot accept) when the record is not a valid directory record."""
    name, definition, _ = decode_placed_definition(key, value)
    return name, definition


class QueueDirectory:
    """Queue definitions read from the directory topic; refreshed as needed. Thread-safe.

    The topic is read to its end on first use, again every ``refresh_interval`` seconds, and
    when a name is not found (at most once per ``miss_refresh_interval`` seconds, so that
    publishing to plain topics does not cost a round trip each). A missing directory topic
    (no coordinator has run yet) is an empty directory.
    """

    def __init__(
        self,
        bootstrap_servers: str | None = None,
        *,
        topic_prefix: str | None = None,
        kafka_config: Mapping[str, Any] | None = None,
        refresh_interval: float = 30.0,
        miss_refresh_interval: float = 1.0,
        timeout: float = 10.0,
        config: ClientConfig | None = None,
    ) -> None:
        self._config = config or ClientConfig.resolve(bootstrap_servers, topic_prefix,
                                                      kafka_config)
        self.topic = self._config.topics.queues
        self._refresh_interval = refresh_interval
        self._miss_refresh_interval = miss_refresh_interval
        self._timeout = timeout
        self._lock = threading.Lock()
        self._definitions: dict[str, QueueDefinition] = {}
        self._shards: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self._positions: dict[int, int] = {}
        self._loaded_at: float | None = None
        self._consumer: Any = None
        self.malformed = 0

    # --- reading ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Read the directory topic up to its current end."""
        with self._lock:
            self._read_to_end()

    def get(self, name: str) -> QueueDefinition | None:
        """The definition of queue ``name``, or None when there is no such queue."""
        with self._lock:
            self._ensure_fresh(miss=False)
            found = self._definitions.get(name)
            if found is None and self._ensure_fresh(miss=True):
                found = self._definitions.get(name)
            return found

    def shard_of(self, name: str) -> int | None:
        """The shard serving queue ``name`` (None: no such queue, or a format-1 record)."""
        with self._lock:
            self._ensure_fresh(miss=False)
            if name not in self._definitions:
                self._ensure_fresh(miss=True)
            return self._shards.get(name)

    def part_shards(self, name: str) -> tuple[int, ...]:
        """The shard serving each part of queue ``name`` (docs/coordinator.md, "Partitioned
        queues"): one for a queue of one part, none when the queue or its shard is not
        known."""
        with self._lock:
            self._ensure_fresh(miss=False)
            if name not in self._definitions:
                self._ensure_fresh(miss=True)
            definition, shard = self._definitions.get(name), self._shards.get(name)
            if definition is None or shard is None:
                return ()
            count = self._counts.get(name)
            if definition.parts == 1 or count is None:
                return (shard,)
            return part_shards(shard, definition.parts, count)

    def placements(self) -> dict[str, int | None]:
        """Every known queue and the shard serving it (None: a format-1 record)."""
        with self._lock:
            self._ensure_fresh(miss=False)
            return {name: self._shards.get(name) for name in sorted(self._definitions)}

    def definitions(self) -> list[QueueDefinition]:
        """Every known queue definition, by name."""
        with self._lock:
            self._ensure_fresh(miss=False)
            return [self._definitions[name] for name in sorted(self._definitions)]

    def publish_target(self, name: str) -> str:
        """The topic a publish to ``name`` goes to (``layer.domain.definitions.publish_target``):
        a queue's ``default_publish_target``, or its one journal; any other name as it is.

        Raises ``NoPublishTargetError`` for a queue over a regex without a default target.
        """
        definition = self.get(name)
        if definition is None:
            return name
        try:
            return route([definition], name)
        except QueueConfigError as exc:
            raise NoPublishTargetError(name, exc.problems[0][1]) from None

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- internals (lock held) --------------------------------------------------------------

    def _ensure_fresh(self, *, miss: bool) -> bool:
        """Refresh when stale (or, for a miss, when the last read is old enough); True when
        the topic was read."""
        now = time.monotonic()
        if self._loaded_at is not None:
            age = now - self._loaded_at
            limit = self._miss_refresh_interval if miss else self._refresh_interval
            if age < limit:
                return False
        self._read_to_end()
        return True

    def _reader(self) -> Any:
        if self._consumer is None:
            self._consumer = Consumer(logged(self._config.client(**{
                "group.id": self._config.topics.prefix + "sdk.directory",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "enable.partition.eof": True,
                "allow.auto.create.topics": False,
                "fetch.wait.max.ms": 50,
            })))
        return self._consumer

    def _read_to_end(self) -> None:
        consumer = self._reader()
        deadline = time.monotonic() + self._timeout
        try:
            metadata = consumer.list_topics(topic=self.topic, timeout=self._timeout)
            topic = metadata.topics.get(self.topic)
            if topic is None or topic.error is not None:
                # No directory yet: every name is a plain topic until a coordinator writes one.
                self._loaded_at = time.monotonic()
                return
            new = [p for p in topic.partitions if p not in self._positions]
            if new:
                for partition in new:
                    self._positions[partition] = 0
                consumer.incremental_assign(
                    [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in new])
            ends = {
                p: end_offset(consumer, self.topic, p, max(0.5, deadline - time.monotonic()),
                              what=f"queue directory {self.topic}")
                for p in self._positions
            }
            pending = {p for p, end in ends.items() if self._positions[p] < end}
            while pending:
                if time.monotonic() >= deadline:
                    raise KafkaAdapterError(
                        f"could not read queue directory topic {self.topic} to its end within "
                        f"{self._timeout:g}s"
                    )
                for message in consumer.consume(500, 0.1):
                    partition = message.partition()
                    error = message.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            # The end as the broker sees it (also past compacted gaps).
                            self._positions[partition] = max(self._positions[partition],
                                                             message.offset())
                            pending.discard(partition)
                        else:
                            log.warning("queue directory %s: %s", self.topic, error)
                        continue
                    self._apply(message.key(), message.value())
                    self._positions[partition] = message.offset() + 1
                    if self._positions[partition] >= ends[partition]:
                        pending.discard(partition)
        except KafkaException as exc:
            raise KafkaAdapterError(f"cannot read queue directory {self.topic}: {exc}") from exc
        self._loaded_at = time.monotonic()

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        try:
            name, definition, shard, count = decode_placement(key, value)
        except ValueError as exc:  # QueueConfigError is a ValueError too
            self.malformed += 1
            log.warning("ignoring queue directory record on %s: %s", self.topic, exc)
            if key:
                # Better unknown than stale: a queue whose latest definition cannot be read
                # routes as a plain topic.
                self._definitions.pop(key.decode(errors="replace"), None)
                self._shards.pop(key.decode(errors="replace"), None)
            return
        if definition is None:
            self._definitions.pop(name, None)
            self._shards.pop(name, None)
        else:
            self._definitions[name] = definition
            if shard is None:
                self._shards.pop(name, None)
            else:
                self._shards[name] = shard
            if count is None:
                self._counts.pop(name, None)
            else:
                self._counts[name] = count


class QueueDirectoryWriter:
    """Writes queue definitions to the directory topic (the coordinator and CLI use it)."""

    def __init__(
        self,
        bootstrap_servers: str | None = None,
        *,
        topic_prefix: str | None = None,
        kafka_config: Mapping[str, Any] | None = None,
        config: ClientConfig | None = None,
        timeout: float = 30.0,
    ) -> None:
        self._config = config or ClientConfig.resolve(bootstrap_servers, topic_prefix,
                                                      kafka_config)
        self.topic = self._config.topics.queues
        self._timeout = timeout
        self._producer = SdkProducer(self._config)
        self._ensured = False

    def _ensure_topic(self) -> None:
        if not self._ensured:
            ensure_topic(self._config, self.topic, partitions=1,
                         topic_config=dict(DIRECTORY_TOPIC_CONFIG), timeout=self._timeout)
            self._ensured = True

    def publish(self, definitions: Iterable[QueueDefinition], *,
                shards: Mapping[str, int] | None = None,
                shard_count: int | None = None) -> int:
        """Write each definition (the newest wins), with its shard when ``shards`` has it;
        waits until Kafka has them. Returns how many were written."""
        self._ensure_topic()
        count = 0
        placed = shards or {}
        for definition in definitions:
            key, value = encode_definition(definition, placed.get(definition.name),
                                           shard_count)
            self._producer.send(self.topic, key, value)
            count += 1
        self._producer.wait(self._timeout)
        return count

    def delete(self, names: Iterable[str]) -> int:
        """Write a tombstone for each queue name; waits until Kafka has them."""
        self._ensure_topic()
        count = 0
        for name in names:
            self._producer.send(self.topic, name.encode(), None)
            count += 1
        self._producer.wait(self._timeout)
        return count

    def sync(self, definitions: Iterable[QueueDefinition], *,
             shards: Mapping[str, int] | None = None,
             shard_count: int | None = None) -> tuple[int, int]:
        """Make the directory hold exactly ``definitions``: write them, and tombstone every
        queue the directory has that is not among them. Returns (written, deleted)."""
        wanted = list(definitions)
        names = {d.name for d in wanted}
        with QueueDirectory(config=self._config, timeout=self._timeout) as directory:
            stale = [d.name for d in directory.definitions() if d.name not in names]
        return (self.publish(wanted, shards=shards, shard_count=shard_count),
                self.delete(stale))

    def close(self) -> None:
        self._producer.wait(self._timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def publish_queue_definitions(
    definitions: Iterable[QueueDefinition],
    bootstrap_servers: str | None = None,
    *,
    topic_prefix: str | None = None,
    kafka_config: Mapping[str, Any] | None = None,
) -> int:
    """Write queue definitions to the directory topic (creating it if needed)."""
    with QueueDirectoryWriter(bootstrap_servers, topic_prefix=topic_prefix,
                              kafka_config=kafka_config) as writer:
        return writer.publish(definitions)


def delete_queue_definition(
    names: str | Iterable[str],
    bootstrap_servers: str | None = None,
    *,
    topic_prefix: str | None = None,
    kafka_config: Mapping[str, Any] | None = None,
) -> int:
    """Remove queues from the directory topic (tombstones)."""
    with QueueDirectoryWriter(bootstrap_servers, topic_prefix=topic_prefix,
                              kafka_config=kafka_config) as writer:
        return writer.delete([names] if isinstance(names, str) else names)


def sync_queue_definitions(
    definitions: Iterable[QueueDefinition],
    bootstrap_servers: str | None = None,
    *,
    topic_prefix: str | None = None,
    kafka_config: Mapping[str, Any] | None = None,
    shards: Mapping[str, int] | None = None,
    shard_count: int | None = None,
) -> tuple[int, int]:
    """Make the directory topic hold exactly these definitions; returns (written, deleted)."""
    with QueueDirectoryWriter(bootstrap_servers, topic_prefix=topic_prefix,
                              kafka_config=kafka_config) as writer:
        return writer.sync(definitions, shards=shards, shard_count=shard_count)
