from __future__ import annotations

import pytest

from layer.protocol import (
    MAX_TOPIC_NAME_LENGTH,
    ProtocolError,
    ProtocolErrorKind,
    TopicNames,
    topic_name_problem,
    validate_topic_name,
)


def test_default_names() -> None:
    names = TopicNames()
    assert names.prefix == "qlayer."
    assert names.control == "qlayer.control"
    assert names.ack == "qlayer.ack"
    assert names.events == "qlayer.events"
    assert names.delivery("worker-1") == "qlayer.delivery.worker-1"
    assert names.dead_letter("Jobs") == "qlayer.dlq.Jobs"
    assert names.queue_group("Jobs") == "qlayer.queue.Jobs"


def test_one_prefix_moves_every_name() -> None:
    names = TopicNames("acme_q-")
    assert [
        names.control,
        names.ack,
        names.events,
        names.delivery("c"),
        names.dead_letter("Q"),
    ] == [
        "acme_q-control",
        "acme_q-ack",
        "acme_q-events",
        "acme_q-delivery.c",
        "acme_q-dlq.Q",
    ]
    assert names == TopicNames("acme_q-") != TopicNames()


def test_internal_topics_are_recognised() -> None:
    names = TopicNames()
    assert names.is_internal("qlayer.delivery.worker-1")
    assert names.is_internal(names.events)
    assert not names.is_internal("orders")
    assert not names.is_internal("qlayer-orders")


@pytest.mark.parametrize(
    ("prefix", "words"),
    [
        ("", "cannot be empty"),
        ("q layer.", "may only contain a-z A-Z 0-9 . _ - (found ' ')"),
        ("qlayer/", "(found '/')"),
        ("x" * 245, "at most 249 characters"),
    ],
)
def test_bad_prefix_is_refused(prefix: str, words: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        TopicNames(prefix)
    assert caught.value.kind is ProtocolErrorKind.BAD_TOPIC_NAME
    assert "topic prefix" in str(caught.value)
    assert words in str(caught.value)


def test_consumer_id_that_cannot_be_in_a_topic_name_is_named() -> None:
    with pytest.raises(ProtocolError) as caught:
        TopicNames().delivery("worker#1")
    assert "delivery topic of consumer 'worker#1'" in str(caught.value)
    assert "(found '#')" in str(caught.value)


def test_queue_name_too_long_for_a_dead_letter_topic_is_named() -> None:
    queue = "Q" * (MAX_TOPIC_NAME_LENGTH - len("qlayer.dlq.") + 1)
    with pytest.raises(ProtocolError) as caught:
        TopicNames().dead_letter(queue)
    assert "dead-letter topic of queue" in str(caught.value)
    assert "at most 249 characters, this one has 250" in str(caught.value)


def test_longest_legal_topic_name() -> None:
    assert validate_topic_name("a" * 249) == "a" * 249
    assert topic_name_problem("a" * 250) is not None


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_names_are_illegal(name: str) -> None:
    assert topic_name_problem(name) == f"{name!r} is not allowed as a topic name"


def test_non_ascii_letters_are_illegal() -> None:
    assert topic_name_problem("café") is not None


def test_queue_directory_topic_is_internal_and_follows_the_prefix() -> None:
    assert TopicNames().queues == "qlayer.queues"
    assert TopicNames("acme_q-").queues == "acme_q-queues"
    assert TopicNames().is_internal(TopicNames().queues)
    # Distinct from every other internal name, including a queue's consumer group.
    names = TopicNames()
    assert names.queues not in {names.control, names.ack, names.events, names.queue_group("s")}
