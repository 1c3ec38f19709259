"""Writing the queue directory (``P`` + ``queues``, compacted) from the coordinator.

`DirectoryWriter.sync` makes the topic hold exactly the given queues: each written (with its
shard, format 2 of `layer.protocol.directory`) and every other queue the topic still has
tombstoned. Publishers read it with `layer.sdk.QueueDirectory`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from layer.kafka.admin import KafkaAdmin, TopicSpec
from layer.kafka.errors import DRIVER_ERRORS, KafkaAdapterError, driver_error, translated
from layer.kafka.logs import logged
from layer.kafka.offsets import end_offset
from layer.kafka.records import OutgoingRecord
from layer.kafka.writer import RecordWriter
from layer.protocol.directory import encode_directory_record

__all__ = ["DIRECTORY_TOPIC_CONFIG", "DirectoryWriter"]

#: One partition keeps every change in one order; compaction keeps the latest per queue.
DIRECTORY_TOPIC_CONFIG: Mapping[str, str] = {"cleanup.policy": "compact"}


class DirectoryWriter:
    def __init__(self, config: Mapping[str, Any], topic: str, timeout: float = 30.0) -> None:
        self._config = dict(config)
        self.topic = topic
        self._timeout = timeout

    def sync(self, queues: Mapping[str, tuple[Mapping[str, Any], int]],
             shard_count: int) -> tuple[int, int]:
        """Write every queue's (definition, shard); tombstone the queues the topic has that
        are not given. Returns (written, deleted); waits until Kafka has them all."""
        KafkaAdmin(self._config).ensure_topics(
            [TopicSpec(self.topic, 1, DIRECTORY_TOPIC_CONFIG)], self._timeout)
        stale = self._live_names() - set(queues)
        records = [OutgoingRecord(self.topic, value, key)
                   for name, (definition, shard) in sorted(queues.items())
                   for key, value in [encode_directory_record(name, definition, shard,
                                                              shard_count)]]
        records += [OutgoingRecord(self.topic, None, name.encode()) for name in sorted(stale)]
        writer = RecordWriter(self._config)
        try:
            writer.send(records)
            writer.flush(self._timeout)
        finally:
            writer.close()
        return len(queues), len(stale)

    def _live_names(self) -> set[str]:
        """The queues the topic holds now (latest record not a tombstone)."""
        with translated(f"cannot read {self.topic}"):
            consumer = Consumer(logged({**self._config, "group.id": self.topic + ".writer",
                                 "enable.auto.commit": False, "enable.partition.eof": True,
                                 "auto.offset.reset": "earliest"}))
        live: dict[str, bool] = {}
        deadline = time.monotonic() + self._timeout
        try:
            # Past compaction the first record may be later than 0: reading to the partition's
            # end (EOF) settles that; only an empty topic is skipped here.
            high = end_offset(consumer, self.topic, 0, self._timeout, what=self.topic)
            if high == 0:
                return set()
            consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            done = False
            while not done:
                if time.monotonic() > deadline:
                    raise KafkaAdapterError(f"could not read {self.topic} to its end within "
                                            f"{self._timeout:g}s")
                for message in consumer.consume(1000, 0.2):
                    error = message.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            done = True
                        continue
                    key = message.key()
                    if key:
                        live[key.decode(errors="replace")] = message.value() is not None
                    if (message.offset() or 0) + 1 >= high:
                        done = True
        except DRIVER_ERRORS as exc:
            raise driver_error(f"cannot read {self.topic}", exc) from exc
        finally:
            with translated(f"cannot read {self.topic}"):
                consumer.close()
        return {name for name, alive in live.items() if alive}
