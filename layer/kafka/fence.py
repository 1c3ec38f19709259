"""Fencing a consumer's Kafka producer by its transactional.id (exactly-once processing,
protocol 9; `layer.coordinator.fences` says when and why).

Initialising a producer with a transactional.id (Kafka's InitProducerId) aborts any
transaction of that id still open and bumps the id's epoch, so the producer that had it can
write nothing more: a paused consumer that wakes up finds its transaction aborted and its
commit refused (``PRODUCER_FENCED``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import Producer

from layer.kafka.errors import translated
from layer.kafka.logs import logged

__all__ = ["fence_producer"]


def fence_producer(config: Mapping[str, Any], transactional_id: str, timeout: float) -> None:
    """Fence ``transactional_id``; raises `KafkaAdapterError` when it could not be done within
    ``timeout`` (the caller tries again: until then the session's leases stay held)."""
    with translated(f"cannot fence transactional id {transactional_id!r}"):
        producer = Producer(logged({**config, "transactional.id": transactional_id,
                                    "client.id": "qlayer-fence"}))
        try:
            producer.init_transactions(timeout)
        finally:
            # Nothing was sent: the client goes without waiting for anything.
            producer.flush(0)
