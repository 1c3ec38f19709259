"""Reading partitions between given offsets, then stopping: the operator tools' one-off scans
(`qlayer view`, `qlayer dlq`), the demo's look at a dead-letter topic."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from layer.kafka.errors import KafkaAdapterError, translated
from layer.kafka.logs import logged
from layer.kafka.records import JournalRecord

__all__ = ["RangeScanner"]


class RangeScanner:
    """Reads partitions between given offsets, then stops: for the CLI's one-off scans.

    Partition EOF events, not the last offset, end a partition: a topic written with Kafka
    transactions ends with a commit marker, which is an offset no record is ever read at.
    """

    def __init__(self, config: Mapping[str, Any], group_id: str) -> None:
        with translated("cannot create a Kafka consumer"):
            self._consumer = Consumer(logged({
                **config,
                "group.id": group_id, "enable.auto.commit": False,
                "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
                "enable.partition.eof": True, "isolation.level": "read_committed"}))
        self._pending: dict[tuple[str, int], int] = {}

    def read(self, starts: Mapping[tuple[str, int], int], ends: Mapping[tuple[str, int], int],
             *, stall_timeout: float = 30.0) -> Iterator[JournalRecord]:
        """Every record from ``starts`` up to (not including) ``ends``, per partition in order.

        ``stop(partition)`` while iterating ends one partition early.
        """
        self._pending = {tp: end for tp, end in ends.items() if starts.get(tp, end) < end}
        pending = self._pending
        if not pending:
            return
        with translated(f"reading {sorted(pending)} failed"):
            self._consumer.assign([TopicPartition(t, p, starts[(t, p)]) for t, p in pending])
        last_progress = time.monotonic()
        while pending:
            with translated(f"reading {sorted(pending)} failed"):
                messages = self._consumer.consume(1000, 0.5)
            if not messages and time.monotonic() - last_progress > stall_timeout:
                raise KafkaAdapterError(
                    f"reading {sorted(pending)} stalled below their end offsets; is Kafka up?")
            for m in messages:
                tp: tuple[str, int] = (m.topic(), m.partition())  # type: ignore[assignment]
                end = pending.get(tp)
                if end is None:
                    continue
                last_progress = time.monotonic()
                error = m.error()
                offset = m.offset() or 0
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF and offset >= end:
                        del pending[tp]
                    continue
                if offset >= end:
                    del pending[tp]
                    continue
                yield JournalRecord(tp[0], tp[1], offset, m.key(), m.value(),
                                    m.timestamp()[1], m.headers())  # type: ignore[arg-type]
                if offset + 1 >= end:
                    pending.pop(tp, None)

    def stop(self, partition: tuple[str, int]) -> None:
        """Read no more of this partition (records already fetched are skipped)."""
        self._pending.pop(partition, None)

    def close(self) -> None:
        with translated("closing a Kafka consumer failed"):
            self._consumer.close()
