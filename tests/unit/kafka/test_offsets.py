"""End offsets asked through a leader election: asked again, not failed (CI failed once on a
queue directory read the instant after a coordinator made the topic)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from layer.kafka import offsets
from layer.kafka.errors import KafkaAdapterError
from layer.kafka.offsets import end_offset


class Answers:
    """A stand-in for librdkafka's watermark call that answers from a script: this tests the
    retry rule, not Kafka (the integration tests read real brokers through the same call)."""

    def __init__(self, *answers: int) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, int, bool]] = []

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float,
                              cached: bool) -> tuple[int, int]:
        self.asked.append((tp.topic, tp.partition, cached))
        answer = self.answers.pop(0)
        if answer < 0:
            raise KafkaException(KafkaError(-answer))
        return 0, answer


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offsets, "RETRY_PAUSE", 0.0)


def test_a_partition_whose_leader_is_being_elected_is_asked_again_until_it_answers() -> None:
    reader: Any = Answers(-KafkaError.NOT_LEADER_FOR_PARTITION,
                          -KafkaError.LEADER_NOT_AVAILABLE,
                          -KafkaError.UNKNOWN_LEADER_EPOCH, 42)
    assert end_offset(reader, "q.queues", 3, 5.0, what="queue directory q.queues") == 42
    # Every asking goes to the leader, never to librdkafka's cached figure.
    assert reader.asked == [("q.queues", 3, False)] * 4


def test_an_error_that_does_not_pass_fails_at_once_with_what_was_read() -> None:
    reader: Any = Answers(-KafkaError.TOPIC_AUTHORIZATION_FAILED, 7)
    with pytest.raises(KafkaAdapterError) as raised:
        end_offset(reader, "q.queues", 0, 5.0, what="queue directory q.queues")
    assert "cannot read the end of queue directory q.queues" in str(raised.value)
    assert raised.value.code == "TOPIC_AUTHORIZATION_FAILED"
    assert not raised.value.retriable
    assert len(reader.asked) == 1


def test_an_election_that_outlasts_the_timeout_fails_as_retriable() -> None:
    reader: Any = Answers(*[-KafkaError.NOT_LEADER_FOR_PARTITION] * 1000)
    with pytest.raises(KafkaAdapterError) as raised:
        end_offset(reader, "q.queues", 0, 0.0, what="queue directory q.queues")
    assert raised.value.retriable
    assert raised.value.code == "NOT_LEADER_FOR_PARTITION"
