"""The coordinator's writer on a real broker: a write that fails leaves nothing visible."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from layer.kafka import OutgoingRecord, RecordWriter
from layer.kafka.errors import DeliveryFailed
from tests.support.coordinator import TopicReader

pytestmark = pytest.mark.integration


def test_a_record_refused_half_way_aborts_what_was_queued_before_it(
    bootstrap_servers: str, create_topic: Callable[..., str], unique_name: Callable[[str], str],
) -> None:
    topic = create_topic(unique_name("out"), partitions=1)
    writer = RecordWriter({"bootstrap.servers": bootstrap_servers},
                          transactional_id=f"test-writer-{uuid.uuid4().hex[:8]}")
    reader = TopicReader(bootstrap_servers, topic)
    try:
        too_large = b"x" * 2_000_000  # over the producer's message.max.bytes (1 MB)
        with pytest.raises(DeliveryFailed, match="Kafka refused a record"):
            writer.send([OutgoingRecord(topic, b"queued before the refusal"),
                         OutgoingRecord(topic, too_large)])
        # The next write is a transaction of its own: the first record is not committed
        # with it (read_committed, as the pipeline and the consumers read).
        writer.send([OutgoingRecord(topic, b"the next write")])
        writer.flush()
        deadline = time.monotonic() + 30
        seen: list[bytes | None] = []
        while b"the next write" not in seen and time.monotonic() < deadline:
            seen.extend(r.value for r in reader.read())
        assert seen == [b"the next write"]
    finally:
        reader.close()
        writer.close()


def test_a_transaction_the_broker_refuses_a_record_of_is_aborted_and_the_writer_goes_on(
    bootstrap_servers: str, unique_name: Callable[[str], str],
) -> None:
    """An abortable error (librdkafka's rule: the transaction can only be aborted): the
    broker refuses a record over the topic's max.message.bytes at commit time. The writer
    aborts and says so; it is replaced (as a rebuilt shard replaces it), and the next
    transaction commits alone."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = unique_name("small")
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": "1000"})])[
        topic].result(30)
    config = {"bootstrap.servers": bootstrap_servers, "compression.type": "none"}
    tid = f"test-writer-{uuid.uuid4().hex[:8]}"
    writer = RecordWriter(config, transactional_id=tid)
    reader = TopicReader(bootstrap_servers, topic)
    try:
        writer.send([OutgoingRecord(topic, b"aborted with it"),
                     OutgoingRecord(topic, b"x" * 5000)])  # the producer's limit is 1 MB
        with pytest.raises(DeliveryFailed) as caught:
            writer.flush()
        assert caught.value.abortable, caught.value
        assert writer.unusable is not None
        with pytest.raises(DeliveryFailed, match="unusable"):
            writer.send([OutgoingRecord(topic, b"refused")])
        writer.close()
        writer = RecordWriter(config, transactional_id=tid)
        writer.send([OutgoingRecord(topic, b"the next transaction")])
        writer.flush()
        deadline = time.monotonic() + 30
        seen: list[bytes | None] = []
        while b"the next transaction" not in seen and time.monotonic() < deadline:
            seen.extend(r.value for r in reader.read())
        assert seen == [b"the next transaction"]
    finally:
        reader.close()
        writer.close()


def test_wait_names_the_records_a_transaction_was_refused_for_without_committing(
    bootstrap_servers: str, unique_name: Callable[[str], str],
) -> None:
    """With ``keep_too_large`` a transactional writer says which records the broker refused
    as too large (`wait`, acknowledged but not committed), so its owner can write the
    transaction again without them (`ShardLoop._transact`); what was acknowledged in the
    aborted transaction is never readable, and a record waited for alone is committed."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = unique_name("small")
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": "1000"})])[
        topic].result(30)
    config = {"bootstrap.servers": bootstrap_servers, "compression.type": "none"}
    tid = f"test-writer-{uuid.uuid4().hex[:8]}"
    writer = RecordWriter(config, transactional_id=tid, keep_too_large=True)
    reader = TopicReader(bootstrap_servers, topic)
    try:
        writer.send([OutgoingRecord(topic, b"acknowledged, then aborted")])
        writer.wait()  # acknowledged alone: not refused, not committed
        big = b"x" * 5000
        writer.send([OutgoingRecord(topic, big)])
        with pytest.raises(DeliveryFailed):
            writer.wait()
        assert [r.value for r in writer.take_too_large()] == [big]
        writer.close()
        writer = RecordWriter(config, transactional_id=tid, keep_too_large=True)
        writer.send([OutgoingRecord(topic, b"written again")])
        writer.wait()
        writer.flush()
        deadline = time.monotonic() + 30
        seen: list[bytes | None] = []
        while b"written again" not in seen and time.monotonic() < deadline:
            seen.extend(r.value for r in reader.read())
        assert seen == [b"written again"]
        assert writer.take_too_large() == []
    finally:
        reader.close()
        writer.close()
