"""Kafka driver errors become qlayer errors here, at the adapter boundary."""

from __future__ import annotations

from layer.domain.errors import QlayerError


class KafkaAdapterError(QlayerError):
    """A Kafka operation failed; the message says which and why."""


class DeliveryFailed(KafkaAdapterError):
    """Records could not be written (after the producer's own retries)."""


class RetentionGap(KafkaAdapterError):
    """A partition's position is below its log start: retention deleted unread records.

    The coordinator rebuilds from its stored state on any adapter error, and its start-up
    reports entries lost to retention (reason ``retention``); so this never passes silently.
    """
