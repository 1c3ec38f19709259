"""Kafka driver errors become qlayer errors here, at the adapter boundary."""

from __future__ import annotations

from layer.domain.errors import QlayerError


class KafkaAdapterError(QlayerError):
    """A Kafka operation failed; the message says which and why."""


class DeliveryFailed(KafkaAdapterError):
    """Records could not be written (after the producer's own retries)."""
