"""A transactional relay: records written and consumer-group positions moved in one Kafka
transaction, so a crash neither loses nor repeats what was relayed."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from layer.kafka.errors import KafkaAdapterError

__all__ = ["TransactionalRelay"]


class TransactionalRelay:
    """A transactional producer and the consumer group whose positions it commits: records
    written and positions moved in one Kafka transaction (`qlayer dlq redrive`)."""

    def __init__(self, config: Mapping[str, Any], group: str) -> None:
        self.consumer = Consumer({
            **config,
            "group.id": group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "isolation.level": "read_committed", "enable.partition.eof": False})
        self.producer = Producer({
            **config,
            "transactional.id": group, "enable.idempotence": True, "acks": "all",
            "linger.ms": 5})
        try:
            self.producer.init_transactions(30)
        except KafkaException as exc:
            raise KafkaAdapterError(f"cannot initialise Kafka transactions: {exc}") from exc
        self.open = False

    def committed(self, pairs: list[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        try:
            found = self.consumer.committed([TopicPartition(t, p) for t, p in pairs], 10)
        except KafkaException as exc:
            raise KafkaAdapterError(f"reading the group's positions failed: {exc}") from exc
        return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None)
                for tp in found}

    def send(self, topic: str, value: bytes | None, key: bytes | None,
             headers: list[tuple[str, bytes | None]]) -> None:
        if not self.open:
            self.producer.begin_transaction()
            self.open = True
        while True:
            try:
                self.producer.produce(topic, value=value, key=key,
                                      headers=headers)  # type: ignore[arg-type]
                return
            except BufferError:
                self.producer.poll(0.05)
            except KafkaException as exc:
                raise KafkaAdapterError(f"writing to {topic} failed: {exc}") from exc

    def commit(self, positions: Mapping[tuple[str, int], int]) -> None:
        if not positions:
            return
        if not self.open:
            self.producer.begin_transaction()
            self.open = True
        offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
        try:
            self.producer.send_offsets_to_transaction(
                offsets, self.consumer.consumer_group_metadata(), 30)
            self.producer.commit_transaction(30)
        except KafkaException as exc:
            raise KafkaAdapterError(f"committing the transaction failed: {exc}") from exc
        self.open = False

    def close(self) -> None:
        if self.open:
            # Failing that, the broker aborts it on its own after the transaction timeout.
            with contextlib.suppress(KafkaException):
                self.producer.abort_transaction(10)
            self.open = False
        self.consumer.close()
