"""A delivery the broker refuses as too large after the fact (issue 15 item 3).

A delivery topic whose ``max.message.bytes`` is below the coordinator producer's
``message.max.bytes`` takes the record locally; the broker then refuses it (MSG_SIZE_TOO_LARGE)
in a delivery report, a later iteration. The whole produce batch librdkafka sent for the
partition is refused with it, and a packed delivery batch carries many messages: the coordinator
sends each refused message again alone, dead-letters (reason ``too_large``) the one that is
still refused, and delivers the others, without rebuilding the shard. With ``--transactions``
the refusal fails the iteration's Kafka transaction instead: it is aborted (nothing of it was
readable) and written again with the refused records split, the same outcome."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from layer.protocol import EventType, TopicNames
from layer.protocol.headers import DLQ_LAST_CONSUMER, DLQ_REASON, DLQ_VALUE_OMITTED
from layer.sdk import QueueConsumer
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    EventReader,
    TopicReader,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

from .test_options_expiry_and_backoff import core
from .test_poison_input import _epochs, _shard_counters

__all__ = ["core"]  # the fixture, imported to run every test on both cores

pytestmark = pytest.mark.integration

#: The delivery topic's own limit: far below the producer's 1 MB.
_LIMIT = 4096


def _delivery_topic(settings: Settings, consumer_id: str) -> str:
    """The consumer's delivery topic, made before it subscribes with a small limit."""
    name = TopicNames(settings.topic_prefix).delivery(consumer_id)
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
    for future in admin.create_topics([NewTopic(name, 1, 1, config={
            "max.message.bytes": str(_LIMIT)})]).values():
        future.result(30)
    wait_until(lambda: name in admin.list_topics(timeout=10).topics or None)
    return name


def _journal(settings: Settings, name: str) -> list[bytes]:
    """Five small messages, one over the delivery topic's limit (random: lz4 does not shrink
    it), five small: returns the small ones, in order."""
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
    for future in admin.create_topics([NewTopic(name, 1, 1)]).values():
        future.result(30)
    wait_until(lambda: name in admin.list_topics(timeout=10).topics or None)
    small = [json.dumps({"n": i}).encode() for i in range(10)]
    produce(settings.bootstrap_servers, name, [*small[:5], os.urandom(3 * _LIMIT), *small[5:]],
            partition=0)
    return small


def _one_letter_without_its_value(settings: Settings, queue: str, consumer_id: str) -> None:
    """The queue's dead-letter topic holds one letter, too_large, without the value, naming
    the consumer whose delivery topic refused it."""
    dlq = TopicReader(settings.bootstrap_servers,
                      TopicNames(settings.topic_prefix).dead_letter(queue))
    try:
        letters = dlq.read_until(lambda rs: len(rs) >= 1)
        letters += dlq.read(1.0)
    finally:
        dlq.close()
    assert [dict(letter.headers or [])[DLQ_REASON] for letter in letters] == [b"too_large"]
    # As for a journal record over the producer's limit, the letter leaves the value out
    # (docs/protocol.md, ``qlayer.dlq.value-omitted``): it stays in its journal.
    assert dict(letters[0].headers or [])[DLQ_VALUE_OMITTED] == b"%d" % (3 * _LIMIT)
    assert dict(letters[0].headers or [])[DLQ_LAST_CONSUMER] == consumer_id.encode()


def _dead_lettered_alone(settings: Settings, queue: str, consumer_id: str) -> None:
    """The big message, and only it, was dead-lettered as too_large; no shard was rebuilt."""
    _one_letter_without_its_value(settings, queue, consumer_id)
    events = EventReader(settings)
    try:
        seen = events.read_until(lambda es: any(
            e.type is EventType.EXPIRED and e.reason == "too_large" for e in es))
    finally:
        events.close()
    assert [(e.type, e.bookmark.offset if e.bookmark else None) for e in seen
            if e.queue == queue and e.reason == "too_large"] == [
        (EventType.DEAD_LETTERED, 5), (EventType.EXPIRED, 5)]
    assert wait_until(lambda: _shard_counters(settings).get("too_large") == 1 or None,
                      timeout=20)


#: Each test runs with and without ``--transactions`` (a Kafka transaction per iteration).
_TRANSACTIONS = pytest.mark.parametrize("transactional", [False, True],
                                        ids=["plain", "transactions"])


@_TRANSACTIONS
def test_a_batch_refused_as_too_large_is_split_and_only_its_big_message_dead_lettered(
    core: str, transactional: bool, settings: Settings, unique_name: Callable[[str], str]
) -> None:
    journal = unique_name("Packed")
    small = _journal(settings, journal)
    put_queues(settings, {"name": "Packed", "underlying_topic": journal})
    consumer_id = unique_name("packer").replace(".", "-")
    _delivery_topic(settings, consumer_id)
    with running_coordinator(settings, core=core, transactional=transactional):
        before = _epochs(settings)
        worker = QueueConsumer("Packed", settings.bootstrap_servers, consumer_id=consumer_id,
                               topic_prefix=settings.topic_prefix, max_backlog=100)
        try:
            got = []
            while len(got) < 10:
                message = worker.receive(timeout=30)
                assert message is not None, f"only {len(got)} of 10 arrived"
                got.append(message.value)
                message.ack()
        finally:
            worker.close()
        assert sorted(got) == sorted(small)
        assert wait_for_counters(settings, "Packed", acked=10)["acked"] == 10
        _dead_lettered_alone(settings, "Packed", consumer_id)
        assert _epochs(settings) == before, "no shard was rebuilt"


@_TRANSACTIONS
def test_records_refused_as_too_large_are_sent_again_alone_and_the_big_one_dead_lettered(
    core: str, transactional: bool, settings: Settings, unique_name: Callable[[str], str]
) -> None:
    journal = unique_name("Plain")
    small = _journal(settings, journal)
    put_queues(settings, {"name": "Plain", "underlying_topic": journal})
    consumer_id = unique_name("plain").replace(".", "-")
    _delivery_topic(settings, consumer_id)
    with running_coordinator(settings, core=core, transactional=transactional):
        before = _epochs(settings)
        with Consumers(settings) as pool:
            worker = pool.subscribe("Plain", max_backlog=100, consumer_id=consumer_id)
            got = worker.receive(10, timeout=30)
            assert sorted(d.value for d in got) == sorted(small)
            worker.ack(got)
            assert wait_for_counters(settings, "Plain", acked=10)["acked"] == 10
            assert worker.ack_results() == [], "no ack refused"
        _dead_lettered_alone(settings, "Plain", consumer_id)
        assert _epochs(settings) == before, "no shard was rebuilt"


@_TRANSACTIONS
def test_an_at_most_once_delivery_refused_as_too_large_is_dead_lettered_from_its_queue_only(
    core: str, transactional: bool, settings: Settings, unique_name: Callable[[str], str]
) -> None:
    """At-most-once: the entry left Fast when the coordinator sent it, before the broker
    refused it. The message is dead-lettered anyway (reason too_large), with one DEAD_LETTERED
    after its DELIVERED_AT_MOST_ONCE and no EXPIRED (one outcome per entry). Slow reads the
    same journal through a delivery topic that takes it: it gets all eleven messages. Fast's
    consumer gets its ten small ones with a backlog of ten (the queue's default): the refused
    delivery's slot is freed, as the consumer could never ack it."""
    journal = unique_name("Both")
    small = _journal(settings, journal)
    put_queues(settings, {"name": "Fast", "underlying_topic": journal,
                          "semantics": "at-most-once"},
               {"name": "Slow", "underlying_topic": journal,
                "max_per_subscription_backlog": 100})
    consumer_id = unique_name("fast").replace(".", "-")
    _delivery_topic(settings, consumer_id)
    with running_coordinator(settings, core=core, transactional=transactional):
        before = _epochs(settings)
        with Consumers(settings) as pool:
            fast = pool.subscribe("Fast", max_backlog=100, consumer_id=consumer_id)
            slow = pool.subscribe("Slow", max_backlog=100)
            got = fast.receive(10, timeout=30)
            assert sorted(d.value for d in got) == sorted(small)
            fast.ack(got)
            everything = slow.receive(11, timeout=30)
            assert [len(d.value or b"") for d in everything].count(3 * _LIMIT) == 1
            slow.ack(everything)
            assert wait_for_counters(settings, "Slow", acked=11)["acked"] == 11
        counted = wait_for_counters(settings, "Fast", dead_lettered=1)
        assert (counted["dead_lettered"], counted.get("expired", 0)) == (1, 0)
        _one_letter_without_its_value(settings, "Fast", consumer_id)
        events = EventReader(settings)
        try:
            seen = events.read_until(lambda es: any(
                e.type is EventType.DEAD_LETTERED and e.queue == "Fast" for e in es))
        finally:
            events.close()
        assert [e.type for e in seen if e.queue == "Fast" and e.bookmark is not None
                and e.bookmark.offset == 5] == [
            EventType.ENQUEUED, EventType.LEASED, EventType.DELIVERED_AT_MOST_ONCE,
            EventType.DEAD_LETTERED]
        assert not any(e.queue == "Slow" and e.type in (EventType.DEAD_LETTERED,
                                                       EventType.EXPIRED) for e in seen)
        assert _epochs(settings) == before, "no shard was rebuilt"
