"""A transactional relay: records written and consumer-group positions moved in one Kafka
transaction, so a crash neither loses nor repeats what was relayed."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from layer.kafka.errors import DRIVER_ERRORS, driver_error, translated
from layer.kafka.logs import logged

__all__ = ["TransactionalRelay"]


class TransactionalRelay:
    """A transactional producer and the consumer group whose positions it commits: records
    written and positions moved in one Kafka transaction (`qlayer dlq redrive`)."""

    def __init__(self, config: Mapping[str, Any], group: str) -> None:
        with translated("cannot create the relay's Kafka clients"):
            self.consumer = Consumer(logged({
                **config,
                "group.id": group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
                "isolation.level": "read_committed", "enable.partition.eof": False}))
            self.producer = Producer(logged({
                **config,
                "transactional.id": group, "enable.idempotence": True, "acks": "all",
                "linger.ms": 5}))
        with translated("cannot initialise Kafka transactions"):
            self.producer.init_transactions(30)
        self.open = False

    def committed(self, pairs: list[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        with translated("reading the group's positions failed"):
            found = self.consumer.committed([TopicPartition(t, p) for t, p in pairs], 10)
        return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None)
                for tp in found}

    def send(self, topic: str, value: bytes | None, key: bytes | None,
             headers: list[tuple[str, bytes | None]]) -> None:
        self._begin()
        while True:
            try:
                self.producer.produce(topic, value=value, key=key,
                                      headers=headers)  # type: ignore[arg-type]
                return
            except BufferError:
                with translated(f"writing to {topic} failed"):
                    self.producer.poll(0.05)
            except DRIVER_ERRORS as exc:
                raise driver_error(f"writing to {topic} failed", exc) from exc

    def _begin(self) -> None:
        if not self.open:
            with translated("cannot begin a Kafka transaction"):
                self.producer.begin_transaction()
            self.open = True

    def commit(self, positions: Mapping[tuple[str, int], int]) -> None:
        if not positions:
            return
        self._begin()
        offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
        # A one-off operator command: a failure here is reported and the command run again
        # (a new relay's init_transactions settles whatever this one left open).
        with translated("committing the transaction failed"):
            self.producer.send_offsets_to_transaction(
                offsets, self.consumer.consumer_group_metadata(), 30)
            self.producer.commit_transaction(30)
        self.open = False

    def close(self) -> None:
        if self.open:
            # Failing that, the broker aborts it on its own after the transaction timeout.
            with contextlib.suppress(*DRIVER_ERRORS):
                self.producer.abort_transaction(10)
            self.open = False
        with translated("closing the relay's consumer failed"):
            self.consumer.close()
