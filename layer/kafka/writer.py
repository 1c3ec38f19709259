"""Writing deliveries, dead letters, events and replies: one producer, batched, checked.

The coordinator calls `send` for a whole loop iteration's records. Records that must be safe
before the loop goes on (dead letters, records passed to other shards) are waited for with
`flush`, which raises if any record was not written. Deliveries, replies and event batches
are not waited for: `drain`, early in the next iteration, serves the delivery reports that
came in meanwhile, raises for any failure and says how many records are still in flight.
Postgres was written first, so a failure here leaves leases without deliveries: the shard is
rebuilt and sends them again (or they expire and are redelivered).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaException, Producer

from layer.kafka.errors import DeliveryFailed, KafkaAdapterError
from layer.kafka.records import OutgoingRecord
from layer.kafka.reports import DeliveryFailures

log = logging.getLogger(__name__)


class RecordWriter:
    """A batched, idempotent producer. With transactional_id, a zombie writer is fenced."""

    def __init__(self, config: Mapping[str, Any], transactional_id: str | None = None) -> None:
        self._reports = reports = DeliveryFailures()
        settings: dict[str, Any] = {
            # Delivery batches of JSON shrink several times; a deployment's `kafka:` settings
            # may choose another codec (or none: about 1 µs of CPU per message less here and
            # in each consumer, for payloads that do not compress).
            "compression.type": "lz4",
            **config,
            "enable.idempotence": True,
            "acks": "all",
            # No waiting for more: an iteration sends all it has at once (many messages per
            # delivery record), and librdkafka still batches whatever queues up while a
            # request is in flight. A linger here is added to every delivery's latency.
            "linger.ms": 0,
            "batch.num.messages": 10_000,
            "queue.buffering.max.messages": 1_000_000,
            "queue.buffering.max.kbytes": 1_048_576,
            # One producer-wide callback that librdkafka calls for failures only: a report
            # per written record cost a Python call per record, for nothing to do. Not a bound
            # method of self, which would keep the producer alive forever (reports.py).
            "on_delivery": reports,
            "delivery.report.only.error": True,
        }
        if transactional_id is not None:
            settings["transactional.id"] = transactional_id
        self._producer = Producer(settings)
        self._transactional = transactional_id is not None
        #: Whether records become readable only with `flush` (a Kafka transaction's commit).
        self.transactional = self._transactional
        self._in_transaction = False
        if self._transactional:
            try:
                self._producer.init_transactions(30)
            except KafkaException as exc:
                raise KafkaAdapterError(f"cannot initialise Kafka transactions: {exc}") from exc

    def send(self, records: Iterable[OutgoingRecord]) -> int:
        """Queue records for writing; returns how many. Nothing is guaranteed until flush()."""
        produce = self._producer.produce
        poll = self._producer.poll
        if self._transactional and not self._in_transaction:
            self._producer.begin_transaction()
            self._in_transaction = True
        n = 0
        try:
            for r in records:
                while True:
                    try:
                        # librdkafka's own defaults stand for "none": partition -1 lets the
                        # partitioner choose, timestamp 0 means now. (The stubs want a list of
                        # headers; any sequence of pairs is accepted.)
                        produce(r.topic, r.value, r.key,
                                partition=-1 if r.partition is None else r.partition,
                                timestamp=r.timestamp_ms or 0,
                                headers=r.headers or None)  # type: ignore[arg-type]
                        break
                    except BufferError:
                        # The local queue is full: let librdkafka drain it, then retry.
                        poll(0.05)
                n += 1
        except Exception as exc:
            # A record refused half-way (too large, an invalid topic): the records queued
            # before it must not be committed by the next flush with somebody else's.
            self._abort()
            if isinstance(exc, KafkaException):
                raise DeliveryFailed(f"Kafka refused a record: {exc}") from exc
            raise
        poll(0)
        return n

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued record is written; raise DeliveryFailed if any was not."""
        try:
            if self._in_transaction:
                self._producer.commit_transaction(timeout)
                self._in_transaction = False
            else:
                remaining = self._producer.flush(timeout)
                if remaining:
                    raise DeliveryFailed(f"{remaining} records not written within {timeout}s")
        except KafkaException as exc:
            self._abort()
            raise DeliveryFailed(f"writing to Kafka failed: {exc}") from exc
        failures = self._reports.take()
        if failures:
            raise DeliveryFailed(f"{len(failures)} records failed, first: {failures[0]}")

    def drain(self) -> int:
        """Serve the delivery reports that arrived, without waiting; raise DeliveryFailed if
        any record failed since the last check. Returns the records still in flight (queued
        or awaiting the broker's acknowledgement); 0 means every record sent so far is
        written. In a transaction nothing is written before `flush`."""
        try:
            self._producer.poll(0)
        except KafkaException as exc:
            raise DeliveryFailed(f"writing to Kafka failed: {exc}") from exc
        failures = self._reports.take()
        if failures:
            raise DeliveryFailed(f"{len(failures)} records failed, first: {failures[0]}")
        return len(self._producer)

    def _abort(self) -> None:
        if self._in_transaction:
            try:
                self._producer.abort_transaction(10)
            except KafkaException as exc:
                log.warning("aborting the Kafka transaction failed: %s", exc)
            self._in_transaction = False
            # The aborted records are reported as purged or failed: that write has failed
            # already, and the next one must not be failed for them.
            self._producer.poll(0)
            self._reports.take()

    def close(self, timeout: float = 10.0) -> None:
        self._abort()
        self._producer.flush(timeout)
