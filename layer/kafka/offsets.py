"""A partition's end offset asked of its leader, through an election.

A partition whose leader is being elected (a topic made a moment ago, a broker just back)
answers NOT_LEADER / LEADER_NOT_AVAILABLE / UNKNOWN_LEADER_EPOCH for a few hundred ms. Every
reader that asks for an end offset before reading a topic to it asks again until its
timeout rather than failing: CI failed once on a queue directory read the instant after a
coordinator had made the topic ("Failed to get watermark offsets: Broker: Not leader for
partition").
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from layer.kafka.errors import KafkaAdapterError

__all__ = ["LEADER_MOVING", "end_offset"]

#: Errors of a partition whose leadership is moving: they pass once its election is over.
#: UNKNOWN_LEADER_EPOCH / FENCED_LEADER_EPOCH come when librdkafka's metadata and the broker's
#: disagree about the leader's epoch for a moment (CI once failed on "Leader epoch is newer
#: than broker epoch"); OFFSET_NOT_AVAILABLE while a new leader catches up its high watermark.
LEADER_MOVING = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.OFFSET_NOT_AVAILABLE,
})

#: What an end-offset request meets for a moment and then not: a moving leader, a topic the
#: broker answering has not learnt of yet, a broker that is starting (librdkafka does not
#: mark all of them retriable on a watermark request; the soak saw consumers started right
#: after a broker restart fail at once).
_PASSING = LEADER_MOVING | {
    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TRANSPORT, KafkaError._TIMED_OUT}

#: Pause between two askings while a leader is elected.
RETRY_PAUSE = 0.2


def end_offset(consumer: Any, topic: str, partition: int, timeout: float, *,
               what: str) -> int:
    """The partition's high watermark from its leader (not librdkafka's cache), asked again
    while the broker answers with a retriable error, until ``timeout``; then a
    `KafkaAdapterError` saying ``what`` could not be read."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, partition),
                timeout=max(0.5, deadline - time.monotonic()), cached=False)
            return int(high)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            retriable = isinstance(error, KafkaError) and (
                error.retriable() or error.code() in _PASSING)
            if not retriable or time.monotonic() >= deadline:
                raise KafkaAdapterError(
                    f"cannot read the end of {what}: {exc}",
                    code=error.name() if isinstance(error, KafkaError) else None,
                    retriable=retriable) from exc
            time.sleep(RETRY_PAUSE)
