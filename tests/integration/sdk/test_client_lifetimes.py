"""Clients give back their librdkafka threads and broker connections once closed and dropped.

librdkafka holds delivery callbacks where Python's garbage collector cannot see them. A callback
bound to the client itself made a cycle that was never collected, so every publisher, consumer
and coordinator writer kept its producer (three threads and a connection on one broker) for the
rest of the process, closed or not.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from layer.kafka import OutgoingRecord, RecordWriter
from layer.protocol import Heartbeat
from layer.sdk import QueueConsumer, QueuePublisher
from tests.integration.sdk.peer import CoordinatorPeer


def rdkafka_threads() -> int:
    """librdkafka's threads in this process (it names them rdk:main, rdk:broker...)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            count += (task / "comm").read_text().startswith("rdk:")
    return count


def given_back(before: int, within: float = 10.0) -> int:
    """The rdkafka thread count once it is back to `before`, or after `within` seconds."""
    deadline = time.monotonic() + within
    while (now := rdkafka_threads()) > before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return now


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_a_publisher_gives_back_its_threads(
    bootstrap_servers: str, prefix: str, create_topic: Callable[..., str],
    unique_name: Callable[[str], str], close: bool,
) -> None:
    topic = create_topic(unique_name("events"), partitions=1)
    gc.collect()
    before = rdkafka_threads()
    publisher = QueuePublisher(bootstrap_servers, topic_prefix=prefix)
    publisher.flush()
    publisher.publish(topic, b"one")  # its delivery report is not polled yet
    assert rdkafka_threads() > before
    if close:
        publisher.close()
    gone = weakref.ref(publisher)
    del publisher
    gc.collect()
    assert gone() is None
    assert given_back(before) == before


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_a_record_writer_gives_back_its_threads(
    bootstrap_servers: str, create_topic: Callable[..., str], unique_name: Callable[[str], str],
    close: bool,
) -> None:
    topic = create_topic(unique_name("deliveries"), partitions=1)
    gc.collect()
    before = rdkafka_threads()
    writer = RecordWriter({"bootstrap.servers": bootstrap_servers})
    writer.send([OutgoingRecord(topic=topic, key=b"k", value=b"v")])
    assert rdkafka_threads() > before
    if close:
        writer.close()
    gone = weakref.ref(writer)
    del writer
    gc.collect()
    assert gone() is None
    assert given_back(before) == before


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_a_queue_consumer_gives_back_its_threads(
    bootstrap_servers: str, prefix: str, peer: CoordinatorPeer, close: bool,
) -> None:
    gc.collect()
    before = rdkafka_threads()
    answered = peer.answer_subscribe(heartbeat_interval_ms=200)
    consumer = QueueConsumer("Jobs", bootstrap_servers, topic_prefix=prefix)
    answered.result(timeout=30)
    # Heartbeats are sent in the background; the report of the last one is not polled yet.
    peer.wait_for(lambda: len(peer.of_kind(Heartbeat)) >= 2 or None, "heartbeats")
    assert rdkafka_threads() > before
    if close:
        consumer.close()
    # Dropped without close, as by a crashed caller: its session is left to time out.
    gone = weakref.ref(consumer)
    del consumer
    gc.collect()
    assert gone() is None
    assert given_back(before) == before
