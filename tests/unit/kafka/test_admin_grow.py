"""Growing a topic another process grew first (two coordinators starting together)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from layer.kafka.admin import _already_has


def _refusal(message: str) -> KafkaException:
    # What librdkafka raises from a CreatePartitions future the broker refused.
    return KafkaException(KafkaError(KafkaError.INVALID_PARTITIONS, message))


def test_a_topic_that_already_has_enough_partitions_is_not_an_error() -> None:
    assert _already_has(_refusal("Topic already has 4 partition(s)."), 4)
    assert _already_has(_refusal("Topic already has 8 partition(s)."), 4)


def test_a_topic_with_fewer_partitions_or_another_refusal_is_still_an_error() -> None:
    assert not _already_has(_refusal("Topic already has 2 partition(s)."), 4)
    assert not _already_has(_refusal("Number of partitions must be larger than 0."), 4)
